"""Python client of the rocforge daemon (ZeroMQ DEALER + msgpack).

    with connect("tcp://127.0.0.1:5555") as client:
        for reply in client.generate(messages=[{"role": "user", "content": "Hi"}]):
            print(reply.text, end="", flush=True)

Every call takes a `timeout` in seconds (the client's default when omitted): the
longest wait for one reply, after which `Timeout` is raised. `deadline` asks the
daemon to stop the request's work after that many seconds. Errors from the
daemon raise the `ClientError` subclass of their code (see ERRORS). A Client
owns one socket: use it from one thread (one Client per thread). One thread may
drive many: poll their `socket`s together (zmq.Poller), `send` and `receive`.

A session belongs to whoever holds its token: `open` (and a one-shot `generate`)
replies with it (`TokenReply.token`), and the client sends it with every later op
on that session by itself. Another client (or this one after a reconnect) takes a
session over with `adopt(session, token)`, or passes `token=` to the call.
"""

from pathlib import Path

from rocforge_client.connection import MAX_REPLY_BYTES
from rocforge_client.errors import (
    ERRORS,
    Aborted,
    BadAddress,
    BadRequest,
    Busy,
    ClientError,
    ContextFull,
    DeadlineExceeded,
    Forbidden,
    Internal,
    LimitExceeded,
    NotReady,
    RateLimited,
    SessionBusy,
    ShuttingDown,
    Timeout,
    TooLarge,
    TurnFinished,
    UnknownOp,
    UnknownSession,
    raise_for_error,
)
from rocforge_client.queries import OperatorQueries
from rocforge_client.sessions import Sessions, Token, TokenReply

__all__ = [
    "ERRORS",
    "MAX_REPLY_BYTES",
    "Aborted",
    "BadAddress",
    "BadRequest",
    "Busy",
    "Client",
    "ClientError",
    "ContextFull",
    "DeadlineExceeded",
    "Forbidden",
    "Internal",
    "LimitExceeded",
    "NotReady",
    "RateLimited",
    "SessionBusy",
    "ShuttingDown",
    "Timeout",
    "Token",
    "TokenReply",
    "TooLarge",
    "TurnFinished",
    "UnknownOp",
    "UnknownSession",
    "connect",
    "raise_for_error",
]


class Client(Sessions, OperatorQueries):
    """A connection to one daemon. Calls are sequential; see the module docstring."""


def connect(addr: str, *, curve_keys: str | Path | None = None, timeout: float = 30.0) -> Client:
    """A Client for the daemon at `addr` (CURVE keys folder: client.key_secret, server.key)."""
    return Client(addr, curve_keys=curve_keys, timeout=timeout)

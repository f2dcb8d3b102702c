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

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from rocforge_rt.server.security import endpoint_problem, secure_client

MAX_REPLY_BYTES = 64 << 20


class ClientError(Exception):
    """An error reply from the daemon (or a client-side failure: Timeout)."""

    code = "client_error"

    def __init__(self, message: str, reply: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reply = dict(reply or {})


class Timeout(ClientError, TimeoutError):
    """No reply within the call's timeout (the daemon is down, busy elsewhere, or unreachable)."""

    code = "timeout"


class BadAddress(ClientError, ValueError):
    """The daemon address is malformed (no tcp:// or ipc:// scheme, a port outside 1-65535)."""

    code = "bad_address"


class BadRequest(ClientError):
    """The request is malformed: msgpack, type, range or field."""

    code = "bad_request"


class UnknownOp(ClientError):
    """The daemon has no such op."""

    code = "unknown_op"


class UnknownSession(ClientError):
    """The session is not open for this client (closed, expired, never opened)."""

    code = "unknown_session"


class SessionBusy(ClientError):
    """Another request is running on the session."""

    code = "session_busy"


class TurnFinished(ClientError):
    """The session's turn has ended: append another turn."""

    code = "turn_finished"


class Busy(ClientError):
    """Every session slot of the daemon is taken and its queue is full (or off), or the
    request waited for a slot past the daemon's --max-queue-time: retry later."""

    code = "busy"


class ContextFull(ClientError):
    """The turn does not fit in the session's context window."""

    code = "context_full"


class TooLarge(ClientError):
    """The request is larger than the daemon accepts."""

    code = "too_large"


class LimitExceeded(ClientError):
    """The prompt or max_tokens is over the daemon's per-request limits."""

    code = "limit_exceeded"


class Aborted(ClientError):
    """The request was aborted (or its session closed) before its first token."""

    code = "aborted"


class DeadlineExceeded(ClientError):
    """The request's deadline passed before its first token."""

    code = "deadline_exceeded"


class NotReady(ClientError):
    """The daemon is still loading its model."""

    code = "not_ready"


class ShuttingDown(ClientError):
    """The daemon is stopping and takes no new work."""

    code = "shutting_down"


class Forbidden(ClientError):
    """An operator op (stats reset, trace, profile) off loopback without the operator key."""

    code = "forbidden"


class RateLimited(ClientError):
    """This client was refused too often in the last second (malformed requests, unknown
    sessions...): its messages are dropped unread until the second is over."""

    code = "rate_limited"


class Internal(ClientError):
    """The daemon failed on this request (a bug); other requests are unaffected."""

    code = "internal"


ERRORS: dict[str, type[ClientError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownOp,
        UnknownSession,
        SessionBusy,
        TurnFinished,
        Busy,
        ContextFull,
        TooLarge,
        LimitExceeded,
        Aborted,
        DeadlineExceeded,
        NotReady,
        ShuttingDown,
        Internal,
        Forbidden,
        RateLimited,
    )
}


@dataclass(frozen=True)
class Token:
    token: int
    text: str
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenReply:
    """Tokens from open, append, step, or one message of a generate stream."""

    session: int
    tokens: tuple[Token, ...]
    text: str  # the text this reply releases (UTF-8-safe, stop strings cut)
    finish_reason: str | None  # stop_token, stop_string, length, abort, error; None: going on
    done: bool  # the request has ended (always True except mid-stream)
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    abort_reason: str | None = None
    token: str | None = None  # the session's token: in the first reply of the op that opened it

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> "TokenReply":
        tokens = tuple(
            Token(t["token"], t["text"], t["logprob"], tuple(map(tuple, t.get("top_logprobs", ()))))
            for t in reply["tokens"]
        )
        return cls(
            session=reply["session"],
            tokens=tokens,
            text=reply["text"],
            finish_reason=reply["finish_reason"],
            done=reply.get("done", True),
            usage=reply.get("usage", {}),
            timings=reply.get("timings", {}),
            abort_reason=reply.get("abort_reason"),
            token=reply.get("token"),
        )


def raise_for_error(reply: Mapping[str, Any]) -> None:
    if reply.get("ok"):
        return
    error = reply.get("error") or {}
    code, message = error.get("code", "internal"), error.get("message", "no message")
    raise ERRORS.get(code, ClientError)(f"{code}: {message}", reply)


class Client:
    """A connection to one daemon. Calls are sequential; see the module docstring."""

    def __init__(
        self,
        addr: str,
        *,
        curve_keys: str | Path | None = None,
        timeout: float = 30.0,
        context: zmq.Context | None = None,
    ) -> None:
        problem = endpoint_problem(addr, bind=False)
        if problem is not None:
            raise BadAddress(f"cannot connect to {addr}: {problem}")
        self.addr = addr
        self.timeout = timeout
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        self._socket.maxmsgsize = MAX_REPLY_BYTES
        # a send waits for a connection no longer than a reply would (a handshake refused,
        # say: ZeroMQ drops the pipe it would queue on, and a send then blocks)
        self._socket.sndtimeo = max(1, int(timeout * 1000))
        try:
            if curve_keys is not None:
                secure_client(self._socket, Path(curve_keys))
            self._socket.connect(addr)
        except zmq.ZMQError as exc:  # a host name that does not resolve, say
            self._socket.close(linger=0)
            raise BadAddress(f"cannot connect to {addr}: {exc}") from None
        except BaseException:
            self._socket.close(linger=0)
            raise
        self._ids = itertools.count(1)
        self._tokens: dict[int, str] = {}  # session -> its token (from open/generate, or adopt)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.disconnect()

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER socket, to poll several clients from one thread: a client whose socket
        is readable has a reply for `receive`."""
        return self._socket

    def disconnect(self) -> None:
        """Close the socket (sessions stay open on the daemon until closed or idle)."""
        self._socket.close(linger=0)

    # --- transport ----------------------------------------------------------------------------
    def send(self, op: str, **fields: Any) -> int:
        """Send a request (fields that are None are left out); returns its id."""
        rid = next(self._ids)
        request = {"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}
        try:
            self._socket.send(msgpack.packb(request, use_bin_type=True))
        except zmq.Again:
            raise Timeout(f"could not send to {self.addr} in time (not connected)") from None
        return rid

    def receive(self, rid: int, timeout: float | None = None) -> dict[str, Any]:
        """The next reply to request `rid` (replies to other ids are dropped)."""
        limit = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = limit - time.monotonic()
            if left <= 0 or not self._socket.poll(max(1, int(left * 1000))):
                raise Timeout(f"no reply from {self.addr} to request {rid} in time")
            reply = msgpack.unpackb(self._socket.recv_multipart()[-1], raw=False)
            if not isinstance(reply, dict):
                continue
            if reply.get("id") == rid:
                return reply
            if reply.get("id") is None and not reply.get("ok"):  # the daemon could not read an id
                raise_for_error(reply)

    def call(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """One request, one reply; raises the reply's error."""
        reply = self.receive(self.send(op, **fields), timeout)
        raise_for_error(reply)
        return reply

    # --- ops ----------------------------------------------------------------------------------
    def info(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call("info", timeout=timeout)

    def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call("health", timeout=timeout)

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.1) -> dict[str, Any]:
        """Ask `health` until the daemon is ready; Timeout when it is not ready in time."""
        limit = time.monotonic() + timeout
        while True:
            left = limit - time.monotonic()
            try:
                health = self.health(timeout=max(0.05, min(1.0, left)))
                if health["ready"]:
                    return health
            except Timeout:
                pass
            if time.monotonic() >= limit:
                raise Timeout(f"{self.addr} not ready within {timeout} s")
            time.sleep(poll)

    def stats(
        self,
        *,
        reset: bool = False,
        records: int = 0,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The daemon's stats; `reset` needs `operator_key` off loopback."""
        return self.call(
            "stats",
            timeout=timeout,
            reset=reset or None,
            records=records or None,
            operator_key=operator_key,
        )

    def metrics(self, *, timeout: float | None = None) -> str:
        """The daemon's Prometheus metrics, in the text exposition format."""
        return self.call("metrics", timeout=timeout)["text"]

    def trace(
        self,
        *,
        steps: int | None = None,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Chrome/Perfetto trace JSON of the daemon's last steps (operator key off loopback)."""
        return self.call("trace", timeout=timeout, steps=steps, operator_key=operator_key)["trace"]

    def profile(
        self,
        *,
        launches: bool | None = None,
        kernels: bool | None = None,
        every: int | None = None,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Switch the launch tracker and the kernel timer (None: unchanged); their state
        (operator key off loopback)."""
        return self.call(
            "profile",
            timeout=timeout,
            launches=launches,
            kernels=kernels,
            every=every,
            operator_key=operator_key,
        )

    # --- session tokens -----------------------------------------------------------------------
    def adopt(self, session: int, token: str) -> None:
        """Use `token` for `session` from now on (a session opened by another connection)."""
        self._tokens[session] = token

    def token(self, session: int) -> str | None:
        """The token this client holds for `session` (None: none)."""
        return self._tokens.get(session)

    def _remember(self, reply: "TokenReply") -> "TokenReply":
        if reply.token is not None:
            self._tokens[reply.session] = reply.token
        return reply

    def _token_for(self, session: int, token: str | None) -> str | None:
        if token is not None:
            self._tokens[session] = token
        return self._tokens.get(session)

    def open(
        self,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        **turn: Any,
    ) -> TokenReply:
        """Open a session with a prompt; the reply holds its id and first token.

        `turn` takes max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        frequency_penalty, presence_penalty, seed, logprobs and stop (the protocol's turn
        fields; README.md, "Protocol"; the sampling rules: rocforge_rt/step/sampling.py).
        """
        fields = _turn_fields(prompt, tokens, messages, deadline, turn)
        return self._remember(TokenReply.from_reply(self.call("open", timeout=timeout, **fields)))

    def append(
        self,
        session: int,
        prompt: str | None = None,
        *,
        tokens: Sequence[int] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
        **turn: Any,
    ) -> TokenReply:
        """Another turn (text or ids) into a session; the reply holds its first token.
        `turn` takes what `open`'s does."""
        fields = _turn_fields(prompt, tokens, None, deadline, turn)
        token = self._token_for(session, token)
        return TokenReply.from_reply(
            self.call("append", timeout=timeout, session=session, token=token, **fields)
        )

    def step(
        self,
        session: int,
        n: int = 1,
        *,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
    ) -> TokenReply:
        """The next n tokens of a session's turn (fewer if the turn ends)."""
        token = self._token_for(session, token)
        reply = self.call(
            "step", timeout=timeout, session=session, n=n, deadline_ms=_ms(deadline), token=token
        )
        return TokenReply.from_reply(reply)

    def generate(
        self,
        prompt: str | None = None,
        *,
        session: int | None = None,
        tokens: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        deadline: float | None = None,
        timeout: float | None = None,
        token: str | None = None,
        **turn: Any,
    ) -> Iterator[TokenReply]:
        """Stream a generation: of a new prompt (in a session of its own, closed at the end),
        or the rest of an open session's turn. The last reply has `done` True. Leaving the
        loop early aborts the request. A new prompt's `turn` takes what `open`'s does."""
        if session is not None:
            token = self._token_for(session, token)
            fields: dict[str, Any] = {"session": session, "deadline_ms": _ms(deadline)}
            fields["token"] = token
        else:
            fields = _turn_fields(prompt, tokens, messages, deadline, turn)
        rid = self.send("generate", **fields)
        done = False
        try:
            while not done:
                reply = self.receive(rid, timeout)
                raise_for_error(reply)
                result = self._remember(TokenReply.from_reply(reply))
                done = result.done
                if done and session is None:  # its own session closed with it
                    self._tokens.pop(result.session, None)
                yield result
        finally:
            if not done:
                self.send("abort", request=rid)

    def abort(
        self,
        *,
        session: int | None = None,
        request: int | None = None,
        timeout: float | None = None,
        token: str | None = None,
    ) -> bool:
        """Stop the request running on a session (or with that id); False if none was."""
        if session is not None:
            token = self._token_for(session, token)
        fields = {"session": session, "request": request, "token": token}
        return self.call("abort", timeout=timeout, **fields)["aborted"]

    def close(
        self, session: int, *, timeout: float | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """Close a session (aborting its running request) and free its slot."""
        reply = self.call(
            "close", timeout=timeout, session=session, token=self._token_for(session, token)
        )
        self._tokens.pop(session, None)
        return reply


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _turn_fields(
    prompt: str | None,
    tokens: Sequence[int] | None,
    messages: Sequence[Mapping[str, str]] | None,
    deadline: float | None,
    turn: Mapping[str, Any],
) -> dict[str, Any]:
    stop = turn.get("stop")
    return {
        **turn,
        "prompt": prompt,
        "tokens": None if tokens is None else list(tokens),
        "messages": None if messages is None else [dict(m) for m in messages],
        "stop": [stop] if isinstance(stop, str) else (list(stop) if stop else None),
        "deadline_ms": _ms(deadline),
    }


def connect(addr: str, *, curve_keys: str | Path | None = None, timeout: float = 30.0) -> Client:
    """A Client for the daemon at `addr` (CURVE keys folder: client.key_secret, server.key)."""
    return Client(addr, curve_keys=curve_keys, timeout=timeout)

"""The client's errors: `ClientError`, one subclass a daemon error code (`ERRORS`), and
`raise_for_error`, which raises a reply's."""

from collections.abc import Mapping
from typing import Any


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


def raise_for_error(reply: Mapping[str, Any]) -> None:
    if reply.get("ok"):
        return
    error = reply.get("error") or {}
    code, message = error.get("code", "internal"), error.get("message", "no message")
    raise ERRORS.get(code, ClientError)(f"{code}: {message}", reply)

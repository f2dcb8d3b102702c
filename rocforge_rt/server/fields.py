"""Field checks of the wire protocol: the reply codes of refusals, and one check per kind of
field (protocol.py's schemas are built of them).

A check takes the field's name and value and returns the value as the request will hold
it, or raises a ProtocolError naming the field, what was expected and what was found,
shown short and without recursing into containers (a value nested deep cannot make an
error message recurse).
"""

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from rocforge_rt.step.sampling import INT32_MAX, Bounds

MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 64


class ErrorCode(StrEnum):
    """Why a request failed (`error.code` of a reply)."""

    BAD_REQUEST = "bad_request"  # malformed msgpack, not a map, wrong type or range, bad field
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_SESSION = "unknown_session"  # never opened, closed, expired, or another client's
    SESSION_BUSY = "session_busy"  # a request of this session is still running
    TURN_FINISHED = "turn_finished"  # the session's turn has ended: append another one
    BUSY = "busy"  # every session slot is taken and the queue full, or it waited too long
    CONTEXT_FULL = "context_full"  # the turn does not fit in the session's context window
    TOO_LARGE = "too_large"  # the request is larger than the daemon accepts
    LIMIT_EXCEEDED = "limit_exceeded"  # over --max-prompt-tokens or --max-new-tokens
    ABORTED = "aborted"  # aborted (or closed, or shut down) before it produced a token
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline passed before it produced a token
    NOT_READY = "not_ready"  # the daemon is still loading or warming up
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping and takes no new work
    INTERNAL = "internal"  # a bug: the request failed, the daemon and other sessions did not
    FORBIDDEN = "forbidden"  # an operator op off loopback without the operator key
    RATE_LIMITED = "rate_limited"  # past its refusals a second: its messages dropped a while


class ProtocolError(Exception):
    """A request that gets an error reply with `code`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


Check = Callable[[str, Any], Any]


def _shown(value: Any) -> str:
    """A value as an error message shows it: short, never recursing into a container."""
    if value is None:
        return "nil"
    if isinstance(value, str):
        return f"str {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, bytes):
        return f"bin of {len(value)} bytes"
    if isinstance(value, list):
        return f"array of {len(value)} items"
    if isinstance(value, dict):
        return f"map of {len(value)} fields"
    return f"{type(value).__name__} {value!r}"  # bool, int, float: msgpack bounds them


def field_error(name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(
        ErrorCode.BAD_REQUEST, f"field {name!r}: expected {expected}, found {_shown(value)}"
    )


def bounded(bounds: Bounds) -> Check:
    """A number within `bounds` (step/sampling.py's one numeric check)."""

    def check(name: str, value: Any) -> float:
        held = bounds.admit(value)
        if held is None:
            number = isinstance(value, int) and not isinstance(value, bool) and not bounds.integer
            raise field_error(name, bounds.expected, float(value) if number else value)
        return held

    return check


def integer(lo: int, hi: int) -> Check:
    return bounded(Bounds(lo, hi, integer=True))


def number(lo: float, hi: float, *, open_lo: bool = False) -> Check:
    """A finite number in [lo, hi] ((lo, hi] when `open_lo`)."""
    return bounded(Bounds(lo, hi, open_lo=open_lo))


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise field_error(name, "true or false", value)
    return value


def string(max_chars: int) -> Check:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) > max_chars:
            raise field_error(name, f"a string of at most {max_chars} characters", value)
        return value

    return check


def request_id_field(name: str, value: Any) -> int | str:
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise field_error(name, f"an integer or a string of at most {MAX_ID_CHARS} characters", value)


def is_token_id(t: Any) -> bool:
    """A token id as the device reads it: an int32 that is not negative."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise field_error(name, "a non-empty array of token ids", value)
    for i, t in enumerate(value):
        if not is_token_id(t):
            raise field_error(f"{name}[{i}]", "a token id (an integer in [0, 2**31))", t)
    return tuple(value)


def chat_messages(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise field_error(name, f"an array of 1 to {MAX_MESSAGES} messages", value)
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise field_error(where, "a map with exactly 'role' and 'content'", message)
        role = string(MAX_ROLE_CHARS)(f"{where}.role", message["role"])
        content = message["content"]
        if not isinstance(content, str):
            raise field_error(f"{where}.content", "a string", content)
        out.append((role, content))
    return tuple(out)


def stop_strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise field_error(
            name, f"a string or an array of at most {MAX_STOP_STRINGS} strings", value
        )
    check = string(MAX_STOP_CHARS)
    return tuple(check(f"{name}[{i}]", s) for i, s in enumerate(value))

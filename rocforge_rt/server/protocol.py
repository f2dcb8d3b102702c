"""The daemon's wire protocol: msgpack maps over ZeroMQ, their schemas and error codes.

A request is a map with `op`, an optional `id` (echoed in every reply to it)
and the op's fields. A reply is a map with `id`, `ok`, and either the result or
`error: {code, message}`. This module validates requests completely (types,
ranges, required and unknown fields) before anything else sees them; limits
that depend on the daemon's configuration are checked by translate.py.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

PROTOCOL_VERSION = 1

MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 64
MAX_STEP_TOKENS = 4096
MAX_TOKENS_FIELD = 1 << 24  # wire bound; the daemon's --max-new-tokens is the real limit
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_MAP_FIELDS = 64
MAX_TRACE_STEPS = 1024
MAX_STATS_RECORDS = 1000
MAX_TIMER_EVERY = 1_000_000
INT64 = (-(1 << 63), (1 << 63) - 1)


class ErrorCode(StrEnum):
    """Why a request failed (`error.code` of a reply)."""

    BAD_REQUEST = "bad_request"  # malformed msgpack, not a map, wrong type or range, bad field
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_SESSION = "unknown_session"  # never opened, closed, expired, or another client's
    SESSION_BUSY = "session_busy"  # a request of this session is still running
    TURN_FINISHED = "turn_finished"  # the session's turn has ended: append another one
    BUSY = "busy"  # every session slot is taken
    CONTEXT_FULL = "context_full"  # the turn does not fit in the session's context window
    TOO_LARGE = "too_large"  # the request is larger than the daemon accepts
    LIMIT_EXCEEDED = "limit_exceeded"  # over --max-prompt-tokens or --max-new-tokens
    ABORTED = "aborted"  # aborted (or closed, or shut down) before it produced a token
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline passed before it produced a token
    NOT_READY = "not_ready"  # the daemon is still loading or warming up
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping and takes no new work
    INTERNAL = "internal"  # a bug: the request failed, the daemon and other sessions did not


class ProtocolError(Exception):
    """A request that gets an error reply with `code`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- the request types --------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """The text of a turn: exactly one of text, token ids, or chat messages to render."""

    text: str | None = None
    tokens: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = 0


@dataclass(frozen=True)
class Turn:
    """A prompt and the rules of the reply to it (open, append, one-shot generate)."""

    prompt: Prompt
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: the daemon's --max-new-tokens


@dataclass(frozen=True)
class Request:
    """A validated request. Which fields are set depends on `op` (see OPS)."""

    op: str
    id: int | str | None = None
    deadline_ms: float | None = None
    session: int | None = None
    turn: Turn | None = None
    n: int = 1  # step: how many tokens
    request: int | str | None = None  # abort: the id of the request to abort
    reset: bool = False  # stats
    records: int = 0  # stats: how many recent per-request records to include
    steps: int | None = None  # trace: how many recent steps (None: all kept)
    launches: bool | None = None  # profile: launch tracker on/off (None: unchanged)
    kernels: bool | None = None  # profile: kernel timer on/off (None: unchanged)
    every: int | None = None  # profile: the kernel timer times one step in `every`


# --- field checks -------------------------------------------------------------------------
Check = Callable[[str, Any], Any]


def _field_error(name: str, expected: str, value: Any) -> ProtocolError:
    found = "nil" if value is None else f"{type(value).__name__} {value!r:.60}"
    return ProtocolError(
        ErrorCode.BAD_REQUEST, f"field {name!r}: expected {expected}, found {found}"
    )


def _int(lo: int, hi: int) -> Check:
    def check(name: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise _field_error(name, f"an integer in [{lo}, {hi}]", value)
        return value

    return check


def _float(lo: float, hi: float, *, open_lo: bool = False) -> Check:
    def check(name: str, value: Any) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
            ok = math.isfinite(value) and (lo < value if open_lo else lo <= value) and value <= hi
        if not ok:
            bound = "(" if open_lo else "["
            raise _field_error(name, f"a number in {bound}{lo}, {hi}]", value)
        return value

    return check


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _field_error(name, "true or false", value)
    return value


def _str(max_chars: int) -> Check:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) > max_chars:
            raise _field_error(name, f"a string of at most {max_chars} characters", value)
        return value

    return check


def _request_id(name: str, value: Any) -> int | str:
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _field_error(name, f"an integer or a string of at most {MAX_ID_CHARS} characters", value)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31


def _tokens(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _field_error(name, "a non-empty array of token ids", value)
    for i, t in enumerate(value):
        if not _is_token_id(t):
            raise _field_error(f"{name}[{i}]", "a token id (an integer in [0, 2**31))", t)
    return tuple(value)


def _messages(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise _field_error(name, f"an array of 1 to {MAX_MESSAGES} messages", value)
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise _field_error(where, "a map with exactly 'role' and 'content'", message)
        role = _str(MAX_ROLE_CHARS)(f"{where}.role", message["role"])
        content = message["content"]
        if not isinstance(content, str):
            raise _field_error(f"{where}.content", "a string", content)
        out.append((role, content))
    return tuple(out)


def _stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise _field_error(
            name, f"a string or an array of at most {MAX_STOP_STRINGS} strings", value
        )
    check = _str(MAX_STOP_CHARS)
    return tuple(check(f"{name}[{i}]", s) for i, s in enumerate(value))


_SESSION = _int(1, INT64[1])
_PROMPT_FIELDS: dict[str, Check] = {
    "prompt": _str(1 << 30),
    "tokens": _tokens,
    "messages": _messages,
}
_TURN_FIELDS: dict[str, Check] = {
    **_PROMPT_FIELDS,
    "temperature": _float(0.0, 100.0),
    "top_k": _int(0, 1 << 31),
    "top_p": _float(0.0, 1.0, open_lo=True),
    "seed": _int(0, (1 << 64) - 1),
    "logprobs": _int(0, 20),
    "stop": _stop,
    "max_tokens": _int(1, MAX_TOKENS_FIELD),
}
_COMMON: dict[str, Check] = {
    "op": _str(32),
    "id": _request_id,
    "deadline_ms": _float(0.0, MAX_DEADLINE_MS, open_lo=True),
}
OPS: dict[str, dict[str, Check]] = {
    "info": {},
    "health": {},
    "open": _TURN_FIELDS,
    "append": {"session": _SESSION, **_TURN_FIELDS},
    "step": {"session": _SESSION, "n": _int(1, MAX_STEP_TOKENS)},
    "generate": {"session": _SESSION, **_TURN_FIELDS},
    "abort": {"session": _SESSION, "request": _request_id},
    "close": {"session": _SESSION},
    "stats": {"reset": _bool, "records": _int(0, MAX_STATS_RECORDS)},
    "trace": {"steps": _int(1, MAX_TRACE_STEPS)},
    "profile": {"launches": _bool, "kernels": _bool, "every": _int(1, MAX_TIMER_EVERY)},
}
_REQUIRED = {"append": ("session",), "step": ("session",), "close": ("session",)}


# --- decoding -----------------------------------------------------------------------------
def unpack(payload: bytes, max_bytes: int) -> Any:
    """Decode one msgpack object with limits; ProtocolError when too large or malformed."""
    if len(payload) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"request of {len(payload)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=MAX_MAP_FIELDS,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, ValueError...)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed msgpack: {exc}") from None


def request_id(obj: Any) -> int | str | None:
    """The id to echo in the reply: the request's `id` when it is a valid one, else None."""
    if isinstance(obj, dict):
        try:
            return _request_id("id", obj.get("id"))
        except ProtocolError:
            return None
    return None


def parse_request(obj: Any) -> Request:
    """Validate a decoded request map; ProtocolError names the first problem found."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"a request must be a map, found {type(obj).__name__}"
        )
    op = obj.get("op")
    if not isinstance(op, str):
        raise _field_error("op", "a string naming the operation", op)
    if op not in OPS:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op[:40]!r}; ops are: {', '.join(OPS)}"
        )
    allowed = {**_COMMON, **OPS[op]}
    unknown = sorted(str(k)[:40] for k in obj if k not in allowed)
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"op {op!r} takes no field(s) {', '.join(map(repr, unknown))}"
        )
    values = {k: allowed[k](k, v) for k, v in obj.items()}
    for name in _REQUIRED.get(op, ()):
        if name not in values:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"op {op!r} needs the field {name!r}")
    return _build(op, values)


def _build(op: str, v: Mapping[str, Any]) -> Request:
    common = {"op": op, "id": v.get("id"), "deadline_ms": v.get("deadline_ms")}
    if op == "abort":
        if ("session" in v) == ("request" in v):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "op 'abort' needs exactly one of 'session' or 'request'"
            )
        return Request(**common, session=v.get("session"), request=v.get("request"))
    if op == "generate" and "session" in v:
        extra = sorted(k for k in v if k in _TURN_FIELDS)
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "op 'generate' continues a session's turn as opened: with 'session' it takes"
                f" no {', '.join(map(repr, extra))}",
            )
        return Request(**common, session=v["session"])
    if op in ("open", "append", "generate"):
        return Request(**common, session=v.get("session"), turn=_turn(op, v))
    return Request(
        **common,
        session=v.get("session"),
        n=v.get("n", 1),
        reset=v.get("reset", False),
        records=v.get("records", 0),
        steps=v.get("steps"),
        launches=v.get("launches"),
        kernels=v.get("kernels"),
        every=v.get("every"),
    )


def _turn(op: str, v: Mapping[str, Any]) -> Turn:
    given = [k for k in _PROMPT_FIELDS if k in v]
    allowed = ("prompt", "tokens") if op == "append" else tuple(_PROMPT_FIELDS)
    if len(given) != 1 or given[0] not in allowed:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"op {op!r} needs exactly one of {', '.join(map(repr, allowed))}"
            + (f", found {', '.join(map(repr, given))}" if given else ""),
        )
    sampling_fields = ("temperature", "top_k", "top_p", "seed", "logprobs")
    return Turn(
        prompt=Prompt(text=v.get("prompt"), tokens=v.get("tokens"), messages=v.get("messages")),
        sampling=Sampling(**{k: v[k] for k in sampling_fields if k in v}),
        stop=v.get("stop", ()),
        max_tokens=v.get("max_tokens"),
    )


# --- replies ------------------------------------------------------------------------------
def ok_reply(rid: int | str | None, **result: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **result}


def error_reply(
    rid: int | str | None, code: ErrorCode, message: str, **extra: Any
) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"code": str(code), "message": message}, **extra}


def pack(reply: Mapping[str, Any]) -> bytes:
    return msgpack.packb(reply, use_bin_type=True)

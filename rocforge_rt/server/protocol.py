"""The daemon's wire protocol: msgpack maps over ZeroMQ, one typed struct an op, error codes.

A request is a map with `op`, an optional `id` (echoed in every reply to it)
and the op's fields. A reply is a map with `id`, `ok`, and either the result or
`error: {code, message}`. `parse_request` validates a request completely (types, ranges,
required and unknown fields) and returns its op's struct (`Step`, `Generate`...): nothing
past it checks a field again. The numeric limits of sampling are step/sampling.py's
(SAMPLING_BOUNDS); limits that depend on the daemon's configuration are checked by
translate.py. The HTTP front checks what it sends with the same `parse_request`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from rocforge_rt.server.fields import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    Check,
    ErrorCode,
    ProtocolError,
    boolean,
    bounded,
    chat_messages,
    field_error,
    integer,
    number,
    request_id_field,
    stop_strings,
    string,
    token_ids,
)
from rocforge_rt.step.sampling import SAMPLING_BOUNDS, SamplingParams

PROTOCOL_VERSION = 1

MAX_STEP_TOKENS = 4096
MAX_TOKENS_FIELD = 1 << 24  # wire bound; the daemon's --max-new-tokens is the real limit
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_MAP_FIELDS = 64
MAX_TRACE_STEPS = 1024
MAX_STATS_RECORDS = 1000
MAX_TIMER_EVERY = 1_000_000
MAX_SECRET_CHARS = 256  # a session token or an operator key
MAX_NESTING = 8  # containers within containers: a request needs 3 (map, messages, message)
INT64_MAX = (1 << 63) - 1

RequestId = int | str


# --- the parts of a turn ------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """The text of a turn: exactly one of text, token ids, or chat messages to render."""

    text: str | None = None
    tokens: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)


@dataclass(frozen=True)
class Turn:
    """A prompt and the rules of the reply to it (open, append, one-shot generate)."""

    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: the daemon's --max-new-tokens


# --- the requests: one struct an op (OPS below has their wire fields) ---------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What every request holds; `op` is its struct's."""

    op: ClassVar[str]
    id: RequestId | None = None  # echoed in every reply
    deadline_ms: float | None = None  # from its receipt to its first token


@dataclass(frozen=True, slots=True, kw_only=True)
class Info(Request):
    op = "info"


@dataclass(frozen=True, slots=True, kw_only=True)
class Health(Request):
    op = "health"


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics(Request):
    op = "metrics"


@dataclass(frozen=True, slots=True, kw_only=True)
class Open(Request):
    """Open a session with its first turn."""

    op = "open"
    turn: Turn


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRequest(Request):
    """A request on an open session, with the session's token."""

    session: int | None = None  # None only for a one-shot generate and an abort by request
    token: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Append(SessionRequest):
    """Another turn on a session whose turn has finished."""

    op = "append"
    turn: Turn


@dataclass(frozen=True, slots=True, kw_only=True)
class Step(SessionRequest):
    """The session's next `n` tokens."""

    op = "step"
    n: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate(SessionRequest):
    """Stream the rest of a turn: a one-shot `turn` (no session), or a session's as opened."""

    op = "generate"
    turn: Turn | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(SessionRequest):
    """End what runs on `session`, or the request of this client with id `request`."""

    op = "abort"
    request: RequestId | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Close(SessionRequest):
    op = "close"


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorRequest(Request):
    """An op that may show the daemon's internals or change its records: off loopback the
    ones that do (trace, profile, stats with reset: io_ops.is_operator_op) need the
    operator key."""

    operator_key: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats(OperatorRequest):
    op = "stats"
    reset: bool = False
    records: int = 0  # how many recent per-request records to include


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace(OperatorRequest):
    op = "trace"
    steps: int | None = None  # how many recent steps (None: all kept)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile(OperatorRequest):
    op = "profile"
    launches: bool | None = None  # launch tracker on/off (None: unchanged)
    kernels: bool | None = None  # kernel timer on/off (None: unchanged)
    every: int | None = None  # the kernel timer times one step in `every`


TurnRequest = Open | Append | Generate  # the requests that may carry a turn

_SESSION = integer(1, INT64_MAX)
_SECRET = string(MAX_SECRET_CHARS)
_BY_SESSION: dict[str, Check] = {"session": _SESSION, "token": _SECRET}
_PROMPT_FIELDS: dict[str, Check] = {
    "prompt": string(1 << 30),
    "tokens": token_ids,
    "messages": chat_messages,
}
_TURN_FIELDS: dict[str, Check] = {
    **_PROMPT_FIELDS,
    **{name: bounded(bounds) for name, bounds in SAMPLING_BOUNDS.items()},
    "stop": stop_strings,
    "max_tokens": integer(1, MAX_TOKENS_FIELD),
}
_COMMON: dict[str, Check] = {
    "op": string(32),
    "id": request_id_field,
    "deadline_ms": number(0.0, MAX_DEADLINE_MS, open_lo=True),
}
OPS: dict[str, dict[str, Check]] = {
    "info": {},
    "health": {},
    "open": _TURN_FIELDS,
    "append": {**_BY_SESSION, **_TURN_FIELDS},
    "step": {**_BY_SESSION, "n": integer(1, MAX_STEP_TOKENS)},
    "generate": {**_BY_SESSION, **_TURN_FIELDS},
    "abort": {**_BY_SESSION, "request": request_id_field},
    "close": {**_BY_SESSION},
    "stats": {
        "reset": boolean,
        "records": integer(0, MAX_STATS_RECORDS),
        "operator_key": _SECRET,
    },
    "trace": {"steps": integer(1, MAX_TRACE_STEPS), "operator_key": _SECRET},
    "metrics": {},
    "profile": {
        "launches": boolean,
        "kernels": boolean,
        "every": integer(1, MAX_TIMER_EVERY),
        "operator_key": _SECRET,
    },
}
_SESSION_OPS = (Open, Append, Step, Generate, Abort, Close)
_DAEMON_OPS = (Info, Health, Metrics, Stats, Trace, Profile)
STRUCTS: dict[str, type[Request]] = {struct.op: struct for struct in _SESSION_OPS + _DAEMON_OPS}
_ALLOWED = {op: {**_COMMON, **fields} for op, fields in OPS.items()}  # a request's fields
_REQUIRED = {"append": ("session",), "step": ("session",), "close": ("session",)}
_TURN_ENVELOPE = ("id", "deadline_ms", "session", "token")  # a turn request's other fields


# --- decoding -----------------------------------------------------------------------------
def max_array_items(max_prompt_tokens: int | None) -> int:
    """The most items any array of a request may hold: a prompt's token ids (the daemon's
    --max-prompt-tokens; None while it loads), chat messages or stop strings."""
    return max(MAX_MESSAGES, MAX_STOP_STRINGS, max_prompt_tokens or 0)


def unpack(payload: bytes, max_bytes: int, max_items: int) -> Any:
    """Decode one msgpack object with limits; ProtocolError when too large or malformed. An
    array over `max_items` (`max_array_items`) is refused as msgpack reads its header, before
    any of its items is built."""
    if len(payload) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"request of {len(payload)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_items,
            max_map_len=MAX_MAP_FIELDS,
            max_ext_len=0,
        )
    except msgpack.StackError:
        raise _too_deep() from None
    except ValueError as exc:
        if "max_array_len" in str(exc):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"malformed request: an array of over {max_items} items, the most any field"
                " takes (token ids: --max-prompt-tokens)",
            ) from None
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises many types (ExtraData, ValueError...)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed msgpack: {exc}") from None
    if _nested_deeper(obj, MAX_NESTING):
        raise _too_deep()
    return obj


def _too_deep() -> ProtocolError:
    return ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"malformed request: values nested deeper than {MAX_NESTING} levels",
    )


def _nested_deeper(obj: Any, limit: int) -> bool:
    """Whether arrays and maps nest deeper than `limit` (a loop: a deep value cannot recurse)."""
    stack = [(obj, 1)] if isinstance(obj, list | dict) else []
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, list | dict))
    return False


def peek_request_id(payload: bytes) -> int | str | None:
    """The `id` of a request map, its other values skipped unread (in C, as msgpack walks
    them): a request too large or too long to decode still gets its id in the refusal. None
    when there is none to find."""
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=True, max_buffer_size=len(payload), max_ext_len=0
    )
    unpacker.feed(payload)
    try:
        for _ in range(min(unpacker.read_map_header(), MAX_MAP_FIELDS)):
            if unpacker.unpack() == "id":
                return request_id({"id": unpacker.unpack()})
            unpacker.skip()
    except Exception:  # not a map, malformed, cut short, nested too deep: msgpack's many types
        return None
    return None


def request_id(obj: Any) -> int | str | None:
    """The id to echo in the reply: the request's `id` when it is a valid one, else None."""
    if isinstance(obj, dict):
        try:
            return request_id_field("id", obj.get("id"))
        except ProtocolError:
            return None
    return None


def parse_request(obj: Any) -> Request:
    """Validate a decoded request map into its op's struct; ProtocolError names the first
    problem found."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"a request must be a map, found {type(obj).__name__}"
        )
    op = obj.get("op")
    if not isinstance(op, str):
        raise field_error("op", "a string naming the operation", op)
    allowed = _ALLOWED.get(op)
    if allowed is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op[:40]!r}; ops are: {', '.join(OPS)}"
        )
    unknown = sorted(str(k)[:40] for k in obj if k not in allowed)
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"op {op!r} takes no field(s) {', '.join(map(repr, unknown))}"
        )
    values = {k: allowed[k](k, v) for k, v in obj.items() if k != "op"}
    for name in _REQUIRED.get(op, ()):
        if name not in values:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"op {op!r} needs the field {name!r}")
    return _build(op, values)


def _build(op: str, v: dict[str, Any]) -> Request:
    """The struct of valid fields `v`, once the rules between fields hold."""
    if "token" in v and "session" not in v:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"op {op!r}: the field 'token' goes with 'session'"
        )
    if op == "abort" and ("session" in v) == ("request" in v):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "op 'abort' needs exactly one of 'session' or 'request'"
        )
    if op == "generate" and "session" in v:
        extra = sorted(k for k in v if k in _TURN_FIELDS)
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "op 'generate' continues a session's turn as opened: with 'session' it takes"
                f" no {', '.join(map(repr, extra))}",
            )
    elif op in ("open", "append", "generate"):
        envelope = {k: v[k] for k in _TURN_ENVELOPE if k in v}
        return STRUCTS[op](**envelope, turn=_turn(op, v))
    return STRUCTS[op](**v)


def _turn(op: str, v: Mapping[str, Any]) -> Turn:
    given = [k for k in _PROMPT_FIELDS if k in v]
    allowed = ("prompt", "tokens") if op == "append" else tuple(_PROMPT_FIELDS)
    if len(given) != 1 or given[0] not in allowed:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"op {op!r} needs exactly one of {', '.join(map(repr, allowed))}"
            + (f", found {', '.join(map(repr, given))}" if given else ""),
        )
    return Turn(
        prompt=Prompt(text=v.get("prompt"), tokens=v.get("tokens"), messages=v.get("messages")),
        sampling=SamplingParams(**{k: v[k] for k in SAMPLING_BOUNDS if k in v}),
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

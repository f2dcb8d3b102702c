"""The daemon's wire protocol: msgpack maps over ZeroMQ, their schemas and error codes.

A request is a map with `op`, an optional `id` (echoed in every reply to it)
and the op's fields. A reply is a map with `id`, `ok`, and either the result or
`error: {code, message}`. This module validates requests completely (types,
ranges, required and unknown fields) before anything else sees them; limits
that depend on the daemon's configuration are checked by translate.py.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

import msgpack

from rocforge_rt.server.fields import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    Check,
    ErrorCode,
    ProtocolError,
    boolean,
    chat_messages,
    field_error,
    integer,
    number,
    request_id_field,
    signed_number,
    stop_strings,
    string,
    token_ids,
)

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
INT64 = (-(1 << 63), (1 << 63) - 1)
INT32_MAX = (1 << 31) - 1
# float32's smallest normal and largest numbers: the device's sampling values are float32, and
# it divides by temperature and repetition_penalty
FLOAT32_TINY = 2.0**-126
FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (step/sampling.py's, OpenAI's range)


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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


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
    token: str | None = None  # the session's token (step, generate on a session, append...)
    operator_key: str | None = None  # stats, trace, profile: needed off loopback


_SESSION = integer(1, INT64[1])
_SECRET = string(MAX_SECRET_CHARS)
_BY_SESSION: dict[str, Check] = {"session": _SESSION, "token": _SECRET}
_PROMPT_FIELDS: dict[str, Check] = {
    "prompt": string(1 << 30),
    "tokens": token_ids,
    "messages": chat_messages,
}
_TURN_FIELDS: dict[str, Check] = {
    **_PROMPT_FIELDS,
    "temperature": number(FLOAT32_TINY, 100.0, or_zero=True),  # 0: greedy
    "top_k": integer(0, INT32_MAX),  # translate.py: at most the vocabulary
    "top_p": number(FLOAT32_TINY, 1.0),
    "seed": integer(0, (1 << 64) - 1),
    "logprobs": integer(0, 20),
    # llama.cpp's (step/sampling.py); float32 on the device: 0 or normal
    "min_p": number(FLOAT32_TINY, 1.0, or_zero=True),  # 0: no cut
    "repetition_penalty": number(FLOAT32_TINY, FLOAT32_MAX),  # 1: none
    "frequency_penalty": signed_number(MAX_PENALTY, FLOAT32_TINY),  # 0: none
    "presence_penalty": signed_number(MAX_PENALTY, FLOAT32_TINY),  # 0: none
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
_REQUIRED = {"append": ("session",), "step": ("session",), "close": ("session",)}
SAMPLING_FIELDS = tuple(f.name for f in dataclass_fields(Sampling))  # a turn's, by name


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
    """Validate a decoded request map; ProtocolError names the first problem found."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"a request must be a map, found {type(obj).__name__}"
        )
    op = obj.get("op")
    if not isinstance(op, str):
        raise field_error("op", "a string naming the operation", op)
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
    if "token" in v and "session" not in v:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"op {op!r}: the field 'token' goes with 'session'"
        )
    common["token"] = v.get("token")
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
        operator_key=v.get("operator_key"),
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
    return Turn(
        prompt=Prompt(text=v.get("prompt"), tokens=v.get("tokens"), messages=v.get("messages")),
        sampling=Sampling(**{k: v[k] for k in SAMPLING_FIELDS if k in v}),
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

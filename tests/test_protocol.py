"""The wire protocol: request schemas, their structs, limits and error codes, without sockets."""

import ast
import dataclasses
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

from rocforge_rt.server.jobs import Limits
from rocforge_rt.server.protocol import (
    OPS,
    STRUCTS,
    Abort,
    Append,
    Close,
    ErrorCode,
    Generate,
    Health,
    Info,
    Metrics,
    Open,
    Profile,
    Prompt,
    ProtocolError,
    Request,
    Stats,
    Step,
    Trace,
    Turn,
    error_reply,
    max_array_items,
    ok_reply,
    pack,
    parse_request,
    peek_request_id,
    request_id,
    unpack,
)
from rocforge_rt.server.translate import turn_args
from rocforge_rt.step.sampling import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_TEMPERATURE,
    SAMPLING_BOUNDS,
    SEED_MAX,
    SamplingParams,
)

F32_MAX = float(np.finfo(np.float32).max)


def rejected(obj: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(obj)
    return info.value


def test_error_codes_are_the_documented_strings() -> None:
    assert {c.value for c in ErrorCode} == {
        "bad_request", "unknown_op", "unknown_session", "session_busy", "turn_finished", "busy",
        "context_full", "too_large", "limit_exceeded", "aborted", "deadline_exceeded",
        "not_ready", "shutting_down", "internal", "forbidden", "rate_limited",
    }  # fmt: skip


def test_every_op_of_the_design_is_known() -> None:
    assert set(OPS) == {
        "info", "open", "step", "generate", "append", "abort", "close", "stats", "trace", "health",
        "profile", "metrics",
    }  # fmt: skip


def test_profile_takes_switches_and_a_sampling_period() -> None:
    request = parse_request({"op": "profile", "launches": True, "kernels": False, "every": 8})
    assert (request.launches, request.kernels, request.every) == (True, False, 8)
    assert parse_request({"op": "profile"}).launches is None
    for bad in ({"launches": 1}, {"every": 0}, {"every": True}):
        with pytest.raises(ProtocolError, match="field"):
            parse_request({"op": "profile", **bad})


def test_open_with_text_sampling_and_stop_strings() -> None:
    request = parse_request(
        {
            "op": "open",
            "id": "r-1",
            "prompt": "Hello",
            "temperature": 0.7,
            "top_k": 40,
            "top_p": 0.9,
            "seed": 3,
            "logprobs": 2,
            "stop": ["\n\n", "User:"],
            "max_tokens": 16,
            "deadline_ms": 500,
        }
    )
    assert request.op == "open" and request.id == "r-1" and request.deadline_ms == 500.0
    assert request.turn.prompt == Prompt(text="Hello")
    assert request.turn.sampling == SamplingParams(0.7, 40, 0.9, 3, 2)
    assert request.turn.stop == ("\n\n", "User:")
    assert request.turn.max_tokens == 16


PENALTIES = {"min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": -0.5,
             "presence_penalty": 2}  # fmt: skip


@pytest.mark.parametrize("op", ["open", "generate", "append"])
def test_every_turn_takes_min_p_and_the_penalties(op: str) -> None:
    session = {"session": 1} if op == "append" else {}
    turn = parse_request({"op": op, **session, "tokens": [1], **PENALTIES}).turn
    assert turn.sampling == SamplingParams(
        min_p=0.05, repetition_penalty=1.1, frequency_penalty=-0.5, presence_penalty=2.0
    )
    assert isinstance(turn.sampling.presence_penalty, float)


def test_a_turns_sampling_reaches_the_engine_as_sampling_params() -> None:
    request = parse_request(
        {"op": "open", "tokens": [1], "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3,
         "logprobs": 2, **PENALTIES}
    )  # fmt: skip
    limits = Limits(n_ctx=64, max_sessions=1, max_prompt_tokens=32, max_new_tokens=8,
                    idle_timeout_s=60.0)  # fmt: skip
    args = turn_args(limits, 256, request.turn, [1])
    assert args["sampling"] is request.turn.sampling
    assert args["sampling"] == SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, seed=3, logprobs=2, min_p=0.05,
        repetition_penalty=1.1, frequency_penalty=-0.5, presence_penalty=2.0,
    )  # fmt: skip
    neutral = turn_args(limits, 256, parse_request({"op": "open", "tokens": [1]}).turn, [1])
    assert neutral["sampling"] == SamplingParams() and not neutral["sampling"].penalized


def test_defaults_are_greedy_without_limits_of_their_own() -> None:
    turn = parse_request({"op": "open", "tokens": [1, 2, 3]}).turn
    assert turn.prompt.tokens == (1, 2, 3)
    assert turn.sampling == SamplingParams() and turn.stop == () and turn.max_tokens is None


def test_chat_messages_and_a_single_stop_string() -> None:
    turn = parse_request(
        {"op": "generate", "messages": [{"role": "user", "content": "Hi"}], "stop": "END"}
    ).turn
    assert turn.prompt.messages == (("user", "Hi"),)
    assert turn.stop == ("END",)


def test_generate_on_an_open_session_takes_no_turn_fields() -> None:
    assert parse_request({"op": "generate", "session": 4}).session == 4
    assert rejected({"op": "generate", "session": 4, "max_tokens": 3}).code == "bad_request"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"prompt": "a", "tokens": [1]},
        {"prompt": "a", "messages": [{"role": "u", "content": ""}]},
    ],
)
def test_a_turn_needs_exactly_one_prompt_form(fields: dict) -> None:
    error = rejected({"op": "open", **fields})
    assert error.code == ErrorCode.BAD_REQUEST and "exactly one of" in error.message


def test_append_takes_text_or_tokens_but_not_messages() -> None:
    assert parse_request({"op": "append", "session": 1, "prompt": " more"}).turn.prompt.text
    error = rejected({"op": "append", "session": 1, "messages": [{"role": "u", "content": "x"}]})
    assert "'prompt', 'tokens'" in error.message


@pytest.mark.parametrize(
    ("request_map", "field"),
    [
        ({"op": "step", "session": "1"}, "session"),
        ({"op": "step", "session": True}, "session"),  # bools are not integers here
        ({"op": "step", "session": 0}, "session"),
        ({"op": "step", "session": 1, "n": 0}, "n"),
        ({"op": "step", "session": 1, "n": 1.0}, "n"),
        ({"op": "open", "tokens": [1, -2]}, "tokens[1]"),
        ({"op": "open", "tokens": []}, "tokens"),
        ({"op": "open", "tokens": "123"}, "tokens"),
        ({"op": "open", "prompt": 5}, "prompt"),
        ({"op": "open", "prompt": "x", "temperature": -0.1}, "temperature"),
        ({"op": "open", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"op": "open", "prompt": "x", "top_p": 0.0}, "top_p"),
        ({"op": "open", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"op": "open", "prompt": "x", "min_p": 1.5}, "min_p"),
        ({"op": "open", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (
            {"op": "append", "session": 1, "prompt": "x", "frequency_penalty": 3},
            "frequency_penalty",
        ),
        ({"op": "generate", "prompt": "x", "presence_penalty": "0.5"}, "presence_penalty"),
        ({"op": "open", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"op": "open", "prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"op": "open", "prompt": "x", "stop": [3]}, "stop[0]"),
        ({"op": "open", "prompt": "x", "deadline_ms": 0}, "deadline_ms"),
        ({"op": "open", "messages": [{"role": "user"}]}, "messages[0]"),
        ({"op": "open", "messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ({"op": "stats", "reset": 1}, "reset"),
        ({"op": "health", "id": [1]}, "id"),
        ({"op": 7}, "op"),
    ],
)
def test_wrong_types_and_ranges_name_the_field(request_map: dict, field: str) -> None:
    error = rejected(request_map)
    assert error.code == ErrorCode.BAD_REQUEST
    assert error.message.startswith(f"field {field!r}:")


@pytest.mark.parametrize(
    "request_map", [{"op": "step"}, {"op": "close"}, {"op": "append", "prompt": "x"}]
)
def test_ops_on_a_session_need_its_id(request_map: dict) -> None:
    assert "needs the field 'session'" in rejected(request_map).message


def test_unknown_fields_are_refused_by_name() -> None:
    error = rejected({"op": "open", "prompt": "x", "max_token": 5})
    assert error.code == ErrorCode.BAD_REQUEST and "'max_token'" in error.message


def test_unknown_op() -> None:
    error = rejected({"op": "launch_missiles"})
    assert error.code == ErrorCode.UNKNOWN_OP and "ops are:" in error.message


def test_non_map_requests() -> None:
    for obj in ([1, 2], "health", 3, None):
        assert rejected(obj).code == ErrorCode.BAD_REQUEST


def test_abort_names_exactly_one_target() -> None:
    assert parse_request({"op": "abort", "request": "g-1"}).request == "g-1"
    assert parse_request({"op": "abort", "session": 2}).session == 2
    assert rejected({"op": "abort"}).code == ErrorCode.BAD_REQUEST
    assert rejected({"op": "abort", "request": 1, "session": 2}).code == ErrorCode.BAD_REQUEST


def test_request_id_is_echoed_only_when_valid() -> None:
    assert request_id({"id": 7}) == 7
    assert request_id({"id": "abc"}) == "abc"
    assert request_id({"id": True}) is None
    assert request_id({"id": "x" * 1000}) is None
    assert request_id([1]) is None


ITEMS = max_array_items(None)  # while the daemon loads: no prompt's tokens yet


def test_unpack_limits() -> None:
    assert unpack(msgpack.packb({"op": "health"}), 1024, ITEMS) == {"op": "health"}
    with pytest.raises(ProtocolError) as big:
        unpack(b"\x00" * 2000, 1024, ITEMS)
    assert big.value.code == ErrorCode.TOO_LARGE
    for garbage in (b"\xc1", b"\x92\x01", msgpack.packb(1) + b"\x01"):
        with pytest.raises(ProtocolError) as bad:
            unpack(garbage, 1024, ITEMS)
        assert bad.value.code == ErrorCode.BAD_REQUEST and "malformed msgpack" in bad.value.message


def test_an_array_longer_than_any_field_takes_is_refused_from_its_header() -> None:
    """Token ids up to --max-prompt-tokens, 256 chat messages: a longer array, even one whose
    header claims 4 billion items and has none, is refused before any item is built."""
    assert max_array_items(None) == 256 and max_array_items(2047) == 2047
    tokens = msgpack.packb({"op": "open", "tokens": [1] * 2047})
    assert len(unpack(tokens, 1 << 20, 2047)["tokens"]) == 2047
    for payload in (
        msgpack.packb({"op": "open", "tokens": [1] * 2048}),
        msgpack.packb({"op": "open", "messages": [{}] * 100_000}),
        b"\xdd\xff\xff\xff\xff",
    ):
        with pytest.raises(ProtocolError) as info:
            unpack(payload, 1 << 20, 2047)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert "an array of over 2047 items" in info.value.message


def test_a_request_too_large_to_decode_still_has_its_id_read() -> None:
    big = msgpack.packb({"op": "generate", "prompt": "x" * (3 << 20), "id": 77})
    assert peek_request_id(big) == 77
    ids_last = msgpack.packb({"op": "open", "tokens": list(range(1 << 20)), "id": "abc"})
    assert peek_request_id(ids_last) == "abc"
    for no_id in (msgpack.packb([1, 2]), msgpack.packb({"op": "x"}), b"\x82\xa2op", b"\xc1"):
        assert peek_request_id(no_id) is None
    assert peek_request_id(msgpack.packb({"id": [1]})) is None  # not a valid id


def test_unpack_refuses_deep_nesting_and_huge_maps() -> None:
    deep = b"\x91" * 100_000 + b"\x01"
    with pytest.raises(ProtocolError):
        unpack(deep, 1 << 20, ITEMS)
    wide = msgpack.packb({f"k{i}": i for i in range(100)})
    with pytest.raises(ProtocolError):
        unpack(wide, 1 << 20, ITEMS)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_values_nested_deeper_than_a_request_needs_are_bad_requests_however_deep() -> None:
    request = {"op": "open", "messages": [{"role": "u", "content": "x"}]}
    assert unpack(msgpack.packb(request), 1024, ITEMS)
    for depth in (8, 1000, 1023, 10_000):  # past msgpack's own stack (1024) too
        payload = msgpack.packb({"op": "open", "tokens": [1], "stop": "x"})[:-2]
        payload += b"\x91" * depth + msgpack.packb("x")
        with pytest.raises(ProtocolError) as info:
            unpack(payload, 1 << 20, ITEMS)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert info.value.message == "malformed request: values nested deeper than 8 levels"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (nested(5000), "array of 1 items"),  # never recursed into: no RecursionError
        ({"a": nested(5000)}, "map of 1 fields"),
        ("x" * 1_000_000, "str 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'..."),
        (b"\x00" * 100, "bin of 100 bytes"),
        (None, "nil"),
        (2**64 - 1, "int 18446744073709551615"),
    ],
    ids=["deep array", "deep map", "long string", "bytes", "nil", "uint64"],
)
def test_field_errors_show_values_short_and_without_recursing(value: object, shown: str) -> None:
    error = rejected({"op": "open", "tokens": [1], "stop": [value]})
    assert (
        error.message
        == f"field 'stop[0]': expected a string of at most 256 characters, found {shown}"
    )


@pytest.mark.parametrize(
    ("field", "ok", "bad"),
    [
        ("temperature", [0.0, 2.0**-126, 100.0], [5e-324, 1e-46, 2.0**-127, 100.000001]),
        ("top_p", [2.0**-126, 1.0], [0.0, 1e-46, 1e-40, 1.0000001]),
        ("top_k", [0, 2**31 - 1], [-1, 2**31, 2**63 - 1]),  # the vocabulary: translate.py
        ("seed", [0, 2**64 - 1], [-1, -(2**63)]),
        ("logprobs", [0, 20], [-1, 21, 2**31]),
        ("min_p", [0.0, 2.0**-126, 0.05, 1], [-0.0001, 1e-40, 1.0000001, float("nan")]),
        ("repetition_penalty", [2.0**-126, 1, 1.3, F32_MAX],
         [0.0, -1.0, 1e-40, math.nextafter(F32_MAX, math.inf), float("inf")]),
        ("frequency_penalty", [0, -2, -(2.0**-126), 2.0**-126, 2.0],
         [1e-40, -1e-45, -2.0000001, 2.0000001, float("-inf"), True]),
        ("presence_penalty", [0.0, -2.0, 0.5, 2], [-1e-40, 5e-324, -3, 2.5, "0.5", None]),
    ],
)  # fmt: skip
def test_sampling_fields_hold_what_the_device_reads_int32_and_normal_float32(
    field: str, ok: list, bad: list
) -> None:
    """temperature, top_p, min_p and the penalties are float32 on the device, which divides
    by the temperature and the repetition penalty: a value that rounds to 0 or a subnormal is
    refused (0 itself where it means off); top_k is its int32."""
    for value in ok:
        parse_request({"op": "open", "tokens": [1], field: value})
    for value in bad:
        assert rejected({"op": "open", "tokens": [1], field: value}).message.startswith(
            f"field {field!r}:"
        )


def test_replies_round_trip() -> None:
    ok = msgpack.unpackb(pack(ok_reply(3, session=1)))
    assert ok == {"id": 3, "ok": True, "session": 1}
    error = msgpack.unpackb(pack(error_reply("x", ErrorCode.BUSY, "full")))
    assert error == {"id": "x", "ok": False, "error": {"code": "busy", "message": "full"}}


# --- one struct an op ---------------------------------------------------------------------
TOKENS = Turn(Prompt(tokens=(1,)))


@pytest.mark.parametrize(
    ("request_map", "struct"),
    [
        ({"op": "info"}, Info()),
        ({"op": "health", "id": 3}, Health(id=3)),
        ({"op": "metrics"}, Metrics()),
        ({"op": "open", "tokens": [1], "deadline_ms": 5}, Open(turn=TOKENS, deadline_ms=5.0)),
        ({"op": "append", "session": 1, "token": "t", "tokens": [1]},
         Append(session=1, token="t", turn=TOKENS)),
        ({"op": "step", "id": 17, "session": 3, "token": "t", "n": 2},
         Step(id=17, session=3, token="t", n=2)),
        ({"op": "generate", "tokens": [1]}, Generate(turn=TOKENS)),
        ({"op": "generate", "session": 4}, Generate(session=4)),
        ({"op": "abort", "request": "g-1"}, Abort(request="g-1")),
        ({"op": "close", "session": 2}, Close(session=2)),
        ({"op": "stats", "reset": True, "records": 5}, Stats(reset=True, records=5)),
        ({"op": "trace", "steps": 8, "operator_key": "k"}, Trace(steps=8, operator_key="k")),
        ({"op": "profile", "every": 4}, Profile(every=4)),
    ],
    ids=lambda value: value.get("op") if isinstance(value, dict) else None,
)  # fmt: skip
def test_a_valid_request_parses_to_its_ops_struct(request_map: dict, struct: Request) -> None:
    parsed = parse_request(request_map)
    assert parsed == struct and type(parsed) is type(struct)
    assert parsed.op == request_map["op"]


def test_every_op_has_a_struct_whose_fields_are_its_wire_fields() -> None:
    """A struct holds its op's wire fields by their names; a turn's fields are in `turn`."""
    turn_fields = set(OPS["open"])
    assert set(STRUCTS) == set(OPS)
    for op, struct in STRUCTS.items():
        fields = {f.name for f in dataclasses.fields(struct)}
        wire = set(OPS[op]) | {"id", "deadline_ms"}
        if wire >= turn_fields:
            wire = wire - turn_fields | {"turn"}
        assert fields == wire, op


def test_a_request_struct_is_frozen() -> None:
    step = parse_request({"op": "step", "session": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.n = 5  # type: ignore[misc]


def test_a_sampling_field_refused_on_the_wire_reads_as_before() -> None:
    """The wire's messages name the field, the bounds and the value as found."""
    assert rejected({"op": "open", "tokens": [1], "top_p": 0}).message == (
        f"field 'top_p': expected a number in [{FLOAT32_TINY}, 1.0], found float 0.0"
    )
    assert rejected({"op": "open", "tokens": [1], "presence_penalty": 3}).message == (
        f"field 'presence_penalty': expected 0 or a number in [-2.0, -{FLOAT32_TINY}] or"
        f" [{FLOAT32_TINY}, 2.0], found float 3.0"
    )
    assert rejected({"op": "open", "tokens": [1], "top_k": 2**31}).message == (
        "field 'top_k': expected an integer in [0, 2147483647], found int 2147483648"
    )


# --- each limit defined once ---------------------------------------------------------------
def test_the_wire_bounds_sampling_by_step_samplings_constants() -> None:
    """The one table of sampling bounds: device types (int32, normal float32) and ranges."""
    assert float(np.finfo(np.float32).tiny) == FLOAT32_TINY
    assert float(np.finfo(np.float32).max) == FLOAT32_MAX
    assert INT32_MAX == 2**31 - 1 and SEED_MAX == 2**64 - 1
    bounds = SAMPLING_BOUNDS
    assert (bounds["temperature"].lo, bounds["temperature"].hi) == (FLOAT32_TINY, MAX_TEMPERATURE)
    assert bounds["top_k"].hi == INT32_MAX and bounds["seed"].hi == SEED_MAX
    assert bounds["logprobs"].hi == MAX_LOGPROBS
    assert bounds["repetition_penalty"].hi == FLOAT32_MAX
    for name in ("frequency_penalty", "presence_penalty"):
        assert (bounds[name].lo, bounds[name].hi) == (FLOAT32_TINY, MAX_PENALTY)


SHARED_LIMITS = {"FLOAT32_TINY", "FLOAT32_MAX", "INT32_MAX", "SEED_MAX", "MAX_PENALTY",
                 "MAX_LOGPROBS", "MAX_TEMPERATURE", "MAX_TOKENS_FIELD"}  # fmt: skip


def test_each_shared_limit_is_assigned_in_one_module_only() -> None:
    package = Path(__file__).resolve().parents[1] / "rocforge_rt"
    where: dict[str, list[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in SHARED_LIMITS:
                        where.setdefault(target.id, []).append(str(path.relative_to(package)))
    assert {name: len(paths) for name, paths in where.items()} == dict.fromkeys(SHARED_LIMITS, 1)

"""Engine refusals carry a typed code, and the daemon has one reply code for each.

The daemon never reads an EngineError's text: `ENGINE_ERROR_CODES` (server/translate.py)
maps its `code` to the reply's `error.code`, and the reply's message is `message`.
"""

from pathlib import Path

import pytest

from rocforge_rt.engine.engine import Engine
from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.server.protocol import ErrorCode
from rocforge_rt.server.translate import ENGINE_ERROR_CODES


def test_every_engine_error_code_has_a_reply_code() -> None:
    assert set(ENGINE_ERROR_CODES) == set(EngineErrorCode)
    assert all(isinstance(code, ErrorCode) for code in ENGINE_ERROR_CODES.values())


def test_codes_the_engine_and_the_protocol_share_map_to_themselves() -> None:
    for code in (EngineErrorCode.BUSY, EngineErrorCode.CONTEXT_FULL):
        assert ENGINE_ERROR_CODES[code] == ErrorCode(code.value)
    assert ENGINE_ERROR_CODES[EngineErrorCode.INVALID_ARGUMENT] is ErrorCode.BAD_REQUEST


def test_an_engine_error_reads_code_then_message() -> None:
    error = EngineError(EngineErrorCode.CONTEXT_FULL, "no room")
    assert (error.code, error.message, str(error)) == (
        EngineErrorCode.CONTEXT_FULL, "no room", "context_full: no room",
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine.load(tiny_model, backend="cpu", n_slots=1, n_ctx=64, prefill_chunk=4)


def refusal(call) -> EngineErrorCode:
    with pytest.raises(EngineError) as info:
        call()
    return info.value.code


def test_each_engine_refusal_has_its_code(engine: Engine) -> None:
    assert refusal(lambda: engine.open_session([])) is EngineErrorCode.INVALID_ARGUMENT
    assert refusal(lambda: engine.open_session([1], max_tokens=0)) is (
        EngineErrorCode.INVALID_ARGUMENT
    )
    session = engine.open_session([1, 2, 3], max_tokens=4)
    try:
        assert refusal(lambda: engine.open_session([1])) is EngineErrorCode.BUSY
        assert refusal(lambda: engine.decode([session])) is EngineErrorCode.NOT_DECODABLE
        assert refusal(lambda: engine.append(session, [4])) is EngineErrorCode.TURN_RUNNING
    finally:
        engine.close_session(session)
    too_long = engine.hparams.n_ctx_train + 1
    assert refusal(lambda: Engine(engine.model, engine.backend, n_slots=1, n_ctx=too_long)) is (
        EngineErrorCode.BAD_CONFIG
    )

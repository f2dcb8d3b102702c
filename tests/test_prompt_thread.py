"""The prompt thread (server/prompts.py): turns tokenized on their way to the engine thread,
in arrival order, without holding up the threads beside it."""

import threading
import time
from pathlib import Path

import pytest

from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.server.jobs import Job, PeerGone
from rocforge_rt.server.prompts import Item, PromptThread
from rocforge_rt.server.protocol import ProtocolError, parse_request


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> Tokenizer:
    return Tokenizer.from_metadata(load_model_file(default_model).metadata)


def job(op: str, **fields: object) -> Job:
    return Job(parse_request({"op": op, "id": 1, **fields}), (b"peer",), time.perf_counter())


def passed_on(tokenizer: Tokenizer | None, items: list[Item]) -> list[Item]:
    out: list[Item] = []
    prompts = PromptThread(lambda: tokenizer, out.append)
    prompts.start()
    for item in items:
        prompts.submit(item)
    prompts.finish()
    return out


def test_items_pass_in_order_with_each_turn_tokenized(tokenizer: Tokenizer) -> None:
    items: list[Item] = [
        job("open", prompt="The sea is"),
        job("step", session=1, token="t", n=2),
        PeerGone(b"peer", keep_sessions=False),
        job("append", session=1, token="t", prompt=" and the sky"),
        job("generate", tokens=[5, 6]),
    ]
    assert passed_on(tokenizer, items) == items
    opened, step, _, appended, by_ids = items
    assert opened.turn_ids == tokenizer.encode("The sea is")
    assert appended.turn_ids == tokenizer.encode(" and the sky", add_bos=False)  # mid-session
    assert by_ids.turn_ids == [5, 6]
    assert step.turn_ids is None  # no turn


def test_a_prompt_that_cannot_be_tokenized_carries_its_refusal_to_the_engine_thread() -> None:
    opened = job("open", prompt="no vocabulary")
    assert passed_on(None, [opened]) == [opened]
    assert isinstance(opened.turn_ids, ProtocolError) and "no vocabulary" in str(opened.turn_ids)


def test_tokenizing_a_long_prompt_lets_other_threads_run(tokenizer: Tokenizer) -> None:
    """The engine thread keeps decoding while the prompt thread tokenizes."""
    text = "The sea is calm tonight, and the tide is full. " * 20_000  # ~1 MB
    ticks: list[float] = []
    done = threading.Event()

    def other_thread() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=other_thread)
    ticker.start()
    time.sleep(0.01)
    started = time.perf_counter()
    tokenizer.encode(text)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    during = [t for t in ticks if started <= t]
    gaps = [b - a for a, b in zip([started, *during], during, strict=False)]
    assert took > 0.05, "the text is too short to show anything"
    assert max(gaps) < took / 4, f"longest pause {max(gaps) * 1e3:.0f} ms of {took * 1e3:.0f} ms"

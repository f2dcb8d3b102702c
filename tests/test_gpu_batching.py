"""Many streams on the GPU: a session's tokens do not depend on who else is in the batch.

Decode batches take the MMV (2 to MMV_MAX_ROWS rows, kernels/gemm.hip) and a lone session
the GEMV; both follow one summation order (kernels/rf_q8.h), and attention reads each
row's own slot, so greedy tokens and their log-probabilities are the same alone and in
batches that grow and shrink as sessions start and finish. Run on a GPU machine.
"""

import numpy as np
import pytest

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.backends.gpu.attention_plan import AttentionTuning
from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.session import Session

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]


def prompts(n: int, n_vocab: int) -> list[list[int]]:
    """Prompts of different lengths (3 to 60 tokens), so rows sit at different positions."""
    rng = np.random.default_rng(n)
    return [rng.integers(0, n_vocab, 3 + (17 * i) % 58).tolist() for i in range(n)]


def generate(engine: Engine, batch: list[list[int]], max_tokens: list[int]) -> list[list]:
    """Each prompt prefilled alone, then all decoded together until each has its tokens;
    the (token, log-probability) pairs of each."""
    sessions: list[Session] = []
    for prompt, n in zip(batch, max_tokens, strict=True):
        session = engine.open_session(prompt, max_tokens=n)
        session.eog_ids = frozenset()  # random weights: keep going past an end token
        sessions.append(session)
    events = {id(s): [engine.prefill(s)] for s in sessions}
    while live := [s for s in sessions if not s.finished]:
        for session, event in zip(live, engine.decode(live), strict=True):
            events[id(session)].append(event)
    for session in sessions:
        engine.close_session(session)
    return [[(e.token, e.logprob) for e in events[id(s)]] for s in sessions]


@pytest.mark.parametrize("n_sessions", [8, 40])
def test_greedy_tokens_are_the_same_alone_and_in_a_batch(synthetic_model, n_sessions):
    """Alone, each session decodes one row a step (the GEMV); together, n_sessions rows
    (the MMV) that shrink as sessions with fewer tokens finish, down to one."""
    engine = Engine.load(synthetic_model, backend="cuda", n_slots=n_sessions, n_ctx=128)
    batch = prompts(n_sessions, engine.hparams.n_vocab)
    max_tokens = [4 + (5 * i) % 13 for i in range(n_sessions)]
    together = generate(engine, batch, max_tokens)
    for i, (prompt, n) in enumerate(zip(batch, max_tokens, strict=True)):
        assert generate(engine, [prompt], [n]) == [together[i]], i


@pytest.mark.parametrize("n_sessions", [1, 3])
def test_decode_past_the_fold_kernel_threshold_gives_the_tokens_of_the_in_kernel_fold(
    synthetic_model, n_sessions
):
    """Pipelined graph decode whose contexts grow past `fold_kernel_min_tiles` key tiles
    (here 2: from 65 positions on) changes to a graph with rf_attention_fold a layer once,
    and gives the tokens and log-probabilities of decode that folds in the decode kernel
    throughout."""
    runs, stats = [], []
    for min_tiles in (10**6, 2):
        tuning = AttentionTuning(fold_kernel_min_tiles=min_tiles)
        engine = Engine.load(synthetic_model, backend="cuda", n_slots=n_sessions, n_ctx=256,
                             attention_tuning=tuning)  # fmt: skip
        batch = prompts(n_sessions, engine.hparams.n_vocab)  # all shorter than 64 tokens
        runs.append(generate(engine, batch, [100] * n_sessions))
        stats.append(engine.backend.runtime_stats())
    assert runs[1] == runs[0]
    assert stats[1]["graph_captures"] == stats[0]["graph_captures"] + 2  # one a readback set
    assert stats[1]["ahead_taken"] > 0

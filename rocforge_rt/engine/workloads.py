"""The measured workloads the benchmark scripts share: batch-1 decode and one prompt's prefill.

Both follow llama-bench: decode tokens/s is generation after a 1-token prompt
(its tg; greedy unless sampling parameters are given), prompt tokens/s is the
prefill of random token ids, up to and including the first sampled token (its
pp). Random-weight models may sample an end-of-generation id, so decode ignores
those ids.
"""

import time

import numpy as np

from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.sampling import SamplingParams


def decode_tokens_per_s(
    engine: Engine,
    n_decode: int,
    rng: np.random.Generator,
    sampling: SamplingParams = SamplingParams(),
) -> float:
    """Batch-1 decode of `n_decode` tokens after a 1-token prompt (greedy by default)."""
    prompt = [int(rng.integers(0, engine.hparams.n_vocab))]
    session = engine.open_session(prompt, sampling=sampling, max_tokens=n_decode + 1)
    engine.prefill(session)
    session.eog_ids = frozenset()  # keep going past a sampled end-of-generation id
    start = time.perf_counter()
    for _ in range(n_decode):
        engine.decode([session])
    elapsed = time.perf_counter() - start
    engine.close_session(session)
    return n_decode / elapsed


def prompt_tokens_per_s(engine: Engine, n_prompt: int, rng: np.random.Generator) -> float:
    """Prefill of `n_prompt` random token ids (in the engine's chunks) and the first token."""
    prompt = rng.integers(0, engine.hparams.n_vocab, n_prompt).tolist()
    session = engine.open_session(prompt, max_tokens=1)
    start = time.perf_counter()
    engine.prefill(session)
    elapsed = time.perf_counter() - start
    engine.close_session(session)
    return n_prompt / elapsed

"""What a backend can do for a step (`BackendCaps`): fixed when the backend is built, read
once by the engine where it plans steps (backends/contract.py has the rest of the contract)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do, fixed when it is built."""

    ragged_steps: bool  # one forward pass may mix sessions' decode rows and prompt chunks
    lookahead: bool  # run_step(ahead=True) may issue the next decode step (pipelined decode)
    batch_invariant: bool  # a token's outputs are the same alone, batched or in a prompt chunk
    max_tokens: int | None  # the most tokens of one step; None: no limit
    max_logit_rows: int | None  # the most rows of one step that may ask for logits; None: any
    kv_dtype: str  # the KV pool's elements (`step/kv_format.py` KV_DTYPES)

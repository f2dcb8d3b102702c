"""Transformer hyper-parameters read from GGUF metadata."""

from dataclasses import dataclass


@dataclass(frozen=True)
class HParams:
    """Shape and numerics of a llama-family model, as its GGUF metadata states them."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim_k: int  # attention.key_length (defaults to n_embd // n_head)
    head_dim_v: int  # attention.value_length (defaults to n_embd // n_head)
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rope_dims: int  # rope.dimension_count (defaults to head_dim_k)
    rms_eps: float
    tied_embeddings: bool  # True when output.weight is absent and token_embd serves as LM head
    # RoPE scaling, as llama.cpp applies it: pair i of a head turns by
    # pos * rope_freq_scale * rope_base^(-2i / rope_dims) / rope_freq_factors[i].
    rope_freq_scale: float = 1.0  # 1 / rope.scaling.factor of linear scaling (1.0: none)
    # rope_freqs.weight (Llama 3.1-3.3): one factor per rotated pair, rope_dims // 2 of them,
    # each finite and > 0; None: no such tensor (every factor 1)
    rope_freq_factors: tuple[float, ...] | None = None

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim_k

    @property
    def kv_dim_k(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def kv_dim_v(self) -> int:
        return self.n_head_kv * self.head_dim_v

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

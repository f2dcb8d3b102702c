"""The one transformer forward: the step plan, written once over a backend's ops.

Each backend supplies the ops below (numpy functions on the CPU, fused kernels
on a GPU). The GPU backends record the same sequence of ops into launch
handles and a graph; the CPU backend runs them at once.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from rocforge_rt.model.gguf_file import ModelFile, WeightTensor
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.sampling import SampledToken

# The weights of a layer row-stacked into one matrix (upload_weights), by tensor suffix.
QKV_SUFFIXES = ("attn_q", "attn_k", "attn_v")
GATE_UP_SUFFIXES = ("ffn_gate", "ffn_up")

# Per layer, in order: the launches a decode step makes (docs/architecture.md, launch budget).
LAYER_OPS = (
    "norm_qkv_rope",  # RMSNorm folded into the fused Q|K|V GEMV; RoPE + KV-append in its epilogue
    "attention",  # grouped-query attention over the slot's cache
    "matmul_add",  # O projection + residual
    "norm_gate_up_swiglu",  # RMSNorm folded into the fused gate|up GEMV, SwiGLU epilogue
    "matmul_add",  # down projection + residual
)


@dataclass
class LayerWeights:
    """One layer's weights as a backend holds them; Q|K|V and gate|up are row-stacked."""

    attn_norm: Any
    wqkv: Any
    wo: Any
    ffn_norm: Any
    wgate_up: Any
    wdown: Any


@dataclass
class ModelWeights:
    """All weights of a model as a backend holds them."""

    token_embd: Any
    layers: list[LayerWeights]
    output_norm: Any
    lm_head: Any


@dataclass(frozen=True)
class StepOutput:
    """What one forward step hands back to the host."""

    tokens: np.ndarray  # int32 [B]: the token each logits row picked (batch.sampling)
    logprobs: np.ndarray  # float32 [B]: its log-softmax
    top: tuple[tuple[tuple[int, float], ...], ...]  # per row, the alternatives asked for
    logits: np.ndarray | None  # float32 [B, n_vocab], when asked for
    ahead: bool = False  # whether the next decode step of these rows was issued ahead

    def sampled(self, row: int) -> SampledToken:
        return SampledToken(int(self.tokens[row]), float(self.logprobs[row]), self.top[row])


class StepRunner(Protocol):
    """How a backend runs one step: `forward(batch)` issues the forward's ops (eagerly, or
    under capture for a graph), then the backend picks each logits row's token under
    `batch.sampling` (step/sampling.py's rules) and reads back.

    Pipelined decode: `run_step(..., ahead=True)` on a decode-shaped batch may also issue
    the next decode step of the same rows (each feeding the token it just sampled, as the
    device's step state already holds it; never one past a slot's end) before reading this
    one back; the output says whether it did. `take_ahead` then reads that step back
    (`again`: issuing the one after it first), and `discard_ahead` drops it unread; any
    other step drops it too.
    """

    def run_step(
        self,
        batch: StepBatch,
        forward: Callable[[StepBatch], Any],
        want_logits: bool,
        ahead: bool = False,
    ) -> StepOutput: ...
    def take_ahead(self, again: bool) -> StepOutput: ...
    def discard_ahead(self) -> None: ...


class WeightUploader(Protocol):
    """How a backend takes a GGUF tensor (or several stacked by rows) into its own form."""

    def linear(self, *tensors: Any) -> Any: ...
    def vector(self, tensor: Any) -> Any: ...
    def embedding(self, tensor: Any) -> Any: ...


class ForwardOps(Protocol):
    """The ops of one forward pass; activations are whatever the backend passes between them."""

    def embed(self, table: Any, batch: StepBatch) -> Any: ...
    def norm_qkv_rope(
        self, x: Any, norm: Any, weight: Any, layer: int, batch: StepBatch
    ) -> Any: ...
    def attention(self, q: Any, layer: int, batch: StepBatch) -> Any: ...
    def matmul_add(self, x: Any, weight: Any, residual: Any) -> Any: ...
    def norm_gate_up_swiglu(self, x: Any, norm: Any, weight: Any) -> Any: ...
    def lm_head(self, x: Any, norm: Any, weight: Any, batch: StepBatch) -> Any: ...


class BracketedOps:
    """Forward ops that make each call of `ops` through `bracket(name, call)`: what a
    profiler or a test wraps around every op, by the op's name."""

    def __init__(self, ops: ForwardOps, bracket: Callable[[str, Callable[[], Any]], Any]) -> None:
        self.inner = ops
        self._bracket = bracket

    def embed(self, table: Any, batch: StepBatch) -> Any:
        return self._bracket("embed", partial(self.inner.embed, table, batch))

    def norm_qkv_rope(self, x: Any, norm: Any, weight: Any, layer: int, batch: StepBatch) -> Any:
        call = partial(self.inner.norm_qkv_rope, x, norm, weight, layer, batch)
        return self._bracket("norm_qkv_rope", call)

    def attention(self, q: Any, layer: int, batch: StepBatch) -> Any:
        return self._bracket("attention", partial(self.inner.attention, q, layer, batch))

    def matmul_add(self, x: Any, weight: Any, residual: Any) -> Any:
        return self._bracket("matmul_add", partial(self.inner.matmul_add, x, weight, residual))

    def norm_gate_up_swiglu(self, x: Any, norm: Any, weight: Any) -> Any:
        call = partial(self.inner.norm_gate_up_swiglu, x, norm, weight)
        return self._bracket("norm_gate_up_swiglu", call)

    def lm_head(self, x: Any, norm: Any, weight: Any, batch: StepBatch) -> Any:
        return self._bracket("lm_head", partial(self.inner.lm_head, x, norm, weight, batch))


def upload_weights(
    model: ModelFile,
    uploader: WeightUploader,
    checkpoint: Callable[[], None] | None = None,
) -> ModelWeights:
    """Take a validated model's tensors into a backend, stacking Q|K|V and gate|up.

    `checkpoint` is called before each layer's upload and before the embedding's: it may
    raise to stop the upload there (a daemon stopping while it loads).
    """
    check = checkpoint or (lambda: None)
    layers = []
    for i in range(model.hparams.n_layer):
        check()
        layers.append(
            LayerWeights(
                attn_norm=uploader.vector(model.layer(i, "attn_norm")),
                wqkv=uploader.linear(*(model.layer(i, s) for s in QKV_SUFFIXES)),
                wo=uploader.linear(model.layer(i, "attn_output")),
                ffn_norm=uploader.vector(model.layer(i, "ffn_norm")),
                wgate_up=uploader.linear(*(model.layer(i, s) for s in GATE_UP_SUFFIXES)),
                wdown=uploader.linear(model.layer(i, "ffn_down")),
            )
        )
    check()
    token_embd = uploader.embedding(model.tensor("token_embd.weight"))
    lm_head = (
        token_embd
        if model.hparams.tied_embeddings
        else uploader.linear(model.tensor("output.weight"))
    )
    return ModelWeights(
        token_embd=token_embd,
        layers=layers,
        output_norm=uploader.vector(model.tensor("output_norm.weight")),
        lm_head=lm_head,
    )


def held_together(model: ModelFile) -> list[tuple[WeightTensor, ...]]:
    """The model's tensors as `upload_weights` hands them to a backend: each layer's Q|K|V
    and gate|up stacked into one matrix, every other tensor alone."""
    stacks = [
        tuple(model.layer(i, s) for s in suffixes)
        for i in range(model.hparams.n_layer)
        for suffixes in (QKV_SUFFIXES, GATE_UP_SUFFIXES)
    ]
    stacked = {t.name for stack in stacks for t in stack}
    return stacks + [(t,) for name, t in model.tensors.items() if name not in stacked]


def forward(ops: ForwardOps, weights: ModelWeights, batch: StepBatch) -> Any:
    """Run every layer over the batch; return the logits of `batch.logit_rows`."""
    x = ops.embed(weights.token_embd, batch)
    for index, layer in enumerate(weights.layers):
        q = ops.norm_qkv_rope(x, layer.attn_norm, layer.wqkv, index, batch)
        attn = ops.attention(q, index, batch)
        x = ops.matmul_add(attn, layer.wo, x)
        h = ops.norm_gate_up_swiglu(x, layer.ffn_norm, layer.wgate_up)
        x = ops.matmul_add(h, layer.wdown, x)
    return ops.lm_head(x, weights.output_norm, weights.lm_head, batch)

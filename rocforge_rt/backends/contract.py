"""The contract between the engine (and server) and a backend: what a backend is, what it can
do, and the options it is built with.

`Backend` declares every member the engine and the server use; `BackendCaps`
(step/caps.py, below the backends, which build it) is what a backend can do, read once where
steps are planned; `BackendOptions` are the options of `create_backend`, a typed field each.
"""

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rocforge_rt.backends.gpu.attention_plan import DEFAULT_ATTENTION_TUNING, AttentionTuning
from rocforge_rt.backends.gpu.matmul_plan import DEFAULT_MATMUL_TUNING, MatmulTuning
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker
from rocforge_rt.step.caps import BackendCaps
from rocforge_rt.step.forward import ForwardOps, StepRunner, WeightUploader


@dataclass(frozen=True)
class BackendOptions:
    """How to build a backend. The command line gives the same options whatever backend it
    resolves to, so a field a backend cannot honour is ignored by it, as each field says."""

    kv_dtype: str = "f16"  # every backend: the KV pool's elements, "f16" or "fp8"
    # The CPU's (the GPU backends ignore them):
    activations: str = "q8"  # matmul inputs as int8 blocks ("q8") or float32 ("f32")
    threads: int | None = None  # matmul and BLAS threads; None: the physical cores
    # The GPU's (the CPU backend ignores them: it has no step modes and no token limit, is
    # batch invariant whatever `batch_invariant` says, takes no part in pipelined decode
    # here, where it would only compute dropped rows, and its kernels take no tuning):
    max_tokens: int = 512  # the most tokens of one step (the workspace's rows)
    mode: str = "graph"  # how a step is issued: per-kernel-sync, deferred or graph (executor.py)
    overlap: bool = True  # programmatic dependent launch, where the device has it
    batch_invariant: bool = False  # prompt chunks on the int8 GEMM, not the vendor GEMM
    lookahead: bool = True  # pipelined decode (graph mode)
    # What picks the kernels and launch shapes (A/B runs; the defaults are the measured best):
    matmul_tuning: MatmulTuning = DEFAULT_MATMUL_TUNING
    attention_tuning: AttentionTuning = DEFAULT_ATTENTION_TUNING

    @classmethod
    def of(cls, **options: Any) -> "BackendOptions":
        """The options named; ValueError naming any that is not a field (a misspelt name)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown backend option {', '.join(map(repr, unknown))};"
                f" the options are {', '.join(sorted(known))}"
            )
        return cls(**options)


@runtime_checkable
class Backend(WeightUploader, ForwardOps, StepRunner, Protocol):
    """Everything the engine and the server use of a backend: weight upload
    (WeightUploader), the forward's ops (ForwardOps), steps and pipelined decode
    (StepRunner), and the members below. A member a backend has nothing for answers an
    empty value (None, or does nothing), so that no caller probes for it."""

    name: str  # "cpu", "cuda" or "hip"

    @property
    def caps(self) -> BackendCaps: ...

    @property
    def launch_tracker(self) -> LaunchOverheadTracker | None:
        """Host launch times per step (profiling); None where a backend launches nothing."""

    @property
    def kernel_timer(self) -> KernelTimer | None:
        """Device times of sampled steps' kernels (profiling); None where there are none."""

    def weights_uploaded(self, tensors: Iterable[WeightTensor]) -> None:
        """Called once the model's tensors are all uploaded (the CPU drops the file's pages)."""

    def warm_up(self) -> None:
        """Prepare what the first step would (the CPU compiles its kernels)."""

    def device_info(self) -> dict[str, object]: ...

    def runtime_stats(self) -> dict[str, object] | None:
        """Launches, syncs and graph replays per step; None where a backend counts none."""

    def reset_runtime_stats(self) -> None: ...

    def to_host(self, values: Any) -> np.ndarray:
        """An activation (what the forward's ops pass between them) as a host array."""

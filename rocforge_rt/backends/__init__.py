"""Device backends: the CPU reference and the GPU drivers behind one interface."""

from typing import Any, Protocol

import numpy as np

from rocforge_rt.errors import BackendError
from rocforge_rt.model.hparams import HParams

BACKEND_NAMES = ("auto", "cpu", "cuda", "hip")


class Backend(Protocol):
    """What the engine needs of a backend: weight upload, forward ops, results to host."""

    name: str

    def device_info(self) -> dict[str, object]: ...
    def to_host(self, values: Any) -> np.ndarray: ...


def resolve_backend_name(name: str) -> str:
    """`auto` becomes hip if an AMD device is visible, else cuda if an NVIDIA one is, else cpu."""
    if name not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    return "cpu"


def create_backend(name: str, hparams: HParams, *, n_slots: int, n_ctx: int) -> Any:
    """A backend ready for a model of these hyper-parameters with an n_slots x n_ctx KV pool."""
    resolved = resolve_backend_name(name)
    if resolved == "cpu":
        from rocforge_rt.backends.cpu import CpuBackend

        return CpuBackend(hparams, n_slots, n_ctx)
    raise BackendError(f"the {resolved} engine backend is not available in this build")

"""Device backends: the CPU reference and the GPU drivers behind one interface."""

from typing import TYPE_CHECKING, Any

from rocforge_rt.backends.contract import Backend, BackendCaps, BackendOptions
from rocforge_rt.dirs import point_numba_cache
from rocforge_rt.errors import BackendError
from rocforge_rt.model.hparams import HParams
from rocforge_rt.profiling.load_progress import LoadProgress

if TYPE_CHECKING:
    from rocforge_rt.backends.gpu.driver import Driver
    from rocforge_rt.backends.gpu.kernel_library import Compiler

__all__ = ["Backend", "BackendCaps", "BackendOptions", "create_backend"]

# numba caches the CPU kernels in the user cache folder (rocforge_rt/dirs.py), not beside the
# package (site-packages, where installed); NUMBA_CACHE_DIR in the environment wins. Set here,
# before any backend module loads numba (it reads the variable once, then).
point_numba_cache()

BACKEND_NAMES = ("auto", "cpu", "cuda", "hip")
KERNEL_TARGETS = ("sm_90", "gfx90a", "gfx1030")  # what `rocforge kernels check` builds for
# What a wheel's code objects are built for (`make wheel`): the NVIDIA GPUs people run
# (A100, RTX 30xx, RTX 40xx / L4 / L40, H100 / H200) and the AMD targets the packaged hiprtc
# builds (MI200 / MI250, RX 6000).
WHEEL_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "gfx90a", "gfx1030")


def resolve_backend_name(name: str) -> str:
    """`auto` becomes hip if an AMD device is visible, else cuda if an NVIDIA one is, else cpu."""
    if name not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    from rocforge_rt.backends.gpu import cuda, hip

    if hip.device_count() > 0:
        return "hip"
    if cuda.device_count() > 0:
        return "cuda"
    return "cpu"


def weights_memory_bytes(name: str, stacks: Any) -> int:
    """Bytes a resolved backend holds for a model's weights, given as the tuples of tensors
    it takes together (`step.forward.held_together`): the CPU backend's own layout
    (`cpu_weights.held_bytes`), a GPU's the file's bytes."""
    if name == "cpu":
        from rocforge_rt.backends.cpu_weights import held_bytes

        return sum(held_bytes(stack) for stack in stacks)
    return sum(t.nbytes for stack in stacks for t in stack)


def device_memory_bytes(name: str) -> int:
    """Memory of the device a resolved backend name runs on (host RAM for the CPU)."""
    if name == "cpu":
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    from rocforge_rt.backends.gpu import cuda, hip

    return (cuda if name == "cuda" else hip).device_memory()


def create_backend(
    name: str,
    hparams: HParams,
    *,
    n_slots: int,
    n_ctx: int,
    options: BackendOptions | None = None,
    progress: LoadProgress | None = None,
) -> Backend:
    """A backend ready for a model of these hyper-parameters with an n_slots x n_ctx KV pool,
    built with `options` (each field says which backends honour it; None: the defaults);
    `progress` hears of the kernels a GPU backend compiles."""
    options = options or BackendOptions()
    resolved = resolve_backend_name(name)
    if resolved == "cpu":
        from rocforge_rt.backends.cpu import CpuBackend

        return CpuBackend(
            hparams,
            n_slots,
            n_ctx,
            activations=options.activations,
            threads=options.threads,
            kv_dtype=options.kv_dtype,
        )
    from rocforge_rt.backends.gpu.backend import GpuBackend

    driver: Driver
    compiler: Compiler
    if resolved == "cuda":
        from rocforge_rt.backends.gpu.cuda import CudaDriver, NvrtcCompiler

        driver = CudaDriver()
        compiler = NvrtcCompiler(arch=driver.info.arch)
    else:
        from rocforge_rt.backends.gpu.hip import HipDriver, HiprtcCompiler

        driver = HipDriver()
        compiler = HiprtcCompiler(driver.info.arch, warp_size=driver.info.warp_size)
    return GpuBackend(
        driver,
        compiler,
        hparams,
        n_slots=n_slots,
        n_ctx=n_ctx,
        max_tokens=options.max_tokens,
        mode=options.mode,
        overlap=options.overlap,
        batch_invariant=options.batch_invariant,
        lookahead=options.lookahead,
        kv_dtype=options.kv_dtype,
        matmul_tuning=options.matmul_tuning,
        attention_tuning=options.attention_tuning,
        progress=progress,
    )


def kernel_compiler(target: str) -> "Compiler":
    """The kernel compiler of a target: NVRTC for NVIDIA's (sm_90), hiprtc for AMD's
    (gfx90a); BackendError where it is not installed, ValueError for no such target."""
    if target.startswith("sm_"):
        from rocforge_rt.backends.gpu.cuda import NvrtcCompiler

        return NvrtcCompiler(target)
    from rocforge_rt.backends.gpu.hip import HiprtcCompiler

    return HiprtcCompiler(target)

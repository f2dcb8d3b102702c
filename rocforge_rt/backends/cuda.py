"""NVIDIA backend through cuda-bindings.

For now this module holds the compile half: `NvrtcCompiler` turns a kernel
source into a CUBIN for the device's real architecture (never PTX: the GPU
machines run a CUDA 13.0 driver, and a cubin from any 13.x NVRTC loads there).
The driver half (device, memory, streams, launch, graphs) joins it later and
uses the same `check` helper.

cuda-bindings is imported lazily so that this module imports on a machine
without it; constructing a compiler then raises `BackendError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rocforge_rt.errors import BackendError, KernelCompileError

# Options every compile gets; part of `NvrtcCompiler.version` so that a change
# here invalidates cached code objects.
_BASE_OPTIONS = ("-std=c++17",)


def check(api_name: str, result: Any) -> Any:
    """Unwrap a cuda-bindings return value, raising `BackendError` on failure.

    cuda-bindings returns a tuple ``(status, *values)``; status 0 is success.
    Returns None for no value, the value itself for one, else the tuple of values.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise BackendError(f"{api_name} failed: {name} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise BackendError(
            f"NVRTC is unavailable ({exc}); install the extra: pip install 'rocforge-rt[cuda]'"
        ) from exc
    return nvrtc


def _define_options(defines: Mapping[str, str | int]) -> list[str]:
    return [f"-D{name}={value}" for name, value in sorted(defines.items())]


class NvrtcCompiler:
    """Compiles kernel sources to CUBIN with NVRTC for one NVIDIA architecture."""

    vendor = "cuda"

    def __init__(self, arch: str = "sm_90", warp_size: int = 32) -> None:
        if not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
            raise ValueError(f"NVIDIA arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
        if warp_size != 32:
            raise ValueError(f"NVIDIA warps have 32 lanes, got warp_size={warp_size}")
        self._nvrtc = _nvrtc()
        try:
            major, minor = check("nvrtcVersion", self._nvrtc.nvrtcVersion())
        except RuntimeError as exc:  # cuda-pathfinder finds no libnvrtc
            raise BackendError(
                f"NVRTC library not found ({exc}); pip install 'rocforge-rt[cuda]'"
            ) from exc
        self.arch = arch
        self.warp_size = warp_size
        self.version = f"nvrtc {major}.{minor} {' '.join(_BASE_OPTIONS)}"

    def compile(
        self,
        source: str,
        filename: str,
        headers: Mapping[str, str],
        defines: Mapping[str, str | int],
    ) -> bytes:
        """Compile `source` (named `filename` in messages) to a CUBIN.

        `headers` maps include names to contents, served in memory. Raises
        `KernelCompileError` with NVRTC's log when the source does not compile.
        """
        nvrtc = self._nvrtc
        names = sorted(headers)
        prog = check(
            "nvrtcCreateProgram",
            nvrtc.nvrtcCreateProgram(
                source.encode(),
                filename.encode(),
                len(names),
                [headers[n].encode() for n in names],
                [n.encode() for n in names],
            ),
        )
        try:
            options = [
                f"--gpu-architecture={self.arch}",
                *_BASE_OPTIONS,
                *_define_options(defines),
            ]
            status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            log = self._log(prog)
            if status[0] == nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION:
                raise KernelCompileError(
                    f"NVRTC failed to compile {filename} for {self.arch}:\n{log}"
                )
            check("nvrtcCompileProgram", status)
            size = check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
            cubin = b"\0" * size
            check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, cubin))
        finally:
            check("nvrtcDestroyProgram", nvrtc.nvrtcDestroyProgram(prog))
        return cubin

    def _log(self, prog: Any) -> str:
        nvrtc = self._nvrtc
        size = check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
        log = b"\0" * size
        check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log))
        return log.rstrip(b"\0").decode(errors="replace").strip()

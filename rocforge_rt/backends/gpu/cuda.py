"""NVIDIA backend through cuda-bindings: the NVRTC compiler and the driver-API device driver.

`NvrtcCompiler` turns a kernel source into a CUBIN for the device's real
architecture (never PTX: the GPU machines run a CUDA 13.0 driver, and a cubin
from any 13.x NVRTC loads there). `CudaDriver` runs code on one device through
the driver API (primary context, blocking streams, thread-local stream
capture); its interface, its generic calls and its executor-thread contract
live in `rocforge_rt.backends.gpu.driver`: this module holds the driver-API
name of each primitive, the flag values, device selection and information, and
the launcher (cuLaunchKernel, or cuLaunchKernelEx for programmatic dependent
launch). `device_count` and `device_memory` ask the driver API without a
context.

cuda-bindings is imported lazily so that this module imports on a machine
without it; constructing a compiler or a driver then raises `BackendError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rocforge_rt.backends.gpu.driver import DeviceInfo, Driver, check
from rocforge_rt.errors import BackendError, KernelCompileError

# Options every compile gets; part of `NvrtcCompiler.version` so that a change
# here invalidates cached code objects.
_BASE_OPTIONS = ("-std=c++17",)


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
        self.last_log = ""

    def compile(
        self,
        source: str,
        filename: str,
        headers: Mapping[str, str],
        defines: Mapping[str, str | int],
        extra_options: Sequence[str] = (),
    ) -> bytes:
        """Compile `source` (named `filename` in messages) to a CUBIN.

        `headers` maps include names to contents, served in memory; `extra_options` go to
        NVRTC after the usual ones (e.g. ``--ptxas-options=-v``), and the compile's log is
        kept in `last_log`. Raises `KernelCompileError` with NVRTC's log when the source
        does not compile.
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
                *extra_options,
            ]
            status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            log = self.last_log = self._log(prog)
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


# ---------------------------------------------------------------- driver


def _driver_api() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendError(
            f"cuda-bindings is unavailable ({exc}); pip install 'rocforge-rt[cuda]'"
        ) from exc
    return driver


def device_count() -> int:
    """NVIDIA devices visible to the driver API; 0 (never an exception) without driver or GPU."""
    try:
        cu = _driver_api()
        if int(cu.cuInit(0)[0]) != 0:
            return 0
        status, count = cu.cuDeviceGetCount()
        return int(count) if int(status) == 0 else 0
    except Exception:  # a missing libcuda, a broken install: no usable device
        return 0


def device_memory(device_index: int = 0) -> int:
    """Total memory of an NVIDIA device in bytes, without creating a context."""
    cu = _driver_api()
    check("cuInit", cu.cuInit(0))
    device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
    return int(check("cuDeviceTotalMem", cu.cuDeviceTotalMem(device)))


class CudaDriver(Driver):
    """One NVIDIA device through the cuda-bindings driver API (its primary context)."""

    api_names = {
        "synchronize": "cuCtxSynchronize",
        "alloc": "cuMemAlloc",
        "free": "cuMemFree",
        "host_alloc": "cuMemHostAlloc",
        "host_device_pointer": "cuMemHostGetDevicePointer",
        "host_free": "cuMemFreeHost",
        "copy_htod": "cuMemcpyHtoD",
        "copy_htod_async": "cuMemcpyHtoDAsync",
        "copy_dtoh": "cuMemcpyDtoH",
        "copy_dtoh_async": "cuMemcpyDtoHAsync",
        "memset": "cuMemsetD8Async",
        "stream_create": "cuStreamCreate",
        "stream_destroy": "cuStreamDestroy",
        "stream_synchronize": "cuStreamSynchronize",
        "event_create": "cuEventCreate",
        "event_destroy": "cuEventDestroy",
        "event_record": "cuEventRecord",
        "event_synchronize": "cuEventSynchronize",
        "event_elapsed": "cuEventElapsedTime",
        "module_load": "cuModuleLoadData",
        "module_unload": "cuModuleUnload",
        "module_function": "cuModuleGetFunction",
        "occupancy": "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        "begin_capture": "cuStreamBeginCapture",
        "end_capture": "cuStreamEndCapture",
        "graph_instantiate": "cuGraphInstantiate",
        "graph_launch": "cuGraphLaunch",
        "graph_destroy": "cuGraphDestroy",
        "graph_exec_destroy": "cuGraphExecDestroy",
    }

    def __init__(self, device_index: int = 0) -> None:
        cu = self._cu = _driver_api()
        try:
            check("cuInit", cu.cuInit(0))
        except RuntimeError as exc:  # cuda-pathfinder finds no libcuda
            raise BackendError(
                f"cuInit failed: the NVIDIA driver library is missing ({exc})"
            ) from exc
        count = check("cuDeviceGetCount", cu.cuDeviceGetCount())
        if not 0 <= device_index < count:
            raise BackendError(f"cuDeviceGet: no CUDA device {device_index} ({count} present)")
        self._device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
        self._context = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._device))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._context))
        self._max_dynamic_shared = (
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        )
        super().__init__(
            self._device_info(),
            cu,
            stream_flags=cu.CUstream_flags.CU_STREAM_DEFAULT,
            event_no_timing_flags=cu.CUevent_flags.CU_EVENT_DISABLE_TIMING,
            host_alloc_flags=0,
            mapped_host_alloc_flags=cu.CU_MEMHOSTALLOC_DEVICEMAP,
            capture_mode=cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        # Programmatic dependent launch and bulk copies need compute capability 9.0 (Hopper)
        # or newer.
        hopper = int(self.info.arch[3:].rstrip("af")) >= 90
        self.supports_overlap = self.supports_bulk_copy = self.supports_clusters = hopper

    def _device_info(self) -> DeviceInfo:
        cu, dev = self._cu, self._device
        attr = cu.CUdevice_attribute

        def get(name: str) -> int:
            return int(
                check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(getattr(attr, name), dev))
            )

        name = check("cuDeviceGetName", cu.cuDeviceGetName(256, dev))
        major = get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        return DeviceInfo(
            vendor="cuda",
            name=bytes(name).split(b"\0", 1)[0].decode(errors="replace"),
            arch=f"sm_{major}{minor}",
            warp_size=get("CU_DEVICE_ATTRIBUTE_WARP_SIZE"),
            multiprocessors=get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
            total_memory=int(check("cuDeviceTotalMem", cu.cuDeviceTotalMem(dev))),
            l2_bytes=get("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
            max_shared_per_block=get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        )

    def _bind_thread(self) -> None:
        check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._context))

    def _release_device(self) -> None:
        check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._device))

    def _allow_dynamic_shared(self, function: Any, nbytes: int) -> None:
        """Past 48 KiB a kernel's dynamic shared memory needs this opt-in."""
        result = self._cu.cuFuncSetAttribute(function, self._max_dynamic_shared, nbytes)
        check("cuFuncSetAttribute", result)

    def _launcher(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: Any,
        params_ptr: int,
        overlap: bool,
        cluster: int,
    ) -> tuple[str, Callable[[], Any]]:
        # An int kernelParams is taken as the address of the void*[] as is: no packing here.
        cu = self._cu
        if not overlap and cluster == 1:
            call = functools.partial(
                cu.cuLaunchKernel, function, *grid, *block, shared_bytes, stream, params_ptr, 0
            )
            return "cuLaunchKernel", call
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_bytes
        config.hStream = stream
        attributes = []
        if overlap:
            attribute = cu.CUlaunchAttribute()
            attribute.id = (
                cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            )
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        if cluster > 1:
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dims = attribute.value.clusterDim
            dims.x, dims.y, dims.z = cluster, 1, 1
            attributes.append(attribute)
        config.attrs = attributes
        config.numAttrs = len(attributes)
        return "cuLaunchKernelEx", functools.partial(
            cu.cuLaunchKernelEx, config, function, params_ptr, 0
        )

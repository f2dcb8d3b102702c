"""AMD backend through hip-python: the hiprtc compiler and the HIP device driver.

`HiprtcCompiler` turns a kernel source into an AMD code object (ELF) for one
gfx target. `HipDriver` runs code on one device through the HIP module API
(blocking streams, thread-local stream capture); its interface, its generic
calls and its executor-thread contract live in `rocforge_rt.backends.gpu.driver`:
this module holds the HIP name of each primitive, the flag values, device
selection and information, and the launcher (hipModuleLaunchKernel). Without
an AMD GPU (CI) only `device_count() == 0` and the constructor's error are
exercised: kernel execution on AMD stays unverified until an AMD GPU runs the
test suite. The module also holds `rocm_path`/`ensure_rocm_path` and
`default_warp_size`.

hiprtc runs in a child process (``python -m rocforge_rt.backends.gpu.hip``, one JSON
request on stdin, one JSON reply): the HIP 5.2 compiler that Debian ships
crashes on targets it does not know (gfx942, gfx1100), and a crash must become
a `KernelCompileError`, not take the runtime down.

hip-python finds the HIP libraries through ROCM_PATH. Where it is unset, a source
checkout's ``.rocm`` folder made by ``scripts/install_hip_sdk.sh`` is used.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rocforge_rt.backends.gpu.driver import DeviceInfo, Driver, check
from rocforge_rt.dirs import checkout_root
from rocforge_rt.errors import BackendError, KernelCompileError, RocforgeError

# Options every compile gets; with the wavefront option, part of
# `HiprtcCompiler.version` so that a change invalidates cached code objects.
_BASE_OPTIONS = ("-std=c++17", "-O3")
_ARCH_RE = re.compile(r"^gfx[0-9a-f]+(:[a-z]+[+-])*$")
# HIP 5.2's hiprtc names files by its temporary folder in the log: the source is
# ".../comgr-XXXX/input/CompileSource", a header ".../comgr-XXXX/include/NAME".
_COMGR_SOURCE_RE = re.compile(r"\S*/comgr-\w+/input/CompileSource")
_COMGR_INCLUDE_RE = re.compile(r"\S*/comgr-\w+/include/")
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # holds rocforge_rt: the worker imports it


def rocm_path() -> str | None:
    """The ROCm folder to load HIP from: $ROCM_PATH, else a source checkout's ``.rocm`` if
    set up."""
    if os.environ.get("ROCM_PATH"):
        return os.environ["ROCM_PATH"]
    root = checkout_root()
    if root is not None and (root / ".rocm" / "lib" / "libamdhip64.so").exists():
        return str(root / ".rocm")
    return None


def ensure_rocm_path() -> str | None:
    """Export ROCM_PATH (see `rocm_path`) before hip-python loads its libraries."""
    path = rocm_path()
    if path is not None:
        os.environ["ROCM_PATH"] = path
    return path


def default_warp_size(arch: str) -> int:
    """Wavefront size of a gfx target: 64 on GCN/CDNA (gfx9), 32 on RDNA (gfx10+)."""
    return 64 if arch.startswith("gfx9") else 32


def _wave_options(arch: str, warp_size: int) -> tuple[str, ...]:
    """Options selecting `warp_size` on `arch`; RDNA runs wave64 on request, gfx9 only wave64."""
    if warp_size == default_warp_size(arch):
        return ()
    if warp_size == 64:
        return ("-mwavefrontsize64",)
    raise ValueError(f"{arch} cannot run {warp_size}-lane wavefronts")


class HiprtcCompiler:
    """Compiles kernel sources to AMD code objects with hiprtc for one gfx target.

    Construction probes the toolchain in a child process and raises
    `BackendError` when hip-python or the HIP libraries are missing.
    """

    vendor = "hip"

    def __init__(self, arch: str, warp_size: int | None = None, timeout_s: float = 300.0) -> None:
        if not _ARCH_RE.match(arch):
            raise ValueError(f"AMD arch must look like 'gfx90a' or 'gfx1030', got {arch!r}")
        self.arch = arch
        self.warp_size = default_warp_size(arch) if warp_size is None else warp_size
        self.timeout_s = timeout_s
        self._options = (*_BASE_OPTIONS, *_wave_options(arch, self.warp_size))
        reply = _run_worker(
            {"op": "version"}, timeout_s, f"probing hiprtc for {arch}", BackendError
        )
        if not reply["ok"]:
            raise BackendError(
                f"hiprtc is unavailable: {reply['message']} "
                "(install with: pip install 'rocforge-rt[hip]' && scripts/install_hip_sdk.sh)"
            )
        self.version = f"{reply['version']} {' '.join(self._options)}"

    def compile(
        self,
        source: str,
        filename: str,
        headers: Mapping[str, str],
        defines: Mapping[str, str | int],
    ) -> bytes:
        """Compile `source` (named `filename` in messages) to a code object.

        `headers` maps include names to contents, served in memory. Raises
        `KernelCompileError` with hiprtc's log when the source does not compile
        or the compiler crashes.
        """
        options = [
            f"--gpu-architecture={self.arch}",
            *self._options,
            *(f"-D{name}={value}" for name, value in sorted(defines.items())),
        ]
        request = {
            "op": "compile",
            "source": source,
            "filename": filename,
            "headers": dict(headers),
            "options": options,
        }
        what = f"compiling {filename} for {self.arch}"
        reply = _run_worker(request, self.timeout_s, what, KernelCompileError)
        if reply["ok"]:
            return base64.b64decode(reply["code"])
        if reply["kind"] == "compile":
            raise KernelCompileError(f"hiprtc failed {what}:\n{reply['log']}")
        raise BackendError(reply["message"])


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    path = rocm_path()
    if path is not None:
        env["ROCM_PATH"] = path
        # hip-python before 10 dlopens the bare library names; ROCM_PATH is enough after.
        lib = str(Path(path) / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def _run_worker(
    request: dict[str, Any], timeout_s: float, what: str, error: type[RocforgeError]
) -> dict[str, Any]:
    """Run one request in a child process; a crash or a hang raises `error`."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rocforge_rt.backends.gpu.hip"],
            input=json.dumps(request).encode(),
            capture_output=True,
            timeout=timeout_s,
            env=_worker_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise error(f"hiprtc timed out after {timeout_s:.0f} s {what}") from exc
    stderr = proc.stderr.decode(errors="replace").strip()
    if proc.returncode == 0:
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError:
            pass
    if proc.returncode < 0:
        cause = f"crashed ({signal.Signals(-proc.returncode).name})"
    else:
        cause = f"exited with status {proc.returncode}"
    tail = "\n".join(stderr.splitlines()[-20:])
    raise error(f"hiprtc {cause} {what}" + (f":\n{tail}" if tail else ""))


# ---------------------------------------------------------------- driver


def _hip_api() -> Any:
    ensure_rocm_path()
    try:
        from hip import hip
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendError(
            f"hip-python or the HIP runtime is unavailable ({exc}); "
            "pip install 'rocforge-rt[hip]' and set ROCM_PATH"
        ) from exc
    return hip


def device_count() -> int:
    """AMD devices visible to HIP; 0 (never an exception) without runtime or GPU."""
    try:
        status, count = _hip_api().hipGetDeviceCount()
        return int(count) if int(status) == 0 else 0
    except Exception:  # a missing libamdhip64, a broken install: no usable device
        return 0


def device_memory(device_index: int = 0) -> int:
    """Total memory of an AMD device in bytes."""
    hip = _hip_api()
    check("hipInit", hip.hipInit(0))
    return int(check("hipDeviceTotalMem", hip.hipDeviceTotalMem(device_index)))


class HipDriver(Driver):
    """One AMD device through hip-python's HIP module API."""

    api_names = {
        "synchronize": "hipDeviceSynchronize",
        "alloc": "hipMalloc",
        "free": "hipFree",
        "host_alloc": "hipHostMalloc",
        "host_device_pointer": "hipHostGetDevicePointer",
        "host_free": "hipHostFree",
        "copy_htod": "hipMemcpyHtoD",
        "copy_htod_async": "hipMemcpyHtoDAsync",
        "copy_dtoh": "hipMemcpyDtoH",
        "copy_dtoh_async": "hipMemcpyDtoHAsync",
        "memset": "hipMemsetD8Async",
        "stream_create": "hipStreamCreateWithFlags",
        "stream_destroy": "hipStreamDestroy",
        "stream_synchronize": "hipStreamSynchronize",
        "event_create": "hipEventCreateWithFlags",
        "event_destroy": "hipEventDestroy",
        "event_record": "hipEventRecord",
        "event_synchronize": "hipEventSynchronize",
        "event_elapsed": "hipEventElapsedTime",
        "module_load": "hipModuleLoadData",
        "module_unload": "hipModuleUnload",
        "module_function": "hipModuleGetFunction",
        "occupancy": "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
        "begin_capture": "hipStreamBeginCapture",
        "end_capture": "hipStreamEndCapture",
        "graph_instantiate": "hipGraphInstantiateWithFlags",
        "graph_launch": "hipGraphLaunch",
        "graph_destroy": "hipGraphDestroy",
        "graph_exec_destroy": "hipGraphExecDestroy",
    }

    def __init__(self, device_index: int = 0) -> None:
        hip = self._hip = _hip_api()
        check("hipInit", hip.hipInit(0))
        count = check("hipGetDeviceCount", hip.hipGetDeviceCount())
        if not 0 <= device_index < count:
            raise BackendError(f"hipSetDevice: no HIP device {device_index} ({count} present)")
        self._device = device_index
        check("hipSetDevice", hip.hipSetDevice(device_index))
        super().__init__(
            self._device_info(),
            hip,
            stream_flags=hip.hipStreamDefault,
            event_no_timing_flags=hip.hipEventDisableTiming,
            host_alloc_flags=hip.hipHostMallocDefault,
            mapped_host_alloc_flags=hip.hipHostMallocMapped,
            capture_mode=hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal,
        )

    def _device_info(self) -> DeviceInfo:
        hip, dev = self._hip, self._device
        attr = hip.hipDeviceAttribute_t

        def get(name: str) -> int:
            return int(
                check("hipDeviceGetAttribute", hip.hipDeviceGetAttribute(getattr(attr, name), dev))
            )

        props = check("hipGetDeviceProperties", hip.hipGetDeviceProperties(dev))
        return DeviceInfo(
            vendor="hip",
            name=str(props.name),
            arch=str(props.gcnArchName).split(":", 1)[0],  # 'gfx90a:sramecc+:xnack-' -> 'gfx90a'
            warp_size=get("hipDeviceAttributeWarpSize"),
            multiprocessors=get("hipDeviceAttributeMultiprocessorCount"),
            total_memory=int(props.totalGlobalMem),
            l2_bytes=get("hipDeviceAttributeL2CacheSize"),
            max_shared_per_block=get("hipDeviceAttributeMaxSharedMemoryPerBlock"),
        )

    def _bind_thread(self) -> None:
        check("hipSetDevice", self._hip.hipSetDevice(self._device))

    def _release_device(self) -> None:
        """Nothing to let go of: HIP keeps one implicit context per device."""

    def _allow_dynamic_shared(self, function: Any, nbytes: int) -> None:
        """Nothing to call: an AMD kernel may use all of a block's LDS without opting in."""

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
        # HIP has no programmatic dependent launch (supports_overlap is False): no overlap;
        # nor clusters (supports_clusters is False): cluster is 1.
        call = functools.partial(
            self._hip.hipModuleLaunchKernel,
            function,
            *grid,
            *block,
            shared_bytes,
            stream,
            params_ptr,
            None,
        )
        return "hipModuleLaunchKernel", call


# ---------------------------------------------------------------- child process


def _hiprtc() -> Any:
    ensure_rocm_path()
    from hip import hiprtc

    return hiprtc


def _program_log(hiprtc: Any, prog: Any, filename: str) -> str:
    size = check("hiprtcGetProgramLogSize", hiprtc.hiprtcGetProgramLogSize(prog))
    log = bytearray(size)
    if size:
        check("hiprtcGetProgramLog", hiprtc.hiprtcGetProgramLog(prog, log))
    text = bytes(log).rstrip(b"\0").decode(errors="replace").strip()
    return _COMGR_INCLUDE_RE.sub("", _COMGR_SOURCE_RE.sub(filename, text))


def _worker_version() -> dict[str, Any]:
    from hip import hip

    hiprtc = _hiprtc()
    major, minor = check("hiprtcVersion", hiprtc.hiprtcVersion())
    runtime = check("hipRuntimeGetVersion", hip.hipRuntimeGetVersion())
    hip_version = f"{runtime // 10_000_000}.{runtime // 100_000 % 100}.{runtime % 100_000}"
    return {"ok": True, "version": f"hiprtc {major}.{minor} HIP {hip_version}"}


def _worker_compile(request: dict[str, Any]) -> dict[str, Any]:
    hiprtc = _hiprtc()
    filename = request["filename"]
    names = sorted(request["headers"])
    prog = check(
        "hiprtcCreateProgram",
        hiprtc.hiprtcCreateProgram(
            request["source"].encode(),
            filename.encode(),
            len(names),
            [request["headers"][n].encode() for n in names],
            [n.encode() for n in names],
        ),
    )
    options = [o.encode() for o in request["options"]]
    status = hiprtc.hiprtcCompileProgram(prog, len(options), options)
    log = _program_log(hiprtc, prog, filename)
    if status[0] == hiprtc.hiprtcResult.HIPRTC_ERROR_COMPILATION:
        return {"ok": False, "kind": "compile", "log": log}
    check("hiprtcCompileProgram", status)
    size = check("hiprtcGetCodeSize", hiprtc.hiprtcGetCodeSize(prog))
    code = bytearray(size)
    check("hiprtcGetCode", hiprtc.hiprtcGetCode(prog, code))
    # No hiprtcDestroyProgram: hip-python 10 segfaults in it against HIP 5.2, and
    # this process exits right after the reply.
    return {"ok": True, "code": base64.b64encode(bytes(code)).decode()}


def _worker_main() -> None:
    """Serve one request from stdin; library chatter goes to stderr, the reply to stdout."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    request = json.load(sys.stdin)
    try:
        reply = _worker_version() if request["op"] == "version" else _worker_compile(request)
    except (ImportError, OSError, RuntimeError, BackendError) as exc:
        reply = {"ok": False, "kind": "backend", "message": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(reply_fd, "w") as out:
        json.dump(reply, out)


if __name__ == "__main__":
    _worker_main()

"""AMD backend through hip-python.

For now this module holds the compile half: `HiprtcCompiler` turns a kernel
source into an AMD code object (ELF) for one gfx target. The driver half
(device, memory, streams, launch, graphs) joins it later and uses the same
`check` helper and `ensure_rocm_path`.

hiprtc runs in a child process (``python -m rocforge_rt.backends.hip``, one JSON
request on stdin, one JSON reply): the HIP 5.2 compiler that Debian ships
crashes on targets it does not know (gfx942, gfx1100), and a crash must become
a `KernelCompileError`, not take the runtime down.

hip-python finds the HIP libraries through ROCM_PATH. Where it is unset, the
repository's ``.rocm`` folder made by ``scripts/install_hip_sdk.sh`` is used.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rocforge_rt.errors import BackendError, KernelCompileError, RocforgeError

# Options every compile gets; with the wavefront option, part of
# `HiprtcCompiler.version` so that a change invalidates cached code objects.
_BASE_OPTIONS = ("-std=c++17", "-O3")
_ARCH_RE = re.compile(r"^gfx[0-9a-f]+(:[a-z]+[+-])*$")
# HIP 5.2's hiprtc names files by its temporary folder in the log: the source is
# ".../comgr-XXXX/input/CompileSource", a header ".../comgr-XXXX/include/NAME".
_COMGR_SOURCE_RE = re.compile(r"\S*/comgr-\w+/input/CompileSource")
_COMGR_INCLUDE_RE = re.compile(r"\S*/comgr-\w+/include/")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
REPO_ROCM_DIR = _PACKAGE_ROOT / ".rocm"


def check(api_name: str, result: Any) -> Any:
    """Unwrap a hip-python return value, raising `BackendError` on failure.

    hip-python returns a tuple ``(status, *values)``; status 0 is success.
    Returns None for no value, the value itself for one, else the tuple of values.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise BackendError(f"{api_name} failed: {name} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def rocm_path() -> str | None:
    """The ROCm folder to load HIP from: $ROCM_PATH, else the repo's ``.rocm`` if set up."""
    if os.environ.get("ROCM_PATH"):
        return os.environ["ROCM_PATH"]
    if (REPO_ROCM_DIR / "lib" / "libamdhip64.so").exists():
        return str(REPO_ROCM_DIR)
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
            [sys.executable, "-m", "rocforge_rt.backends.hip"],
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

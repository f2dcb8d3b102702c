"""`rocforge kernels check` and `rocforge kernels build`: compile the kernel sources for
targets (no GPU needed), in parallel, into the kernel cache or a wheel's folder."""

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rocforge_rt.backends import KERNEL_TARGETS, WHEEL_TARGETS
from rocforge_rt.cli.options import CommandError, add_location_options
from rocforge_rt.cli.progress import TerminalProgress
from rocforge_rt.errors import BackendError
from rocforge_rt.profiling.load_progress import COMPILING_KERNELS

if TYPE_CHECKING:
    from rocforge_rt.backends.gpu.kernel_library import KernelLibrary


def _library(target: str, named: bool) -> "KernelLibrary | None":
    """The kernel library of `target`; None (said) where its compiler is missing and the
    target was not named."""
    from rocforge_rt.backends import kernel_compiler
    from rocforge_rt.backends.gpu.kernel_library import KernelLibrary

    try:
        return KernelLibrary(kernel_compiler(target))
    except ValueError as exc:
        raise CommandError(f"--target {target}: {exc}") from None
    except BackendError as exc:
        if named:  # asked for by name: it must compile
            raise
        print(f"{target}: skipped, no compiler: {exc}")
        return None


def _build(target: str, library: "KernelLibrary", jobs: int | None) -> str:
    """Compile what `library` lacks, with a progress bar; the line that says what it did."""
    started = time.perf_counter()
    sources = library.sources()
    with TerminalProgress() as progress:
        compiled = library.build(jobs=jobs, progress=lambda done, total: progress(
            f"{target}: {COMPILING_KERNELS}", done, total))  # fmt: skip
    kernels = sum(len(library.load(name).kernels) for name in sources)
    wheel = library.prebuilt_hits  # the loads just made: the cache first, then the wheel
    return (
        f"{target}: {len(sources)} sources, {kernels} kernels ({compiled} compiled,"
        f" {len(sources) - compiled - wheel} cached, {wheel} from the wheel) in"
        f" {time.perf_counter() - started:.1f} s [{library.compiler.version}]"
    )


def _cmd_kernels_check(args: argparse.Namespace) -> int:
    """Compile every kernel source for each target whose compiler is installed."""
    from rocforge_rt.backends.gpu.kernel_library import kernels_dir

    print(f"kernel sources: {kernels_dir()}")
    checked = 0
    for target in args.target or KERNEL_TARGETS:
        library = _library(target, named=bool(args.target))
        if library is None:
            continue
        print(_build(target, library, args.jobs))  # KernelCompileError: the log, exit 1
        checked += 1
    if not checked:
        raise BackendError(
            "no kernel compiler found: pip install 'rocforge-rt[cuda]' (NVRTC) or"
            " 'rocforge-rt[hip]' (hiprtc, with the HIP libraries under $ROCM_PATH)"
        )
    return 0


def _visible_target() -> str:
    """The arch of the GPU this machine shows (as `--backend auto` picks it)."""
    from rocforge_rt.backends import resolve_backend_name

    backend = resolve_backend_name("auto")
    if backend == "cpu":
        raise CommandError(
            "no GPU found to build for: name the targets, e.g. --target sm_90 (choose among"
            f" {', '.join(WHEEL_TARGETS)} or any sm_NN / gfxNNNN the compiler takes)"
        )
    if backend == "cuda":
        from rocforge_rt.backends.gpu.cuda import CudaDriver as DeviceDriver
    else:
        from rocforge_rt.backends.gpu.hip import HipDriver as DeviceDriver
    driver = DeviceDriver()
    try:
        return driver.info.arch
    finally:
        driver.close()


def _cmd_kernels_build(args: argparse.Namespace) -> int:
    """Compile what the cache lacks for each target; with --out, write the objects there."""
    for target in args.target or [_visible_target()]:
        library = _library(target, named=True)
        print(_build(target, library, args.jobs))
        if args.out is not None:
            written = library.export_prebuilt(args.out)
            print(f"{target}: {written / 2**20:.1f} MiB of code objects in {args.out}")
    return 0


def add_kernels_command(sub: Any) -> None:
    """Register `kernels` on the `rocforge` subparsers."""
    kernels = sub.add_parser(
        "kernels", help="the GPU kernels: check that they compile, or build them ahead of time"
    )
    kernels_sub = kernels.add_subparsers(
        dest="kernels_command", required=True, title="commands", metavar="COMMAND"
    )
    check = kernels_sub.add_parser(
        "check",
        help="compile every kernel source for each target whose compiler (NVRTC, hiprtc) is"
        " installed; no GPU needed",
    )
    check.add_argument(
        "--target",
        action="append",
        metavar="ARCH",
        help="a target that must compile, e.g. sm_90, gfx90a (repeatable) (default: each of"
        f" {', '.join(KERNEL_TARGETS)} that has a compiler)",
    )
    check.set_defaults(func=_cmd_kernels_check)
    build = kernels_sub.add_parser(
        "build",
        help="compile the kernels ahead of time into the kernel cache (a container image's or"
        " a deployment's step), in parallel; no GPU needed with --target",
    )
    build.add_argument(
        "--target",
        action="append",
        metavar="ARCH",
        help="a target to build for, e.g. sm_90, gfx90a (repeatable) (default: the GPU this"
        f" machine shows; a wheel's: {', '.join(WHEEL_TARGETS)})",
    )
    build.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="also write every target's code objects into DIR, named as a wheel holds them"
        " (setup.py, ROCFORGE_PREBUILT_TARGETS) (default: the cache only)",
    )
    build.set_defaults(func=_cmd_kernels_build)
    for command in (check, build):
        command.add_argument(
            "--jobs", type=int, metavar="N", help="compiles at once (default: one a CPU)"
        )
        add_location_options(command, models=False)

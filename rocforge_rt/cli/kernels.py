"""`rocforge kernels check`: compile every kernel source for each target whose compiler is
installed (no GPU needed)."""

import argparse
import time
from typing import Any

from rocforge_rt.backends import KERNEL_TARGETS
from rocforge_rt.cli.options import CommandError, add_location_options
from rocforge_rt.errors import BackendError


def _cmd_kernels_check(args: argparse.Namespace) -> int:
    """Compile every kernel source for each target whose compiler is installed."""
    from rocforge_rt.backends import kernel_compiler
    from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir

    print(f"kernel sources: {kernels_dir()}")
    checked = 0
    for target in args.target or KERNEL_TARGETS:
        try:
            compiler = kernel_compiler(target)
        except ValueError as exc:
            raise CommandError(f"--target {target}: {exc}") from None
        except BackendError as exc:
            if args.target:  # asked for by name: it must compile
                raise
            print(f"{target}: skipped, no compiler: {exc}")
            continue
        library = KernelLibrary(compiler)
        started = time.perf_counter()
        objects = library.load_all()  # KernelCompileError: the compiler's log, exit 1
        kernels = sum(len(code.kernels) for code in objects.values())
        print(
            f"{target}: {len(objects)} sources, {kernels} kernels ({library.compiles} compiled,"
            f" {library.cache_hits} cached) in {time.perf_counter() - started:.1f} s"
            f" [{compiler.version}]"
        )
        checked += 1
    if not checked:
        raise BackendError(
            "no kernel compiler found: pip install 'rocforge-rt[cuda]' (NVRTC) or"
            " 'rocforge-rt[hip]' (hiprtc, with the HIP libraries under $ROCM_PATH)"
        )
    return 0


def add_kernels_command(sub: Any) -> None:
    """Register `kernels` on the `rocforge` subparsers."""
    kernels = sub.add_parser("kernels", help="the GPU kernels: check that they compile")
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
    add_location_options(check, models=False)
    check.set_defaults(func=_cmd_kernels_check)

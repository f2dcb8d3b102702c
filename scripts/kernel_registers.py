#!/usr/bin/env python3
"""Registers, stack and spills of each kernel, as ptxas reports them (NVRTC; no GPU needed).

Occupancy follows from registers: a block of 256 threads at 128 registers a thread takes
half a multiprocessor's register file, so two such blocks fill it and a successor's blocks
(programmatic dependent launch) cannot start beside them. Changes to a kernel that add
live values show here before any run:

    python3 scripts/kernel_registers.py gemv.hip attention.hip --match 'gemv_q4_0_b1'
    python3 scripts/kernel_registers.py gemv.hip --kernels-dir /tmp/other-kernels --json

Sources are file names in the kernel folder (`--kernels-dir`, else the checkout's), compiled
with the runtime's defines for `--arch` (default sm_90).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rocforge_rt.backends.gpu.cuda import NvrtcCompiler
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernel_source

PTXAS_VERBOSE = "--ptxas-options=-v"
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class KernelResources:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Each entry function's resources from a `ptxas -v` log, in the log's order."""
    found: dict[str, KernelResources] = {}
    name, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if entry := _ENTRY.search(line):
            name, frame = entry[1], (0, 0, 0)
        elif (match := _FRAME.search(line)) and name:
            frame = (int(match[1]), int(match[2]), int(match[3]))
        elif (match := _REGISTERS.search(line)) and name:
            found[name] = KernelResources(int(match[1]), *frame)
            name = None
    return found


def source_resources(library: KernelLibrary, source: str) -> dict[str, KernelResources]:
    """The resources of every kernel of one source of `library` (an NVRTC library)."""
    compiler = library.compiler
    if not isinstance(compiler, NvrtcCompiler):
        raise TypeError("register counts come from ptxas: an NVRTC compiler is needed")
    text = kernel_source(library.source_dir, source)  # with its generated kernels
    compiler.compile(
        text, source, library.headers(), library.defines(), extra_options=(PTXAS_VERBOSE,)
    )
    return parse_ptxas_log(compiler.last_log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("sources", nargs="+", help="kernel sources, e.g. gemv.hip")
    parser.add_argument("--kernels-dir", type=Path, default=None)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--match", default="", help="only kernels whose name this regex finds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    library = KernelLibrary(NvrtcCompiler(args.arch), source_dir=args.kernels_dir)
    rows = {
        name: resources
        for source in args.sources
        for name, resources in source_resources(library, source).items()
        if re.search(args.match, name)
    }
    if args.json:
        print(json.dumps({name: asdict(r) for name, r in rows.items()}, indent=1))
        return 0
    print(f"{'kernel':44s} {'registers':>9s} {'stack B':>8s} {'spill st/ld B':>14s}")
    for name, r in rows.items():
        spills = f"{r.spill_store_bytes}/{r.spill_load_bytes}"
        print(f"{name:44s} {r.registers:9d} {r.stack_bytes:8d} {spills:>14s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel launches through one cached `LaunchHandle` per call site (the hot path).

The launcher loads every kernel of the library onto the device and keeps each
kernel's argument types as its C declaration gives them (`CodeObject.signatures`).
The op families (matmul.py, attention.py, embedding.py, rope.py, sampling.py) call
`launch` for every kernel they run; the step executor (executor.py) sets what
applies to the step being issued: overlap, the kernel timer, capture recording and
the per-kernel synchronization of that mode.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary
from rocforge_rt.backends.gpu.launch import ArgCacheStats, LaunchHandle
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker


class Launcher:
    """The loaded kernels, their signatures, and the launch handles of every call site."""

    def __init__(
        self, driver: Driver, stream: Any, library: KernelLibrary, tracker: LaunchOverheadTracker
    ) -> None:
        self.driver = driver
        self.stream = stream
        self.tracker = tracker
        self.functions: dict[str, Any] = {}
        self.signatures: dict[str, tuple[str, ...]] = {}
        for source in library.sources():
            code = library.load(source)
            module = driver.load_module(code.code)
            for name in code.kernels:
                self.functions[name] = module.function(name)
            self.signatures.update(code.signatures)
        self.handles: dict[tuple, LaunchHandle] = {}
        self.kernel_stats: dict[str, ArgCacheStats] = {}  # argument-cache counters by kernel
        # Set by the step executor for the step being issued:
        self.overlap_step = False  # launches overlap their predecessors (decode steps only)
        self.timer: KernelTimer | None = None  # the kernel timer while a timed step is issued
        self.recording: list[LaunchHandle] | None = None  # handles launched, see `record`
        self.sync_each = False  # per-kernel-sync mode: synchronize after every launch

    def new_handle(
        self,
        kernel: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int = 0,
        *,
        overlap: bool = False,
        cluster: int = 1,
    ) -> LaunchHandle:
        """A launch handle of `kernel` on the stream, typed by the kernel's declaration."""
        return LaunchHandle(
            self.driver,
            self.functions[kernel],
            name=kernel,
            grid=grid,
            block=block,
            shared_bytes=shared_bytes,
            stream=self.stream,
            arg_types=self.signatures[kernel],
            tracker=self.tracker,
            overlap=overlap,
            cluster=cluster,
            kernel_stats=self.kernel_stats.setdefault(kernel, ArgCacheStats()),
        )

    def launch(
        self,
        key: tuple,
        kernel: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[int | float],
        shared_bytes: int = 0,
        cluster: int = 1,
    ) -> None:
        """Launch through the handle that owns this call site; its args repack only on change.

        A handle's geometry (`cluster`: blocks a thread block cluster) is fixed, so it is
        part of the key: a call site whose grid or shared memory changes gets another
        handle, never a stale launch shape.
        """
        overlap = self.overlap_step
        key = (*key, kernel, grid, block, shared_bytes, overlap, cluster)
        handle = self.handles.get(key)
        if handle is None:
            handle = self.new_handle(
                kernel, grid, block, shared_bytes, overlap=overlap, cluster=cluster
            )
            self.handles[key] = handle
        handle.set_args(*args)
        self._issue(kernel, handle.launch)
        if self.recording is not None:
            self.recording.append(handle)

    def record(self, issue: Callable[[], None]) -> list[LaunchHandle]:
        """Run `issue`, returning every handle it launched, in order (a capture's, or which
        kernels a call chose)."""
        self.recording = []
        try:
            issue()
            return self.recording
        finally:
            self.recording = None

    def call_library(self, name: str, call: Callable[[], None]) -> None:
        """Run a library routine that queues work on the stream (the vendor GEMM), timed and
        tracked as a kernel named `name`. Under capture its kernels join the graph; they
        take no launch handle, so only launch handles' changes make a graph stale."""
        self._issue(name, lambda: self._tracked(name, call))

    def _tracked(self, name: str, call: Callable[[], None]) -> None:
        """`call`, its host time told to the launch tracker (a launch handle tells its own)."""
        start = time.perf_counter_ns()
        call()
        if self.tracker.enabled:
            self.tracker.launched(name, start, time.perf_counter_ns())

    def _issue(self, name: str, launch: Callable[[], None]) -> None:
        """Queue `launch` as the step's next kernel `name`: between the kernel timer's events
        in a timed step, synchronized after in per-kernel-sync mode."""
        timer = self.timer
        if timer is None:
            launch()
        else:
            timer.before(name)
            launch()
            timer.after()
        if self.sync_each:
            self.stream.synchronize()

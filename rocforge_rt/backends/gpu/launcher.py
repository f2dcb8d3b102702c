"""Kernel launches through one cached `LaunchHandle` per call site (the hot path).

The launcher loads every kernel of the library onto the device and keeps each
kernel's argument types as its C declaration gives them (`CodeObject.signatures`).
The op families (matmul.py, attention.py, embedding.py, rope.py, sampling.py) call
`launch` for every kernel they run. What applies to the step being issued (overlap,
the kernel timer, the per-kernel synchronization of a mode) is an `IssueSettings`
that the step's issuer holds for the length of its issue (`issuing`); `record`
collects the handles a capture launches.
"""

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary
from rocforge_rt.backends.gpu.launch import ArgCacheStats, LaunchHandle
from rocforge_rt.errors import BackendError
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker


@dataclass(frozen=True)
class IssueSettings:
    """How the launches of the step being issued are made."""

    overlap: bool = False  # each launch may overlap its predecessor's tail (decode steps)
    timer: KernelTimer | None = None  # times each launch (a step the kernel timer samples)
    sync_each: bool = False  # synchronize after every launch (per-kernel-sync mode)


BETWEEN_STEPS = IssueSettings()  # launches made outside a step's issue


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
            try:
                module = driver.load_module(code.code)
            except BackendError:
                if code.origin != "prebuilt":
                    raise
                # The wheel's object for this arch, refused by this driver (built by a newer
                # toolkit than it takes): compile it here.
                code = library.compile(source)
                module = driver.load_module(code.code)
            for name in code.kernels:
                self.functions[name] = module.function(name)
            self.signatures.update(code.signatures)
        self.handles: dict[tuple, LaunchHandle] = {}
        self.kernel_stats: dict[str, ArgCacheStats] = {}  # argument-cache counters by kernel
        self.settings = BETWEEN_STEPS  # the step being issued's (`issuing`)
        self.recording: list[LaunchHandle] | None = None  # handles launched, see `record`

    @contextmanager
    def issuing(self, settings: IssueSettings) -> Iterator[None]:
        """Make the launches inside the block with `settings`; the previous ones after it."""
        before, self.settings = self.settings, settings
        try:
            yield
        finally:
            self.settings = before

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
        overlap = self.settings.overlap
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
        settings = self.settings
        timer = settings.timer
        if timer is None:
            launch()
        else:
            timer.before(name)
            launch()
            timer.after()
        if settings.sync_each:
            self.stream.synchronize()

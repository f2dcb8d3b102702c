"""`StepGraph`: one step's launches captured once into a graph, replayed as one launch.

`StepGraph.capture(record)` runs `record()` under stream capture; `record`
issues the step's launches through `LaunchHandle`s on the graph's stream and
returns every handle it launched (one entry per launch). A graph holds copies
of the arguments it captured, so before each `replay()` the graph checks that
no captured handle was repacked since (its `version`); if one was, it re-runs
`record()` under capture (counted in `recaptures`) and replays the new graph.
It never replays stale arguments.

Step-state rule: values that change every step live in a device buffer that
the kernels read through a pointer (captured once). The caller updates that
buffer with an asynchronous copy from pinned memory on the graph's stream
*before* `replay()`: stream order makes the replay see the new values. One
step-state buffer per stream; the pinned source must not be rewritten until
that copy has executed (the step's final synchronization guarantees it).

Executor contract: like the driver, a StepGraph is used from the engine's one
executor thread; any other thread gets a `BackendError` from the driver check.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.launch import ARG_CACHE_STATS, LaunchHandle
from rocforge_rt.errors import BackendError

MIN_GRAPH_LAUNCHES = 24  # launches a micro-benchmark's graph holds at least


class StepGraph:
    """One captured step on one stream, re-captured whenever a captured handle was repacked."""

    def __init__(self, driver: Driver, stream: Any) -> None:
        self.driver = driver
        self.stream = stream
        self.captures = 0
        self.recaptures = 0
        self.replays = 0
        self.kernels = 0  # launches the graph holds (its last capture's)
        self.last_recapture_reason: str | None = None
        self._record: Callable[[], Sequence[LaunchHandle]] | None = None
        self._handle_versions: list[tuple[LaunchHandle, int]] = []
        self._epoch = -1
        self._exec: Any = None

    def capture(self, record: Callable[[], Sequence[LaunchHandle]]) -> None:
        """Capture `record()`, which returns the handle of every launch it made."""
        self.driver.check_thread()
        self._record = record
        self._capture()

    def replay(self) -> None:
        """Launch the step graph on its stream, re-capturing first if it went stale."""
        self.driver.check_thread()
        if self._exec is None:
            raise BackendError("StepGraph.replay() before capture()")
        reason = self.stale_reason()
        if reason is not None:
            self._capture()
            self.recaptures += 1
            self.last_recapture_reason = reason
        self._exec.launch(self.stream)
        self.replays += 1

    def stale_reason(self) -> str | None:
        """Why the graph no longer matches its handles' arguments; None when it does."""
        epoch = ARG_CACHE_STATS.epoch
        if epoch != self._epoch:  # some handle somewhere repacked: look at ours
            for handle, version in self._handle_versions:
                if handle.version != version:
                    return f"launch handle {handle.name!r} repacked since capture"
            self._epoch = epoch
        return None

    def destroy(self) -> None:
        """Release the executable graph (a later `replay` needs a new `capture`)."""
        if self._exec is not None:
            self._exec.destroy()
            self._exec = None

    def _capture(self) -> None:
        assert self._record is not None
        self.destroy()
        driver, stream = self.driver, self.stream
        launches_before = driver.counters.launches
        driver.begin_capture(stream)
        try:
            handles = list(self._record())
        except BaseException:
            self._abandon_capture()
            raise
        graph = driver.end_capture(stream)
        try:
            self._check_recorded(handles, driver.counters.launches - launches_before)
            self._exec = graph.instantiate()
        finally:
            graph.destroy()  # the executable graph does not need it
        self._handle_versions = [(h, h.version) for h in dict.fromkeys(handles)]
        self._epoch = ARG_CACHE_STATS.epoch
        self.kernels = len(handles)
        self.captures += 1

    def _check_recorded(self, handles: list[LaunchHandle], launched: int) -> None:
        foreign = sorted({h.name for h in handles if h.stream is not self.stream})
        if foreign:
            raise BackendError(
                f"handles {foreign} belong to another stream than the captured one; "
                "their launches are not in the graph"
            )
        if launched != len(handles):
            raise BackendError(
                f"record() launched {launched} kernels but returned {len(handles)} handles: "
                "it must return the handle of every launch, or changes could go unseen"
            )

    def _abandon_capture(self) -> None:
        """End a capture whose recording failed, dropping whatever it captured."""
        with contextlib.suppress(BackendError):  # an invalidated capture ends without a graph
            self.driver.end_capture(self.stream).destroy()


def replay_us_per_launch(
    driver: Driver, stream: Any, issue: Callable[[int], None], copies: int, reps: int
) -> float:
    """A micro-benchmark's timing: `issue(i % copies)` for at least MIN_GRAPH_LAUNCHES
    launches, a whole number of rounds over the `copies` (buffers a launch reads, so that
    enough of them leave L2 behind), captured into one graph on `stream`, replayed 3 times,
    then `reps` times between events; the median µs a launch."""
    launches = copies * max(1, math.ceil(MIN_GRAPH_LAUNCHES / copies))
    driver.begin_capture(stream)
    try:
        for i in range(launches):
            issue(i % copies)
    finally:
        graph = driver.end_capture(stream)
    exe = driver.graph_instantiate(graph)
    start, end = driver.create_event(), driver.create_event()
    try:
        for _ in range(3):
            driver.graph_launch(exe, stream)
        times = []
        for _ in range(reps):
            driver.event_record(start, stream)
            driver.graph_launch(exe, stream)
            driver.event_record(end, stream)
            driver.event_synchronize(end)
            times.append(driver.event_elapsed_ms(start, end) * 1000 / launches)
    finally:
        for record in (start, end, exe, graph):
            driver.release(record)
    return statistics.median(times)

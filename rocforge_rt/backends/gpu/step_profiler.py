"""What profiling wraps around the issue of one step: the launch tracker's bracket and the
kernel timer's sample.

A step the kernel timer samples is issued eagerly behind a closed gate (kernels/gate.hip,
except in per-kernel-sync mode, which synchronizes after every launch anyway), and the
gate is opened once all of it is queued, so its kernels run back to back and their events
time them. The step executor (executor.py) asks `begin` for a step's `StepProbe`, issues
the step inside `issuing`, replays a graph through `replay`, and calls `end` once the
step's readback has synchronized.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from rocforge_rt.backends.gpu.driver import Driver, PinnedBuffer
from rocforge_rt.backends.gpu.graph import StepGraph
from rocforge_rt.backends.gpu.launcher import IssueSettings, Launcher
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker

GATE_MAX_NAPS = 250_000  # rf_hold gives up after ~0.5 s of polling (a gate never opened)


@dataclass
class StepProbe:
    """One step's profiling: whether the kernel timer samples it and the tracker brackets it."""

    index: int  # the step's number (the kernel timer samples every n-th)
    start_ns: int  # when its issue began
    timed: bool  # the kernel timer samples it: issued eagerly, each kernel timed
    tracked: bool  # the launch tracker brackets it
    syncs_before: int  # the driver's synchronizations before it
    replay_timed: bool = False  # the kernel timer timed its graph replay as a whole


class StepProfiler:
    """The launch tracker, the kernel timer and the gate, around each step's issue."""

    def __init__(
        self,
        driver: Driver,
        launcher: Launcher,
        gate: PinnedBuffer,
        kernel_timer: KernelTimer,
        launch_tracker: LaunchOverheadTracker,
    ) -> None:
        self.driver = driver
        self.launcher = launcher
        self.gate = gate
        self.kernel_timer = kernel_timer
        self.launch_tracker = launch_tracker

    def begin(self, step_index: int) -> StepProbe:
        """Start step `step_index`'s profiling: the tracker's bracket, the timer's sample."""
        start = time.perf_counter_ns()
        tracked = self.launch_tracker.enabled
        if tracked:
            self.launch_tracker.begin_step(start)
        timed = self.kernel_timer.start_step(step_index, start)
        return StepProbe(step_index, start, timed, tracked, self.driver.counters.syncs)

    @contextmanager
    def issuing(self, probe: StepProbe, *, overlap: bool, sync_each: bool) -> Iterator[None]:
        """Issue the step inside the block with these settings; a timed step behind the gate
        and with its launches timed."""
        gated = probe.timed and not sync_each
        if gated:
            with self.launcher.issuing(IssueSettings(overlap=overlap)):
                self._close_gate()
        timer = self.kernel_timer if probe.timed else None
        try:
            with self.launcher.issuing(IssueSettings(overlap, timer, sync_each)):
                yield
        finally:
            if gated:
                self.gate.view(np.uint32, 1)[0] = 1  # open: the queued step runs
                self.kernel_timer.released(time.perf_counter_ns())

    def replay(self, probe: StepProbe, graph: StepGraph) -> None:
        """Replay a step's graph, told to the tracker and timed as a whole when sampled."""
        probe.replay_timed = self.kernel_timer.begin_replay(probe.index)
        start = time.perf_counter_ns()
        graph.replay()
        if probe.tracked:
            self.launch_tracker.launched("graph_replay", start, time.perf_counter_ns())
        if probe.replay_timed:
            self.kernel_timer.end_replay()

    def end(self, probe: StepProbe) -> None:
        """Close the step's profiling, once its readback has synchronized."""
        if probe.timed:
            self.kernel_timer.finish_step()
        if probe.replay_timed:
            self.kernel_timer.finish_replay()
        if probe.tracked:
            syncs = self.driver.counters.syncs - probe.syncs_before
            self.launch_tracker.end_step(time.perf_counter_ns(), syncs)

    def _close_gate(self) -> None:
        """Queue a kernel that holds the stream until the gate flag is set (kernels/gate.hip)."""
        gate = self.gate
        gate.view(np.uint32, 1)[0] = 0
        self.launcher.launch(
            ("gate",), "rf_hold", (1, 1, 1), (1, 1, 1), (gate.device_ptr, 1, GATE_MAX_NAPS)
        )

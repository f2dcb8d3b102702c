"""GPU time of each kernel from device events, on sampled steps (opt-in).

A `KernelTimer` belongs to one GPU backend and its stream. While enabled, one
step in every `every` is a timed step: the backend issues it eagerly (in graph
mode it skips that step's replay: the kernels and their argument bytes are the
same ones the graph holds) and brackets every launch with two events. After
the step's final synchronization, `finish_step` reads the event times and keeps
a `TimedStep`: each kernel's start (from the step's first event) and duration,
the GPU-busy time (the sum of the durations: one stream runs one kernel at a
time) and the gaps between kernels (the span minus the busy time).

The backend queues a timed step behind a closed gate and opens it once the whole
step is queued (except in per-kernel-sync mode, where every kernel starts on an
idle device and its time includes the launch latency), so the kernels run back
to back: durations are the kernels' own, and the gaps are the device's own
between-kernel cost, as in a graph replay, not the host's launch pace. In graph
mode the step after each timed step is a replay timed as a whole
(`begin_replay`/`end_replay`): the device time of the graph itself.
Event timestamps have a resolution of about half a microsecond.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from rocforge_rt.profiling.recent import Recent


@dataclass(frozen=True)
class KernelSpan:
    """One kernel of a timed step, in microseconds from the step's first event."""

    name: str
    start_us: float
    duration_us: float


@dataclass(frozen=True)
class TimedStep:
    """The kernels of one timed step, and where the host clock stood when it began."""

    step: int  # the backend's step counter
    host_start_ns: int  # perf_counter_ns() when the step's work was released to the device
    kernels: tuple[KernelSpan, ...]

    @property
    def span_us(self) -> float:
        """From the first kernel's start to the last one's end."""
        if not self.kernels:
            return 0.0
        return max(k.start_us + k.duration_us for k in self.kernels) - self.kernels[0].start_us

    @property
    def busy_us(self) -> float:
        return sum(k.duration_us for k in self.kernels)

    @property
    def gaps_us(self) -> float:
        return max(0.0, self.span_us - self.busy_us)


@dataclass
class _KernelTotals:
    calls: int = 0
    total_us: float = 0.0
    min_us: float = float("inf")
    max_us: float = 0.0


class KernelTimer:
    """Times the kernels of every `every`-th step with events; off until `enabled` is set."""

    def __init__(self, driver: Any, stream: Any, *, every: int = 16, keep_steps: int = 64) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.enabled = False
        self.every = every
        self._driver = driver
        self._stream = stream
        self._events: list[Any] = []  # a pool, reused step after step
        self._names: list[str] = []  # the kernel of each event pair of the current step
        self._host_start_ns = 0
        self._step = -1
        self._lock = threading.Lock()  # guards the totals that snapshot() reads
        self._recent: Recent[TimedStep] = Recent(keep_steps)
        self._totals: dict[str, _KernelTotals] = {}
        self._steps = 0
        self._busy_us = 0.0
        self._span_us = 0.0
        self._replays = 0
        self._replay_us = 0.0
        self._replay_events: tuple[Any, Any] | None = None

    def start_step(self, step: int, host_start_ns: int) -> bool:
        """Whether step number `step` is to be timed; if so, its launches are bracketed."""
        if not self.enabled or step % self.every:
            return False
        self._names.clear()
        self._step = step
        self._host_start_ns = host_start_ns
        return True

    def released(self, host_ns: int) -> None:
        """The timed step's queued work was released to the device at host time `host_ns`."""
        self._host_start_ns = host_ns

    def before(self, name: str) -> None:
        """Record the event that precedes kernel `name` on the stream."""
        index = 2 * len(self._names)
        self._names.append(name)
        self._event(index).record(self._stream)

    def after(self) -> None:
        """Record the event that follows the kernel named by the last `before`."""
        self._event(2 * len(self._names) - 1).record(self._stream)

    def finish_step(self) -> TimedStep:
        """Read the current step's events (its work must have completed) and keep the step."""
        events, names = self._events, self._names
        kernels = []
        if names:
            first = events[0]
            for i, name in enumerate(names):
                begin, end = events[2 * i], events[2 * i + 1]
                start_us = first.elapsed_ms(begin) * 1e3
                kernels.append(KernelSpan(name, start_us, begin.elapsed_ms(end) * 1e3))
        step = TimedStep(self._step, self._host_start_ns, tuple(kernels))
        names.clear()
        self._recent.append(step)
        with self._lock:
            self._steps += 1
            self._busy_us += step.busy_us
            self._span_us += step.span_us
            for kernel in step.kernels:
                totals = self._totals.setdefault(kernel.name, _KernelTotals())
                totals.calls += 1
                totals.total_us += kernel.duration_us
                totals.min_us = min(totals.min_us, kernel.duration_us)
                totals.max_us = max(totals.max_us, kernel.duration_us)
        return step

    def begin_replay(self, step: int) -> bool:
        """Record the event before a graph replay, on the step after each timed step."""
        if not self.enabled or self.every == 1 or step % self.every != 1:
            return False
        if self._replay_events is None:
            self._replay_events = (
                self._driver.create_event(timing=True),
                self._driver.create_event(timing=True),
            )
        self._replay_events[0].record(self._stream)
        return True

    def end_replay(self) -> None:
        """Record the event after the replay that `begin_replay` opened."""
        assert self._replay_events is not None
        self._replay_events[1].record(self._stream)

    def finish_replay(self) -> None:
        """Read the replay's device time (its work must have completed)."""
        assert self._replay_events is not None
        start, end = self._replay_events
        with self._lock:
            self._replays += 1
            self._replay_us += start.elapsed_ms(end) * 1e3

    def recent(self, n: int | None = None) -> list[TimedStep]:
        """The last n timed steps (all kept when None), oldest first."""
        return self._recent.last(n)

    def reset(self) -> None:
        self._recent.clear()
        with self._lock:
            self._totals.clear()
            self._steps = self._replays = 0
            self._busy_us = self._span_us = self._replay_us = 0.0

    def snapshot(self) -> dict[str, Any]:
        """Per kernel name: calls per timed step and GPU microseconds; per step: busy and gaps."""
        with self._lock:
            steps = self._steps
            totals = {k: _KernelTotals(v.calls, v.total_us, v.min_us, v.max_us)
                      for k, v in self._totals.items()}  # fmt: skip
            busy, span = self._busy_us, self._span_us
            replays, replay_us = self._replays, self._replay_us
        per_step = max(steps, 1)
        kernels = {
            name: {
                "calls_per_step": t.calls / per_step,
                "gpu_us_mean": t.total_us / t.calls,
                "gpu_us_min": t.min_us,
                "gpu_us_max": t.max_us,
                "gpu_us_per_step": t.total_us / per_step,
                "busy_share": t.total_us / busy if busy else 0.0,
            }
            for name, t in sorted(totals.items(), key=lambda kv: -kv[1].total_us)
        }
        return {
            "timed_steps": steps,
            "every": self.every,
            "gpu_busy_us_per_step": busy / per_step,
            "gpu_gaps_us_per_step": max(0.0, span - busy) / per_step,
            "gpu_busy_share": busy / span if span else 0.0,
            "timed_replays": replays,
            "graph_replay_us_mean": replay_us / replays if replays else 0.0,
            "kernels": kernels,
        }

    def _event(self, index: int) -> Any:
        while len(self._events) <= index:
            self._events.append(self._driver.create_event(timing=True))
        return self._events[index]

"""CPU launch overhead per kernel name: count, min / max / mean / std, share of the step.

The GPU backend hands every launch's host start and end (``perf_counter_ns``
around the driver call) to the tracker while it is enabled, and frames each
step with `begin_step` / `end_step`, giving the step's wall time (issue to the
final synchronization's return) and its synchronizations. A graph replay is
one launch, named ``graph_replay``. Statistics are folded in once per step, so
the per-launch cost is one list append; `snapshot` flags kernels whose mean
launch time or spread is high.

Thread use: the engine (executor) thread records; `snapshot`, `recent` and
`reset` may be called from any thread.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

from rocforge_rt.profiling.recent import Recent

# Flags in `snapshot`, set about twice a driver-API launch's usual host cost from Python
# (docs/performance.md, "Reference costs"):
HIGH_OVERHEAD_US = 10.0  # a kernel whose mean launch time is over this is flagged high_overhead
HIGH_VARIANCE_CV = 1.0  # std / mean over this (with 10+ launches) is flagged high_variance
MIN_LAUNCHES_FOR_VARIANCE = 10


@dataclass(frozen=True)
class LaunchStep:
    """One step's launches: (kernel name, start ns, end ns), host clock."""

    step: int
    start_ns: int
    end_ns: int
    syncs: int
    launches: tuple[tuple[str, int, int], ...]


@dataclass
class _Totals:
    count: int = 0
    total_ns: int = 0
    squares: float = 0.0  # sum of squared durations (ns^2), for the standard deviation
    min_ns: int = 0
    max_ns: int = 0

    def add(self, duration: int) -> None:
        if self.count == 0 or duration < self.min_ns:
            self.min_ns = duration
        self.max_ns = max(self.max_ns, duration)
        self.count += 1
        self.total_ns += duration
        self.squares += float(duration) * duration


class LaunchOverheadTracker:
    """Host time of each kernel launch, grouped by kernel name and by step; off by default."""

    def __init__(self, *, keep_steps: int = 64) -> None:
        self.enabled = False
        self._current: list[tuple[str, int, int]] = []
        self._step_start = 0
        self._step_index = 0
        self._lock = threading.Lock()  # guards the totals that snapshot() reads
        self._recent: Recent[LaunchStep] = Recent(keep_steps)
        self._totals: dict[str, _Totals] = {}
        self._steps = 0
        self._wall_ns = 0
        self._syncs = 0

    def begin_step(self, start_ns: int) -> None:
        self._current = []
        self._step_start = start_ns

    def launched(self, name: str, start_ns: int, end_ns: int) -> None:
        """One launch of kernel `name` took the host from start_ns to end_ns (hot path)."""
        self._current.append((name, start_ns, end_ns))

    def end_step(self, end_ns: int, syncs: int) -> None:
        """Close the step that `begin_step` opened; `syncs` host-blocking waits happened in it."""
        launches = tuple(self._current)
        self._current = []
        step = LaunchStep(self._step_index, self._step_start, end_ns, syncs, launches)
        self._step_index += 1
        self._recent.append(step)
        with self._lock:
            self._steps += 1
            self._wall_ns += end_ns - self._step_start
            self._syncs += syncs
            for name, start, end in launches:
                totals = self._totals.get(name)
                if totals is None:
                    totals = self._totals[name] = _Totals()
                totals.add(end - start)

    def recent(self, n: int | None = None) -> list[LaunchStep]:
        """The last n steps (all kept when None), oldest first."""
        return self._recent.last(n)

    def reset(self) -> None:
        self._recent.clear()
        with self._lock:
            self._totals.clear()
            self._steps = self._wall_ns = self._syncs = 0

    def snapshot(self) -> dict[str, Any]:
        """Per kernel: launches, host us min/max/mean/std, total, share of step wall time, flags."""
        with self._lock:
            steps, wall_ns, syncs = self._steps, self._wall_ns, self._syncs
            totals = {name: _Totals(t.count, t.total_ns, t.squares, t.min_ns, t.max_ns)
                      for name, t in self._totals.items()}  # fmt: skip
        per_step = max(steps, 1)
        kernels = {}
        launch_ns = 0
        for name, t in sorted(totals.items(), key=lambda kv: -kv[1].total_ns):
            launch_ns += t.total_ns
            mean = t.total_ns / t.count
            std = math.sqrt(max(0.0, t.squares / t.count - mean * mean))
            flags = []
            if mean / 1e3 > HIGH_OVERHEAD_US:
                flags.append("high_overhead")
            if t.count >= MIN_LAUNCHES_FOR_VARIANCE and std > HIGH_VARIANCE_CV * mean:
                flags.append("high_variance")
            kernels[name] = {
                "launches": t.count,
                "launches_per_step": t.count / per_step,
                "host_us_min": t.min_ns / 1e3,
                "host_us_max": t.max_ns / 1e3,
                "host_us_mean": mean / 1e3,
                "host_us_std": std / 1e3,
                "host_ms_total": t.total_ns / 1e6,
                "share_of_step": t.total_ns / wall_ns if wall_ns else 0.0,
                "flags": flags,
            }
        return {
            "steps": steps,
            "step_wall_us_mean": wall_ns / per_step / 1e3,
            "launch_us_per_step": launch_ns / per_step / 1e3,
            "launch_share_of_step": launch_ns / wall_ns if wall_ns else 0.0,
            "launches_per_step": sum(t.count for t in totals.values()) / per_step,
            "syncs_per_step": syncs / per_step,
            "kernels": kernels,
        }

"""Host time of each forward op, by name: the launch-overhead table.

`OpTimer.bracket` is wrapped around every op that `forward()` calls (through
`step.forward.BracketedOps` in place of `engine.ops`): each call is timed on the host
with `perf_counter_ns`. Calls are grouped into steps
(one prefill chunk, or one batched decode step) by the engine thread, which
owns the timer; `snapshot` and `reset` may be called from any thread.

On the CPU backend an op's host time is its numpy compute; on a GPU backend it
is the launch cost (in graph mode ops run only while a step graph is captured:
replayed steps make no op calls). A step's time covers all the engine thread's
work in it, sampling and replies included. `loop` adds the whole scheduler
iteration around a step (taking requests, sending replies, publishing usage) and
the time inside Engine.step: their difference is the host time a daemon adds to
each step beyond the engine's. GPU backends report what the host
cannot see (arg-cache hits, syncs, graph replay, per-kernel launch and GPU
times) through `backend.runtime_stats()`; `recommendations.py` reads both.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rocforge_rt.profiling.recent import Recent

RECENT_DURATIONS = 10_000  # step durations kept for the median


@dataclass(frozen=True)
class StepRecord:
    """One step and the op calls it made: (name, start ns, duration ns)."""

    kind: str  # "prefill" (one chunk of one sequence) or "decode" (one token per sequence)
    start_ns: int
    end_ns: int
    n_tokens: int
    n_seqs: int
    ops: tuple[tuple[str, int, int], ...]


@dataclass
class _OpTotals:
    calls: int = 0
    total_ns: int = 0
    max_ns: int = 0


@dataclass
class _StepTotals:
    steps: int = 0
    total_ns: int = 0
    op_ns: int = 0
    op_calls: int = 0
    tokens: int = 0
    seqs: int = 0
    loops: int = 0
    loop_ns: int = 0  # scheduler iterations that ran these steps, whole
    loop_engine_ns: int = 0  # of which inside Engine.step
    loop_step_ns: int = 0  # of which inside their steps (the `step` blocks)
    durations_ns: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_DURATIONS))


class OpTimer:
    """The host time of every forward op call, by name, grouped into steps."""

    def __init__(self, *, keep_steps: int = 64) -> None:
        self._lock = threading.Lock()
        self._ops_totals: dict[str, _OpTotals] = {}
        self._step_totals: dict[str, _StepTotals] = {}
        self._recent: Recent[StepRecord] = Recent(keep_steps)
        self._current: list[tuple[str, int, int]] | None = None
        self._last_step_ns = 0  # the last step's duration (the engine thread's, as `loop`'s)

    def bracket(self, name: str, call: Callable[[], Any]) -> Any:
        """Make op `name`'s `call`, timing it (the bracket of `step.forward.BracketedOps`)."""
        start = time.perf_counter_ns()
        try:
            return call()
        finally:
            timed = (name, start, time.perf_counter_ns() - start)
            if self._current is not None:
                self._current.append(timed)
            else:
                with self._lock:
                    self._add_op(*timed)

    @contextmanager
    def step(self, kind: str, *, n_tokens: int, n_seqs: int) -> Iterator[None]:
        """Group the op calls made inside the block into one step."""
        self._current = calls = []
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            self._current = None
            self._last_step_ns = end - start
            record = StepRecord(kind, start, end, n_tokens, n_seqs, tuple(calls))
            with self._lock:
                for call in calls:
                    self._add_op(*call)
                totals = self._step_totals.setdefault(kind, _StepTotals())
                totals.steps += 1
                totals.total_ns += end - start
                totals.op_ns += sum(c[2] for c in calls)
                totals.op_calls += len(calls)
                totals.tokens += n_tokens
                totals.seqs += n_seqs
                totals.durations_ns.append(end - start)
            self._recent.append(record)

    def loop(self, kind: str, loop_ns: int, engine_ns: int) -> None:
        """One scheduler iteration that ran a step of `kind`, the last `step` block: its whole
        time, and the time spent inside Engine.step (dropped when a reset came between the
        step and this)."""
        with self._lock:
            totals = self._step_totals.get(kind)
            if totals is None:
                return
            totals.loops += 1
            totals.loop_ns += loop_ns
            totals.loop_engine_ns += engine_ns
            totals.loop_step_ns += self._last_step_ns

    def _add_op(self, name: str, _start: int, duration: int) -> None:
        totals = self._ops_totals.setdefault(name, _OpTotals())
        totals.calls += 1
        totals.total_ns += duration
        totals.max_ns = max(totals.max_ns, duration)

    def recent_steps(self, n: int | None = None) -> list[StepRecord]:
        """The last n steps (all kept when None), oldest first."""
        return self._recent.last(n)

    def reset(self) -> None:
        self._recent.clear()
        with self._lock:
            self._ops_totals.clear()
            self._step_totals.clear()

    def snapshot(self) -> dict[str, Any]:
        """The op table (host time per op name) and per-kind step figures."""
        with self._lock:
            ops = {k: _OpTotals(v.calls, v.total_ns, v.max_ns) for k, v in self._ops_totals.items()}
            steps = {
                k: (
                    v.steps,
                    v.total_ns,
                    v.op_ns,
                    v.op_calls,
                    v.tokens,
                    v.seqs,
                    sorted(v.durations_ns),
                    (v.loops, v.loop_ns, v.loop_engine_ns, v.loop_step_ns),
                )
                for k, v in self._step_totals.items()
            }
        all_ns = sum(t.total_ns for t in ops.values()) or 1
        table = [
            {
                "op": name,
                "calls": t.calls,
                "total_ms": t.total_ns / 1e6,
                "mean_us": t.total_ns / t.calls / 1e3,
                "max_us": t.max_ns / 1e3,
                "share": t.total_ns / all_ns,
            }
            for name, t in sorted(ops.items(), key=lambda kv: -kv[1].total_ns)
        ]
        step_table = {}
        for kind, (n, total, op_ns, op_calls, tokens, seqs, durations, loop) in steps.items():
            loops, loop_ns, loop_engine_ns, loop_step_ns = loop
            mean_ns = total / n
            step_table[kind] = {
                "steps": n,
                "mean_ms": mean_ns / 1e6,
                "p50_ms_recent": durations[len(durations) // 2] / 1e6,
                "ops_per_step": op_calls / n,
                "op_host_us_per_step": op_ns / n / 1e3,
                "other_host_us_per_step": (total - op_ns) / n / 1e3,
                "tokens": tokens,
                "mean_batch": seqs / n,
                "host_us_per_token": total / tokens / 1e3 if tokens else 0.0,
                # A step's mean time plus its iteration's beyond it, so that a snapshot taken
                # between a step and its iteration's end (the I/O thread's) still has the
                # iteration hold the step.
                "loop_ms": (mean_ns + (loop_ns - loop_step_ns) / loops) / 1e6 if loops else None,
                "loop_host_us_per_step": (
                    (loop_ns - loop_engine_ns) / loops / 1e3 if loops else None
                ),
            }
        return {"ops": table, "steps": step_table}

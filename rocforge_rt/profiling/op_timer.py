"""Host time of each forward op, by name: the launch-overhead table.

`OpTimer` stands in for `engine.ops` (what `forward()` calls): each op method
call is timed on the host with `perf_counter_ns`. Calls are grouped into steps
(one prefill chunk, or one batched decode step) by the engine thread, which
owns the timer; `snapshot` and `reset` may be called from any thread.

On the CPU backend an op's host time is its numpy compute; on a GPU backend it
is the launch cost (in graph mode ops run only while a step graph is captured:
replayed steps make no op calls). A step's time covers all the engine thread's
work in it, sampling and replies included. GPU backends report what the host
cannot see (arg-cache hits, syncs, graph replay) through an optional
`backend.runtime_stats()`; `recommend` reads these keys of it when present:
`launches_per_step`, `arg_cache_hits`, `arg_cache_misses`, `syncs_per_step`,
`graph_replay`.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

HOST_BUDGET_US_PER_TOKEN = 40.0  # DESIGN.md: what is left per token at 2x llama.cpp
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
    durations_ns: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_DURATIONS))


class OpTimer:
    """A proxy of a backend's forward ops that times every op method call by name."""

    def __init__(self, ops: Any, *, keep_steps: int = 64) -> None:
        self._ops = ops
        self._lock = threading.Lock()
        self._ops_totals: dict[str, _OpTotals] = {}
        self._step_totals: dict[str, _StepTotals] = {}
        self._recent: deque[StepRecord] = deque(maxlen=keep_steps)
        self._current: list[tuple[str, int, int]] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr
        timed = self._timed(name, attr)
        setattr(self, name, timed)  # later lookups find it without __getattr__
        return timed

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                call = (name, start, clock() - start)
                if self._current is not None:
                    self._current.append(call)
                else:
                    with self._lock:
                        self._add_op(*call)

        return timed

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

    def _add_op(self, name: str, _start: int, duration: int) -> None:
        totals = self._ops_totals.setdefault(name, _OpTotals())
        totals.calls += 1
        totals.total_ns += duration
        totals.max_ns = max(totals.max_ns, duration)

    def recent_steps(self, n: int | None = None) -> list[StepRecord]:
        """The last n steps (all kept when None), oldest first."""
        with self._lock:
            steps = list(self._recent)
        return steps[-n:] if n else steps

    def reset(self) -> None:
        with self._lock:
            self._ops_totals.clear()
            self._step_totals.clear()
            self._recent.clear()

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
        for kind, (n, total, op_ns, op_calls, tokens, seqs, durations) in steps.items():
            step_table[kind] = {
                "steps": n,
                "mean_ms": total / n / 1e6,
                "p50_ms_recent": durations[len(durations) // 2] / 1e6,
                "ops_per_step": op_calls / n,
                "op_host_us_per_step": op_ns / n / 1e3,
                "other_host_us_per_step": (total - op_ns) / n / 1e3,
                "tokens": tokens,
                "mean_batch": seqs / n,
                "host_us_per_token": total / tokens / 1e3 if tokens else 0.0,
            }
        return {"ops": table, "steps": step_table}


def recommend(overhead: Mapping[str, Any], runtime: Mapping[str, Any] | None) -> list[str]:
    """Plain-language hints from the op table and a GPU backend's runtime stats."""
    hints = []
    decode = overhead.get("steps", {}).get("decode")
    if runtime is None:
        hints.append(
            "CPU backend: op times are numpy compute, not launch overhead; a GPU backend adds "
            "launch cost, arg-cache hits and syncs per step to these stats"
        )
    else:
        syncs = runtime.get("syncs_per_step")
        if syncs is not None and syncs > 1:
            hints.append(
                f"{syncs:.1f} syncs per step: defer synchronization to one per step "
                "(read back only the sampled tokens)"
            )
        hits, misses = runtime.get("arg_cache_hits", 0), runtime.get("arg_cache_misses", 0)
        if hits + misses >= 100 and hits / (hits + misses) < 0.9:
            hints.append(
                f"arg-cache hit rate {hits / (hits + misses):.0%}: arguments change between "
                "steps; keep per-step values in the device step-state buffer"
            )
        launches = runtime.get("launches_per_step")
        if runtime.get("graph_replay") is False and launches is not None and launches > 20:
            hints.append(
                f"{launches:.0f} launches per step without graph replay: capture the step plan "
                "into a graph and replay it"
            )
    if decode is None:
        hints.append("no decode steps recorded yet: run some requests, then ask again")
        return hints
    # On a GPU the time outside the ops includes the device's (the sync, a graph replay).
    other = decode["other_host_us_per_step"] / max(decode["mean_batch"], 1.0)
    if runtime is None and other > HOST_BUDGET_US_PER_TOKEN:
        hints.append(
            f"{other:.0f} us of host time per token outside the ops (sampling, readback, "
            f"detokenization, replies) is over the ~{HOST_BUDGET_US_PER_TOKEN:.0f} us budget"
        )
    table = overhead.get("ops", [])
    if table and table[0]["share"] >= 0.5:
        hints.append(
            f"op {table[0]['op']!r} takes {table[0]['share']:.0%} of op time: "
            "the first target for kernel work or fusion"
        )
    return hints

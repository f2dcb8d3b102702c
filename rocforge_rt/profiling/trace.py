"""Chrome/Perfetto trace JSON of recent engine steps, on three tracks.

Open the output in https://ui.perfetto.dev or chrome://tracing:
- `engine`: each step (one prefill chunk or one batched decode step) as a slice,
  its forward-op calls nested inside (the op timer's records);
- `CPU launches`: on a GPU backend with the launch tracker on, each step's kernel
  launches (host time in the driver call; a graph replay is one `graph_replay`);
- `GPU`: the kernel timer's sampled steps, each kernel's device time, placed on
  the host clock from the moment the step's work was released to the device.
Timestamps are microseconds from the earliest event shown.
"""

from collections.abc import Sequence
from typing import Any

from rocforge_rt.profiling.kernel_timer import TimedStep
from rocforge_rt.profiling.launch_tracker import LaunchStep
from rocforge_rt.profiling.op_timer import StepRecord

PID = 1
ENGINE_TID, LAUNCH_TID, GPU_TID = 1, 2, 3
TRACK_NAMES = {ENGINE_TID: "engine", LAUNCH_TID: "CPU launches", GPU_TID: "GPU"}


def _slice(name: str, cat: str, tid: int, start_us: float, dur_us: float, **args: Any) -> dict:
    event = {"name": name, "cat": cat, "ph": "X", "pid": PID, "tid": tid,
             "ts": start_us, "dur": max(dur_us, 0.0)}  # fmt: skip
    if args:
        event["args"] = args
    return event


def chrome_trace(
    steps: Sequence[StepRecord],
    *,
    launches: Sequence[LaunchStep] = (),
    gpu: Sequence[TimedStep] = (),
    process_name: str = "rocforge",
) -> dict[str, Any]:
    """The trace-event JSON object of these records (any of them may be empty)."""
    starts = [s.start_ns for s in steps] + [s.start_ns for s in launches]
    starts += [g.host_start_ns for g in gpu]
    origin = min(starts, default=0)

    def us(ns: int) -> float:
        return (ns - origin) / 1e3

    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": process_name}}
    ]
    events += [
        {"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for tid, name in TRACK_NAMES.items()
    ]
    for index, step in enumerate(steps):
        events.append(_slice(f"{step.kind} step", "step", ENGINE_TID, us(step.start_ns),
                             (step.end_ns - step.start_ns) / 1e3, step=index,
                             tokens=step.n_tokens, sequences=step.n_seqs))  # fmt: skip
        events += [
            _slice(name, "op", ENGINE_TID, us(start), duration / 1e3)
            for name, start, duration in step.ops
        ]
    for step in launches:
        events.append(_slice("launch step", "step", LAUNCH_TID, us(step.start_ns),
                             (step.end_ns - step.start_ns) / 1e3, step=step.step,
                             syncs=step.syncs, launches=len(step.launches)))  # fmt: skip
        events += [
            _slice(name, "launch", LAUNCH_TID, us(start), (end - start) / 1e3)
            for name, start, end in step.launches
        ]
    for step in gpu:
        if not step.kernels:
            continue
        base = us(step.host_start_ns) - step.kernels[0].start_us  # first kernel at release
        events.append(_slice("GPU step", "step", GPU_TID, base + step.kernels[0].start_us,
                             step.span_us, step=step.step, busy_us=step.busy_us,
                             gaps_us=step.gaps_us))  # fmt: skip
        events += [
            _slice(k.name, "kernel", GPU_TID, base + k.start_us, k.duration_us)
            for k in step.kernels
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}

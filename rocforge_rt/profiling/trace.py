"""Chrome/Perfetto trace JSON of recent engine steps, from the op timer's records.

Open the output in https://ui.perfetto.dev or chrome://tracing: each step is a
slice on the engine thread's track, with its op calls nested inside.
"""

from collections.abc import Sequence
from typing import Any

from rocforge_rt.profiling.op_timer import StepRecord

PID = 1
ENGINE_TID = 1


def chrome_trace(steps: Sequence[StepRecord], *, process_name: str = "rocforge") -> dict[str, Any]:
    """The trace-event JSON object (microsecond timestamps from the first step's start)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": process_name}},
        {
            "ph": "M",
            "pid": PID,
            "tid": ENGINE_TID,
            "name": "thread_name",
            "args": {"name": "engine"},
        },
    ]
    origin = steps[0].start_ns if steps else 0
    for index, step in enumerate(steps):
        events.append(
            {
                "name": f"{step.kind} step",
                "cat": "step",
                "ph": "X",
                "pid": PID,
                "tid": ENGINE_TID,
                "ts": (step.start_ns - origin) / 1e3,
                "dur": (step.end_ns - step.start_ns) / 1e3,
                "args": {"step": index, "tokens": step.n_tokens, "sequences": step.n_seqs},
            }
        )
        events.extend(
            {
                "name": name,
                "cat": "op",
                "ph": "X",
                "pid": PID,
                "tid": ENGINE_TID,
                "ts": (start - origin) / 1e3,
                "dur": duration / 1e3,
            }
            for name, start, duration in step.ops
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}

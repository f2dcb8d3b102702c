"""The read-only ops the I/O thread answers itself from what the engine thread publishes.

`stats`, `trace` and `profile` (daemon.py's `info` and `health` are beside its state):
they never wait on the engine thread. `profile` sets switches the engine thread reads at
each step.
"""

from typing import Any

from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.profiling.recommendations import recommend
from rocforge_rt.profiling.trace import chrome_trace
from rocforge_rt.server.engine_loop import EngineLoop
from rocforge_rt.server.protocol import Request


def stats(
    engine_loop: EngineLoop,
    latency: LatencyRecorder,
    request: Request,
    uptime_s: float,
    queue: dict[str, Any],
) -> dict[str, Any]:
    """`queue`: the requests waiting for a session slot (depth, peak, limits: daemon.py)."""
    timer = engine_loop.op_timer
    overhead = timer.snapshot()
    runtime = engine_loop.runtime_stats
    stats: dict[str, Any] = {
        "latency": latency.summary(),
        "overhead": overhead,
        "recommendations": recommend(overhead, runtime),
        **engine_loop.usage,
        "queue": queue,
        "uptime_s": uptime_s,
    }
    if runtime is not None:
        stats["runtime"] = runtime
    if request.records:
        stats["records"] = latency.recent(request.records)
    if request.reset:
        latency.reset()
        timer.reset()
        engine_loop.reset_stats()
    return stats


def trace(engine_loop: EngineLoop, request: Request) -> dict[str, Any]:
    steps = engine_loop.op_timer.recent_steps(request.steps)
    backend = engine_loop.engine.backend
    tracker, timer = backend.launch_tracker, backend.kernel_timer
    launches = tracker.recent(request.steps) if tracker is not None else []
    gpu = timer.recent(request.steps) if timer is not None else []
    trace = chrome_trace(steps, launches=launches, gpu=gpu)
    return {"trace": trace, "steps": len(steps), "launch_steps": len(launches),
            "gpu_steps": len(gpu)}  # fmt: skip


def profile(engine_loop: EngineLoop, request: Request) -> dict[str, Any]:
    """Switch the GPU backend's launch tracker and kernel timer; reply with their state.

    The engine thread reads these switches at each step (a step in flight keeps its
    setting), so they are set here without handing work to it.
    """
    backend = engine_loop.engine.backend
    tracker, timer = backend.launch_tracker, backend.kernel_timer
    if tracker is None or timer is None:
        return {"available": False, "launches": False, "kernels": False, "every": 0}
    if request.every is not None:
        timer.every = request.every
    if request.kernels is not None:
        timer.enabled = request.kernels
    if request.launches is not None:
        tracker.enabled = request.launches
    return {"available": True, "launches": tracker.enabled, "kernels": timer.enabled,
            "every": timer.every}  # fmt: skip

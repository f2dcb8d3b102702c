"""Profiling on a GPU: following the recommendations, and traces of real steps.

A random-weight model of the SmolLM2-135M shape decodes in each step mode; the
tracker's recommendations are followed one by one and the metric each names must
improve. Metrics are counts (syncs, launches per step), never timings.
"""

from pathlib import Path

import numpy as np
import pytest
from script_modules import import_script

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.engine.engine import Engine
from rocforge_rt.model.synthetic import write_synthetic_model
from rocforge_rt.profiling.recommendations import step_recommendations
from rocforge_rt.profiling.trace import GPU_TID, LAUNCH_TID, chrome_trace

decode_tokens_per_s = import_script("bench_harness").decode_tokens_per_s

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of the SmolLM2-135M shape."""
    path = tmp_path_factory.mktemp("models") / "smollm2-shape.gguf"
    return write_synthetic_model("smollm2-135m", path, seed=3, progress=False)


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine.load(model, backend="cuda", n_ctx=128, mode="per-kernel-sync")


def profile_decode(engine: Engine, mode: str, *, kernels: bool = False) -> dict:
    """Runtime stats of 12 decode steps in `mode` (after a warm-up), the tracker on."""
    backend = engine.backend
    backend.mode = mode
    rng = np.random.default_rng(1)
    decode_tokens_per_s(engine, 4, rng)  # warm-up: a graph is captured here, not below
    backend.reset_runtime_stats()
    backend.launch_tracker.enabled = True
    backend.kernel_timer.enabled = kernels
    backend.kernel_timer.every = 4
    try:
        decode_tokens_per_s(engine, 12, rng)
    finally:
        backend.launch_tracker.enabled = backend.kernel_timer.enabled = False
    return backend.runtime_stats()


def advice_for(stats: dict, action: str) -> dict:
    return next(a for a in step_recommendations(stats) if a["action"] == action)


def test_following_each_recommendation_improves_the_metric_it_names(engine):
    synced = profile_decode(engine, "per-kernel-sync")
    defer = advice_for(synced, "defer_sync")
    deferred = profile_decode(engine, "deferred")
    assert deferred[defer["metric"]] < defer["value"]
    assert deferred["syncs_per_step"] == pytest.approx(1.0)
    replay = advice_for(deferred, "use_graph_replay")
    graph = profile_decode(engine, "graph")
    assert graph[replay["metric"]] < replay["value"]
    assert graph["launch_overhead"]["launches_per_step"] == pytest.approx(1.0)  # the replay
    assert not {a["action"] for a in step_recommendations(graph)} & {
        "defer_sync", "use_graph_replay",
    }  # fmt: skip


def test_a_trace_of_graph_steps_has_cpu_launches_and_the_timed_steps_kernels(engine):
    stats = profile_decode(engine, "graph", kernels=True)
    backend = engine.backend
    gpu_steps = backend.kernel_timer.recent()
    launch_steps = backend.launch_tracker.recent()
    # 13 steps (a 1-token prefill, 12 decode steps): 0, 4, 8, 12 timed, 1, 5, 9 replays timed
    assert stats["gpu_time"]["timed_steps"] == len(gpu_steps) == 4
    kernels_per_step = 1 + engine.hparams.n_layer * 5 + 2  # embed, layers, LM head, argmax
    assert all(len(step.kernels) == kernels_per_step for step in gpu_steps)
    assert stats["gpu_time"]["timed_replays"] == 3 and stats["gpu_time"]["graph_replay_us_mean"] > 0
    trace = chrome_trace([], launches=launch_steps, gpu=gpu_steps)
    for tid in (LAUNCH_TID, GPU_TID):
        events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]
        steps = [e for e in events if e["cat"] == "step"]
        for step in steps:
            end = step["ts"] + step["dur"]
            inner = [e for e in events if e["cat"] != "step" and step["ts"] <= e["ts"] < end]
            assert inner and all(e["ts"] + e["dur"] <= end + 1e-6 for e in inner)
            starts = [e["ts"] for e in inner]
            assert starts == sorted(starts)
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "kernel"}
    assert {"rf_attention_decode_d64", "rf_argmax_advance", "rf_gemv_q4_0_b1_n1_swiglu"} <= names


def test_the_daemon_switches_profiling_on_and_serves_its_tables_and_trace(model):
    from rocforge_client import connect
    from rocforge_rt.server.daemon import Daemon, DaemonConfig

    config = DaemonConfig(model=model, backend="cuda", bind="tcp://127.0.0.1:*", ctx_size=128,
                          max_sessions=2)  # fmt: skip
    with Daemon(config) as daemon, connect(daemon.endpoint, timeout=60) as client:
        state = client.profile(launches=True, kernels=True, every=2)
        assert state == {**state, "available": True, "launches": True, "kernels": True, "every": 2}
        list(client.generate(tokens=[1, 2, 3, 4], max_tokens=12))
        runtime = client.stats()["runtime"]
        attention = runtime["kernels"]["rf_attention_decode_d64"]
        assert attention["gpu_us_mean"] > 0 and attention["launches"] > 0
        assert runtime["gpu_time"]["timed_steps"] >= 1
        trace = client.trace(steps=8)
        tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {LAUNCH_TID, GPU_TID} <= tracks
        assert client.profile(launches=False, kernels=False)["launches"] is False

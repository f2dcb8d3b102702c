"""The launch-overhead tracker, the kernel timer, the recommendations and the trace export.

No GPU needed: launches go through real `LaunchHandle`s on `FakeDriver`, whose device
clock advances by a set time per kernel, so the figures below are exact.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import pytest
from fake_driver import KERNELS, FakeDriver

from rocforge_rt.backends.gpu.launch import LaunchHandle
from rocforge_rt.profiling import recommendations as rec
from rocforge_rt.profiling.kernel_timer import KernelSpan, KernelTimer, TimedStep
from rocforge_rt.profiling.launch_tracker import (
    HIGH_OVERHEAD_US,
    LaunchOverheadTracker,
    LaunchStep,
)
from rocforge_rt.profiling.op_timer import OpTimer, StepRecord
from rocforge_rt.profiling.trace import ENGINE_TID, GPU_TID, LAUNCH_TID, chrome_trace


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    with FakeDriver() as fake:
        yield fake


def handle(driver: FakeDriver, stream, kernel: str, tracker=None) -> LaunchHandle:
    function = driver.load_module(b"fake").function(kernel)
    h = LaunchHandle(driver, function, name=kernel, grid=(1, 1, 1), block=(32, 1, 1),
                     stream=stream, arg_types=KERNELS[kernel], tracker=tracker)  # fmt: skip
    h.set_args(*(0 for _ in KERNELS[kernel]))
    return h


# --- launch tracker -------------------------------------------------------------------------
def tracked(launches: list[tuple[str, int]], wall_ns: int, syncs: int) -> dict:
    """One step of (kernel, host ns) launches back to back, through the tracker."""
    tracker = LaunchOverheadTracker()
    tracker.enabled = True
    tracker.begin_step(0)
    clock = 0
    for name, duration in launches:
        tracker.launched(name, clock, clock + duration)
        clock += duration
    tracker.end_step(wall_ns, syncs)
    return tracker.snapshot()


def test_tracker_gives_per_kernel_count_min_max_mean_std_and_share():
    snap = tracked([("a", 4000), ("a", 6000), ("b", 3000)], wall_ns=26_000, syncs=2)
    a = snap["kernels"]["a"]
    assert (a["launches"], a["host_us_min"], a["host_us_max"]) == (2, 4.0, 6.0)
    assert a["host_us_mean"] == pytest.approx(5.0)
    assert a["host_us_std"] == pytest.approx(1.0)
    assert a["share_of_step"] == pytest.approx(10_000 / 26_000)
    assert snap["launches_per_step"] == 3 and snap["syncs_per_step"] == 2
    assert snap["launch_us_per_step"] == pytest.approx(13.0)
    assert list(snap["kernels"]) == ["a", "b"]  # by total host time


def test_tracker_flags_high_overhead_and_high_variance():
    slow = tracked([("slow", int(2e3 * HIGH_OVERHEAD_US))] * 3, 10**6, 1)
    assert slow["kernels"]["slow"]["flags"] == ["high_overhead"]
    erratic = tracked([("x", 1000)] * 9 + [("x", 50_000)], 10**6, 1)
    assert erratic["kernels"]["x"]["flags"] == ["high_variance"]
    steady = tracked([("x", 5000)] * 10, 10**6, 1)
    assert steady["kernels"]["x"]["flags"] == []


def test_handles_report_launches_only_while_the_tracker_is_on(driver):
    tracker = LaunchOverheadTracker()
    h = handle(driver, driver.create_stream(), "k", tracker)
    h.launch()  # off: nothing recorded
    tracker.enabled = True
    tracker.begin_step(0)
    h.launch()
    h.launch()
    tracker.end_step(10**9, 1)
    (step,) = tracker.recent()
    assert [name for name, _, _ in step.launches] == ["k", "k"]
    assert all(end >= start for _, start, end in step.launches)
    tracker.reset()
    assert tracker.snapshot()["steps"] == 0 and tracker.recent() == []


# --- kernel timer ---------------------------------------------------------------------------
def timed_steps(driver: FakeDriver, every: int, steps: int) -> KernelTimer:
    """Steps of kernels k (3 us) and copy (5 us), the device idle 0.5 us after each."""
    stream = driver.create_stream()
    driver.durations_us = {"k": 3.0, "copy": 5.0}
    timer = KernelTimer(driver, stream, every=every)
    timer.enabled = True
    launches = [handle(driver, stream, "k"), handle(driver, stream, "copy")]
    for index in range(steps):
        if timer.start_step(index, host_start_ns=index):
            for h in launches:
                timer.before(h.name)
                h.launch()
                timer.after()
                driver.clock_us += 0.5
            timer.finish_step()
        else:
            for h in launches:
                h.launch()
    return timer


def test_kernel_timer_times_each_kernel_of_the_sampled_steps(driver):
    timer = timed_steps(driver, every=4, steps=10)  # steps 0, 4, 8
    snap = timer.snapshot()
    assert snap["timed_steps"] == 3
    assert snap["kernels"]["k"]["gpu_us_mean"] == pytest.approx(3.0)
    assert snap["kernels"]["copy"]["calls_per_step"] == 1
    assert snap["gpu_busy_us_per_step"] == pytest.approx(8.0)
    assert snap["gpu_gaps_us_per_step"] == pytest.approx(0.5)  # between the two kernels
    step = timer.recent(1)[0]
    assert [k.name for k in step.kernels] == ["k", "copy"]
    assert step.kernels[1].start_us >= step.kernels[0].start_us + step.kernels[0].duration_us


def test_kernel_timer_is_off_until_enabled_and_times_replays_after_timed_steps(driver):
    timer = KernelTimer(driver, driver.create_stream(), every=4)
    assert not timer.start_step(0, 0) and not timer.begin_replay(1)
    timer.enabled = True
    assert not timer.begin_replay(2)
    assert timer.begin_replay(5)  # the step after a timed one (5 % 4 == 1)
    driver.clock_us += 40.0  # the graph's work
    timer.end_replay()
    timer.finish_replay()
    assert timer.snapshot()["graph_replay_us_mean"] == pytest.approx(40.0)


# --- recommendations ------------------------------------------------------------------------
def runtime(mode: str, *, syncs: float, launches: float, share: float, kernels=None) -> dict:
    return {
        "graph_replay": mode == "graph",
        "syncs_per_step": syncs,
        "launches_per_step": launches,
        "launch_tracking": True,
        "launch_overhead": {"launch_share_of_step": share},
        "arg_cache_hits": 1000,
        "arg_cache_misses": 0,
        "kernels": kernels or {},
    }


def actions(advice: list[dict], scope: str = "step") -> set[str]:
    return {a["action"] for a in advice if a["scope"] == scope}


def test_per_kernel_sync_is_told_to_defer_syncs_then_deferred_to_replay_graphs():
    per_kernel = rec.step_recommendations(runtime("pks", syncs=154, launches=153, share=0.4))
    assert actions(per_kernel) == {"defer_sync", "use_graph_replay"}
    deferred = rec.step_recommendations(runtime("deferred", syncs=1, launches=153, share=0.4))
    assert actions(deferred) == {"use_graph_replay"}
    graph = rec.step_recommendations(runtime("graph", syncs=1, launches=1, share=0.01))
    assert actions(graph) == set()


def test_a_step_not_bound_by_launches_is_not_told_to_replay_graphs():
    busy_gpu = runtime("deferred", syncs=1, launches=153, share=rec.LAUNCH_BOUND_SHARE / 2)
    assert actions(rec.step_recommendations(busy_gpu)) == set()


def test_small_frequent_kernels_are_fusion_candidates_and_the_rest_need_no_action():
    kernels = {
        "tiny": {"calls_per_step": 30, "gpu_us_mean": rec.SMALL_KERNEL_GPU_US / 2},
        "big": {"calls_per_step": 30, "gpu_us_mean": 4 * rec.SMALL_KERNEL_GPU_US},
        "rare": {"calls_per_step": 1, "gpu_us_mean": 1.0},
    }
    advice = rec.kernel_recommendations(runtime("graph", syncs=1, launches=1, share=0,
                                                kernels=kernels))  # fmt: skip
    by_kernel = {a["target"]: a["action"] for a in advice}
    assert by_kernel == {"tiny": "fuse_or_batch", "big": "no_action", "rare": "no_action"}


def test_an_unstable_arg_cache_is_reported():
    stats = runtime("graph", syncs=1, launches=1, share=0) | {"arg_cache_hits": 50,
                                                              "arg_cache_misses": 150}  # fmt: skip
    (advice,) = rec.step_recommendations(stats)
    assert advice["action"] == "keep_args_stable" and advice["value"] == pytest.approx(0.25)


# --- op timer -------------------------------------------------------------------------------
def test_op_timer_reports_the_loop_around_each_step_and_its_host_time_outside_engine_step():
    timer = OpTimer()
    for loop_ns, engine_ns in ((3_000_000, 2_000_000), (5_000_000, 3_000_000)):
        with timer.step("decode", n_tokens=4, n_seqs=4):
            pass
        timer.loop("decode", loop_ns, engine_ns)
    with timer.step("prefill", n_tokens=9, n_seqs=1):
        pass  # a step whose iteration was not recorded
    steps = timer.snapshot()["steps"]
    assert steps["decode"]["loop_ms"] == pytest.approx(4.0)
    assert steps["decode"]["loop_host_us_per_step"] == pytest.approx(1500.0)
    assert steps["prefill"]["loop_ms"] is None and steps["prefill"]["loop_host_us_per_step"] is None
    timer.reset()
    timer.loop("decode", 1_000_000, 0)  # a reset came between its step and its loop: dropped
    assert timer.snapshot()["steps"] == {}


def test_a_snapshot_between_a_step_and_its_iterations_end_still_has_the_iteration_hold_it():
    """The I/O thread reads the figures while the engine thread runs: a slow last step whose
    iteration is not on record yet still leaves the loop time above the step time."""
    timer = OpTimer()
    for _ in range(2):
        with timer.step("decode", n_tokens=1, n_seqs=1):
            pass
        timer.loop("decode", 1_000_000, 0)
    with timer.step("decode", n_tokens=1, n_seqs=1):
        time.sleep(0.02)  # its iteration has not ended yet
    decode = timer.snapshot()["steps"]["decode"]
    assert decode["mean_ms"] > 6.0
    assert decode["loop_ms"] >= decode["mean_ms"] + 0.99


# --- trace export ---------------------------------------------------------------------------
def sample_trace() -> dict:
    ms = 1_000_000
    op_calls = (("embed", 10 * ms + 10, 500), ("lm_head", 11 * ms, 2000))
    ops = [StepRecord("decode", 10 * ms, 12 * ms, 1, 1, op_calls)]
    launch_calls = (("rf_embed", 10 * ms + 20, 10 * ms + 4020),
                    ("graph_replay", 11 * ms, 11 * ms + 9000))  # fmt: skip
    launches = [LaunchStep(0, 10 * ms, 12 * ms, 1, launch_calls)]
    kernels = (KernelSpan("rf_embed", 0.0, 4.0), KernelSpan("rf_gemv", 5.0, 20.0))
    gpu = [TimedStep(7, 11 * ms + 9000, kernels)]
    return json.loads(json.dumps(chrome_trace(ops, launches=launches, gpu=gpu)))


def slices(trace: dict, tid: int) -> tuple[list[dict], list[dict]]:
    """(step slices, slices nested in steps) of one track."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]
    return [e for e in events if e["cat"] == "step"], [e for e in events if e["cat"] != "step"]


def inside(child: dict, parent: dict) -> bool:
    end = parent["ts"] + parent["dur"]
    return parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= end + 1e-9


def test_trace_names_three_tracks_and_starts_at_zero():
    trace = sample_trace()
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert names == {ENGINE_TID: "engine", LAUNCH_TID: "CPU launches", GPU_TID: "GPU"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0.0
    assert all(e["dur"] >= 0 and math.isfinite(e["ts"]) for e in spans)


@pytest.mark.parametrize("tid", [ENGINE_TID, LAUNCH_TID, GPU_TID])
def test_trace_spans_nest_in_their_step_and_follow_each_other(tid):
    (step,), children = slices(sample_trace(), tid)
    assert children and all(inside(child, step) for child in children)
    for before, after in zip(children, children[1:], strict=False):
        assert before["ts"] + before["dur"] <= after["ts"]


def test_gpu_spans_start_when_the_step_was_released():
    trace = sample_trace()
    (gpu_step,), kernels = slices(trace, GPU_TID)
    (_, launches) = slices(trace, LAUNCH_TID)
    replay = next(e for e in launches if e["name"] == "graph_replay")
    assert gpu_step["ts"] == pytest.approx(replay["ts"] + replay["dur"])
    assert gpu_step["args"]["busy_us"] == pytest.approx(24.0)
    assert [k["name"] for k in kernels] == ["rf_embed", "rf_gemv"]

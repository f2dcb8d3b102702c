"""scripts/decode_timeline.py's reading of a timeline: a decode step's kernels found among a
prompt's and a cut-off step's, and each kernel's share of the step's critical path."""

from script_modules import load_script


def load_timeline():
    return load_script("decode_timeline")


def overlapping_steps(timeline):
    """A prompt, four decode steps (each kernel starting before the one before it ends, the
    last one ending 1 us later each step) and a step cut off by the end of the recording."""
    span = timeline.KernelSpan
    spans = [span("rf_embed_q8_0", 0, 5), span("gemm", 5, 50), span("rf_argmax", 50, 60)]
    for k in range(-1, 3):
        t = 100 + 20 * k
        spans += [
            span("rf_embed_q8_0", t, t + 2),
            span("gemv", t + 1, t + 6),
            span("attention", t + 5, t + 9),
            span("rf_argmax", t + 8, t + 12 + k),
        ]
    spans += [span("rf_embed_q8_0", 160, 162), span("gemv", 161, 170)]
    return spans[::-1]  # any order: the reader sorts by start


def test_decode_steps_are_the_runs_of_the_most_common_kernels_after_one_such_run():
    timeline = load_timeline()
    steps = timeline.decode_steps(overlapping_steps(timeline))
    # The first decode step (after the prompt's kernels) and the cut-off one are left out.
    assert len(steps) == 3
    for k, run in enumerate(steps):
        predecessor, *kernels = run
        assert [s.name for s in kernels] == ["rf_embed_q8_0", "gemv", "attention", "rf_argmax"]
        assert predecessor.name == "rf_argmax" and predecessor.end_us == 91 + 21 * k
        assert kernels[0].start_us == 100 + 20 * k


def test_increments_are_each_kernels_end_after_the_one_before_and_add_up_to_the_step():
    timeline = load_timeline()
    result = timeline.critical_path(timeline.decode_steps(overlapping_steps(timeline)))
    assert result["steps"] == 3
    # The steps end at 91 (left out), 112, 133 and 154.
    assert result["step_us"] == 21
    kernels = {k["name"]: k for k in result["kernels"]}
    assert kernels["gemv"]["increment_us"] == 4 and kernels["gemv"]["span_us"] == 5
    assert kernels["attention"]["increment_us"] == 3
    assert kernels["rf_argmax"]["increment_us"] == 4  # 3, 4 and 5
    assert kernels["rf_embed_q8_0"]["increment_us"] == 10  # 11, 10 and 9
    assert all(k["per_step"] == 1 for k in kernels.values())
    per_step = sum(k["increments_per_step_us"] for k in result["kernels"])
    assert per_step == (154 - 91) / 3


def test_a_timeline_without_a_whole_step_has_none():
    timeline = load_timeline()
    span = timeline.KernelSpan
    assert timeline.decode_steps([span("rf_embed_q8_0", 0, 1), span("gemv", 1, 2)]) == []
    assert timeline.decode_steps([]) == []

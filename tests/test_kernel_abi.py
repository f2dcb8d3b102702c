"""The contract between the kernels and the Python side, checked without a GPU.

- A launch packs each kernel's arguments as its C declaration types them: the kernel
  library reads every parameter list (macros expanded) and the launcher takes the
  types from there; a launch with the wrong number of arguments is refused.
- Every number both sides use is written once, in kernel_constants.py, and reaches
  every compile as a -D define (part of the cache key); no kernel file defines one.
- The records the host lays out for the kernels match the kernels' structs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
from fake_driver import INFO as FAKE_INFO
from fake_driver import FakeDriver
from gguf import GGMLQuantizationType as Q
from gpu_checks import hparams, weight

from rocforge_rt.backends.gpu import kernel_constants
from rocforge_rt.backends.gpu.attention_plan import AttentionTuning
from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.kernel_constants import GEMV_MAX_ROWS, KERNEL_DEFINES, MMV_MAX_ROWS
from rocforge_rt.backends.gpu.kernel_library import (
    C_ARG_TYPES,
    KernelLibrary,
    kernel_names,
    kernel_signatures,
    kernel_source,
    kernels_dir,
    struct_fields,
)
from rocforge_rt.backends.gpu.kernel_variants import (
    GENERATED_KERNELS,
    MMV_SHAPES,
    generated_source,
    mmv_shapes,
    mmv_tiles,
)
from rocforge_rt.backends.gpu.launch import ARG_TYPES, LaunchHandle
from rocforge_rt.backends.gpu.launcher import BETWEEN_STEPS, Launcher
from rocforge_rt.backends.gpu.matmul import DeviceMatrix
from rocforge_rt.backends.gpu.matmul_plan import (
    GEMV_BULK_K_MULTIPLE,
    DeviceCaps,
    MatmulTuning,
    gemv_ring,
    gemv_ring_slot_bytes,
    swiglu_blocks_spread,
)
from rocforge_rt.errors import BackendError, KernelCompileError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.synthetic import SHAPES
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import LayerWeights, ModelWeights, StepOutput, forward
from rocforge_rt.step.sampling import ROW_PARAMS_DTYPE, RowSampling, Sampler, SamplingParams

KERNELS = kernels_dir()
SOURCES = sorted(p.name for p in KERNELS.glob("*.hip"))
HEADERS = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.h"))}
# weights, n, k, x, rows, the row quantized once (or null), gain, eps, release early
GEMV_HEAD = ("ptr", "ptr", "i32", "i32", "ptr", "i32", "ptr", "ptr", "f32", "i32")


def signatures() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for name in SOURCES:
        found.update(kernel_signatures(kernel_source(KERNELS, name), HEADERS))
    return found


class FakeCompiler:
    """Records what it is asked to compile; returns a stand-in ELF."""

    vendor, arch, version, warp_size = "cuda", "sm_90", "fake 1", 32

    def __init__(self) -> None:
        self.defines: list[dict[str, str]] = []

    def compile(
        self, source: str, filename: str, headers: Mapping[str, str], defines: Mapping[str, str]
    ) -> bytes:
        self.defines.append(dict(defines))
        return b"\x7fELF" + hashlib.sha256(source.encode()).digest()


def real_compiler():
    """NVRTC for sm_90; skips where it is missing (fails under CI, as test_kernel_compile)."""
    from rocforge_rt.backends.gpu.cuda import NvrtcCompiler

    try:
        return NvrtcCompiler("sm_90")
    except BackendError as exc:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"no NVRTC under CI: {exc}")
        pytest.skip(f"no NVRTC: {exc}")


# --- signatures ----------------------------------------------------------------------------
@pytest.mark.parametrize("source", SOURCES)
def test_every_kernel_parses_to_a_signature_of_launch_argument_types(source: str) -> None:
    text = kernel_source(KERNELS, source)
    parsed = kernel_signatures(text, HEADERS)
    assert list(parsed) == kernel_names(text)
    for kernel, types in parsed.items():
        assert types, f"{kernel} takes no arguments"
        assert set(types) <= set(ARG_TYPES), (kernel, types)


def test_known_kernels_have_the_signatures_their_declarations_state() -> None:
    found = signatures()
    plain_tail = ("i32", "ptr", "ptr")  # epilogue, residual, out
    rope_tail = ("ptr",) * 7 + ("i32",) * 5  # step state, tables, q, KV pool; dims, n_ctx
    assert found["rf_gemv_q4_0_b1_n1"] == GEMV_HEAD + plain_tail
    assert found["rf_gemv_q4_0_b1_n2_swiglu"] == GEMV_HEAD + plain_tail
    assert found["rf_gemv_q4_0_b1_n2_swiglu_q8"] == GEMV_HEAD + plain_tail + ("ptr",)  # q8 out
    assert found["rf_gemv_q8_0_b8_n1_swiglu"] == GEMV_HEAD + plain_tail
    assert found["rf_gemv_q4_0_b1_n2_rope"] == GEMV_HEAD + rope_tail
    assert found["rf_gemv_q4_0_b8_n2_rope"] == GEMV_HEAD + rope_tail
    # the _bulk kernels: their ring's slots a warp last
    assert found["rf_gemv_q4_0_b1_n4_bulk"] == GEMV_HEAD + plain_tail + ("i32",)
    assert found["rf_hold"] == ("ptr", "u32", "u32")  # a volatile flag, target, naps
    assert found["rf_embed_q8_0"] == ("ptr", "i64", "i32", "i32", "ptr", "i32", "ptr")
    assert found["rf_attention_decode_d64"][8] == "f32"  # the score scale
    assert found["rf_sample_advance"] == ("ptr", "i32", "ptr", "ptr", "i32", "i32") + ("ptr",) * 8


def test_a_macro_parameter_list_is_expanded_and_qualifiers_dropped() -> None:
    header = "#define H_RESTRICT __restrict__\n#define H_TAIL float scale, int32_t n\n"
    source = """
    #define K_HEAD const float *H_RESTRICT x, /* a comment */ unsigned int flags
    #define K_PARAMS K_HEAD, long long offset, \\
        const volatile uint32_t* flag, struct rf_rec *RF_RESTRICT rec, float out[], H_TAIL
    // RF_KERNEL void commented_out(double no);
    RF_KERNEL_BOUNDS(256) void k(K_PARAMS) {}
    RF_KERNEL void nothing(void) {}
    """
    assert kernel_signatures(source, {"h.h": header}) == {
        "k": ("ptr", "u32", "i64", "ptr", "ptr", "ptr", "f32", "i32"),
        "nothing": (),
    }


@pytest.mark.parametrize(
    ("declaration", "named"),
    [("int n, double scale", r"parameter 1 \(scale\).*'double'"),
     ("const float* x, uint64_t seed", r"parameter 1 \(seed\).*'uint64_t'"),
     ("int& n", r"parameter 0")],
)  # fmt: skip
def test_a_parameter_without_a_launch_type_is_an_error_naming_kernel_and_parameter(
    declaration: str, named: str
) -> None:
    with pytest.raises(ValueError, match=rf"kernel rf_bad, {named}"):
        kernel_signatures(f"RF_KERNEL void rf_bad({declaration}) {{}}")


def test_every_c_type_maps_to_a_launch_argument_type() -> None:
    assert set(C_ARG_TYPES.values()) <= set(ARG_TYPES)


def test_the_launcher_types_a_launch_by_the_declaration_and_refuses_a_wrong_count(
    tmp_path: Path,
) -> None:
    sources = tmp_path / "kernels"
    sources.mkdir()
    (sources / "k.hip").write_text(
        "RF_KERNEL void rf_k(const float* RF_RESTRICT x, int64_t n, float s) {}\n"
    )
    (sources / "rf_portability.h").write_text(HEADERS["rf_portability.h"])
    library = KernelLibrary(FakeCompiler(), sources, tmp_path / "cache")
    with FakeDriver({"rf_k": ("ptr", "i64", "f32")}) as driver:
        launcher = Launcher(driver, driver.create_stream(), library, LaunchOverheadTracker())
        assert launcher.signatures == {"rf_k": ("ptr", "i64", "f32")}
        launcher.launch(("site",), "rf_k", (1, 1, 1), (32, 1, 1), (4096, -3, 0.5))
        assert driver.log[-1][1:] == ("rf_k", struct.pack("<Qqf", 4096, -3, 0.5))
        for wrong in ((4096, -3), (4096, -3, 0.5, 1)):
            with pytest.raises(ValueError, match=rf"rf_k: .*takes 3 arguments, got {len(wrong)}"):
                launcher.launch(("other",), "rf_k", (1, 1, 1), (32, 1, 1), wrong)


def test_every_call_site_of_the_backend_passes_its_kernels_declared_arguments() -> None:
    """A prompt chunk, sampled and greedy decode steps and timed steps, in every mode,
    over a fake device: every launch packs as many arguments as its kernel declares."""
    launched = set()
    for mode in ("per-kernel-sync", "deferred", "graph"):
        launched |= kernels_of_steps_on_a_fake_device(mode)
    # GEMV rows per warp, MMV warps along k and the prefill attention's head dim aside:
    families = {re.sub(r"_n\d|_k\d_m\d|_d\d+$", "", kernel) for kernel in launched}
    assert families >= {
        "rf_embed_q8_0_split", "rf_quantize_q8_rows", "rf_quantize_q8_tiles", "rf_gemm_q4_0",
        "rf_rope_kv_append", "rf_attention_prefill", "rf_gemv_q4_0_b1_rope", "rf_gemv_q4_0_b8_rope",
        "rf_attention_decode", "rf_gemv_q4_0_b1", "rf_gemv_q4_0_b8_swiglu", "rf_argmax_advance",
        "rf_sample_candidates", "rf_sample_advance", "rf_hold", "rf_mmv_q4_0_t1",
        "rf_mmv_q4_0_t1_swiglu", "rf_mmv_q4_0_t1_rope", "rf_quantize_q8_gemv",
        "rf_gemv_q4_0_b1_swiglu_q8", "rf_attention_fold",
    }  # fmt: skip


def test_an_fp8_kv_pool_takes_the_fp8_form_of_every_kernel_that_reads_or_writes_it() -> None:
    """With kv_dtype="fp8" the same steps launch the _fp8 kernels wherever the KV pool is
    read or written (RoPE + KV-append, attention), with their declared arguments, and no
    kernel of the fp16 pool."""
    launched = kernels_of_steps_on_a_fake_device("graph", kv_dtype="fp8")
    pool = {k for k in launched if re.search(r"rope|rf_attention_(decode|prefill)", k)}
    assert pool and all(kernel.endswith("_fp8") for kernel in pool)
    families = {re.sub(r"_n\d|_k\d_m\d|_d\d+", "", kernel) for kernel in pool}
    assert families == {
        "rf_rope_kv_append_fp8", "rf_attention_prefill_fp8", "rf_gemv_q4_0_b1_rope_fp8",
        "rf_gemv_q4_0_b8_rope_fp8", "rf_attention_decode_fp8", "rf_mmv_q4_0_t1_rope_fp8",
    }  # fmt: skip


def kernels_of_steps_on_a_fake_device(mode: str, kv_dtype: str = "f16") -> set[str]:
    hp = hparams(n_vocab=512)
    sampled = RowSampling.of([Sampler(SamplingParams(temperature=1.0, logprobs=2))] * 2)
    chunk = MMV_MAX_ROWS + 6
    batches = [
        StepBatch.prefill(list(range(chunk)), 0, 0),  # the GEMM path
        StepBatch.prefill(list(range(3)), 0, 1),  # the MMV path
        StepBatch.decode([1], [chunk], [0]),  # one row: the b1 GEMVs
        *[StepBatch.decode([1, 2], [chunk + 1 + i, 3 + i], [0, 1]) for i in range(3)],
        *[StepBatch.decode([1, 2], [chunk + 4 + i, 6 + i], [0, 1], sampled) for i in range(2)],
    ]
    b8 = MatmulTuning(mmv_min_rows=GEMV_MAX_ROWS + 1)  # a few rows on the 8-row GEMVs
    prequantized = dataclasses.replace(b8, gemv_prequant_min_k=0)  # one row quantized once
    runs = [
        (batches, MatmulTuning(), AttentionTuning()),
        (batches[-2:], b8, AttentionTuning()),
        (batches[2:3], prequantized, AttentionTuning()),
        # every decode step folds in its own kernel
        (batches[2:4], prequantized, AttentionTuning(fold_kernel_min_tiles=1)),
    ]
    kernels: set[str] = set()
    for steps, matmul_tuning, attention_tuning in runs:
        with FakeDriver(signatures()) as driver:
            gpu = GpuBackend(
                driver, FakeCompiler(), hp, n_slots=2, n_ctx=128, max_tokens=chunk, mode=mode,
                batch_invariant=True, kv_dtype=kv_dtype, matmul_tuning=matmul_tuning,
                attention_tuning=attention_tuning,
            )  # fmt: skip
            gpu.kernel_timer.enabled, gpu.kernel_timer.every = True, 3
            run_steps(gpu, random_model(gpu, hp, np.random.default_rng(1)), steps)
            kernels |= {kernel for _, kernel, _ in driver.log}
    return kernels


def run_steps(gpu: GpuBackend, model: ModelWeights, batches: list[StepBatch]) -> None:
    for batch in batches:
        gpu.run_step(batch, lambda b: forward(gpu, model, b), want_logits=True)


def model_weights(
    gpu: GpuBackend, hp, tensor: Callable[[int, int, Q], WeightTensor]
) -> ModelWeights:
    """hp.n_layer layers of weights of shape `hp` in `gpu`: each matrix row-stacked from
    `tensor(rows, k, qtype)` (Q4_0, the embedding Q8_0), unit norms."""

    def matrix(*rows: int, k: int = hp.n_embd, qtype: Q = Q.Q4_0) -> DeviceMatrix:
        return gpu.linear(*(tensor(n, k, qtype) for n in rows))

    def norm() -> object:
        return gpu.vector(WeightTensor("g", Q.F32, (hp.n_embd,), np.ones(hp.n_embd, np.float32)))

    layers = [
        LayerWeights(
            norm(),
            matrix(hp.q_dim, hp.kv_dim_k, hp.kv_dim_v),
            matrix(hp.n_embd, k=hp.q_dim),
            norm(),
            matrix(hp.n_ff, hp.n_ff),
            matrix(hp.n_embd, k=hp.n_ff),
        )
        for _ in range(hp.n_layer)
    ]
    table = matrix(hp.n_vocab, qtype=Q.Q8_0)
    return ModelWeights(table, layers, norm(), matrix(hp.n_vocab))


def random_model(gpu: GpuBackend, hp, rng: np.random.Generator) -> ModelWeights:
    return model_weights(gpu, hp, lambda n, k, qtype: weight(rng, n, k, qtype))


def zero_model(gpu: GpuBackend, hp) -> ModelWeights:
    """Zero blocks: what a step launches depends on the shapes alone."""
    block_bytes = {Q.Q4_0: 18, Q.Q8_0: 34}
    return model_weights(
        gpu,
        hp,
        lambda n, k, qtype: WeightTensor(
            "w", qtype, (n, k), np.zeros((n, k // 32 * block_bytes[qtype]), np.uint8)
        ),
    )


@contextlib.contextmanager
def fake_h100(
    hp, mode: str, n_ctx: int = 64, **options: object
) -> Iterator[tuple[GpuBackend, ModelWeights]]:
    """A one-slot backend on a fake device of 132 multiprocessors with thread block
    clusters (an H100's or H200's), with zero weights of shape `hp`; `options` are more of
    GpuBackend's."""
    with FakeDriver(signatures()) as driver:
        driver.info = dataclasses.replace(driver.info, multiprocessors=132, total_memory=8 << 30)
        driver.supports_clusters = True
        gpu = GpuBackend(driver, FakeCompiler(), hp, n_slots=1, n_ctx=n_ctx, max_tokens=4,
                         mode=mode, batch_invariant=True, **options)  # fmt: skip
        yield gpu, zero_model(gpu, hp)


def decode_step_stats(hp, mode: str = "deferred") -> dict:
    """Runtime stats of one greedy decode step of one row after a first (a graph's capture),
    and of the step after it where it was issued ahead, on fake_h100."""
    with fake_h100(hp, mode) as (gpu, model):

        def step(ahead: bool) -> StepOutput:
            batch = StepBatch.decode([1], [5], [0])
            return gpu.run_step(batch, lambda b: forward(gpu, model, b), False, ahead=ahead)

        step(ahead=False)
        gpu.reset_runtime_stats()
        if step(ahead=True).ahead:
            gpu.take_ahead(again=False)
        return gpu.runtime_stats()


@pytest.mark.parametrize(
    ("shape", "kernels"), [("smollm2-135m", 153), ("llama-1b", 100), ("llama-8b", 228)]
)
def test_a_decode_step_of_each_benchmarked_shape_runs_the_kernels_the_docs_state(
    shape: str, kernels: int
) -> None:
    """One-row greedy decode on a 132-multiprocessor device with clusters: 153 kernels a
    step for the SmolLM2-135M shape, 100 for Llama-1B's, 228 for Llama-8B's (docs/architecture.md),
    from the counts of one layer and of two (the weights of all would not fit a test)."""
    s = SHAPES[shape]
    hp = hparams(n_embd=s.n_embd, n_ff=s.n_ff, n_head=s.n_head, n_head_kv=s.n_head_kv,
                 head_dim=s.head_dim_k, n_vocab=512)  # fmt: skip
    one, two = (
        decode_step_stats(dataclasses.replace(hp, n_layer=n))["kernels_per_step"] for n in (1, 2)
    )
    assert one + (s.n_layer - 1) * (two - one) == kernels


def test_a_step_counts_the_kernels_it_ran_whether_launched_or_replayed() -> None:
    """`kernels_per_step`: in deferred mode the launches of a decode step; in graph mode,
    where a step is one replay of its graph, the same count, for a step issued ahead
    (pipelined decode) too."""
    hp = hparams(n_vocab=512)
    deferred, graph = decode_step_stats(hp, "deferred"), decode_step_stats(hp, "graph")
    assert deferred["steps"] == 1 and graph["steps"] == graph["ahead_taken"] + 1 == 2
    assert deferred["kernels_per_step"] == deferred["launches_per_step"] >= 7  # 5 a layer
    assert graph["kernels_per_step"] == deferred["kernels_per_step"]
    assert graph["launches_per_step"] < graph["kernels_per_step"]


def test_each_step_samples_into_its_readback_set_and_only_logits_are_copied_back() -> None:
    """The argmax writes a step's tokens and log-probabilities straight into the mapped host
    memory of the step's readback set, the two sets taken in turn (a step issued ahead takes
    the other one, through its own graph); a step copies back only the logits it asks for."""
    hp = hparams(n_vocab=512)
    with fake_h100(hp, "graph") as (gpu, model):
        copies = []
        gpu.driver.copy_dtoh = lambda *args, **kwargs: copies.append(args)

        def step(want_logits: bool, ahead: bool) -> StepOutput:
            batch = StepBatch.decode([1], [5], [0])
            return gpu.run_step(batch, lambda b: forward(gpu, model, b), want_logits, ahead)

        step(False, ahead=False)
        assert step(False, ahead=True).ahead
        gpu.take_ahead(again=False)
        assert copies == []
        step(True, ahead=False)
        assert [dst for dst, *_ in copies] == [gpu.workspace.logits_host]
        types = signatures()["rf_argmax_advance"]
        layout = "<" + "".join(ARG_TYPES[t] for t in types)  # the fake packs them unpadded
        sampled_into = [  # the arguments: logits, n_vocab, tokens, positions, sampled, ...
            struct.unpack(layout, args)[4]
            for _, kernel, args in gpu.driver.log
            if kernel == "rf_argmax_advance"
        ]
    sets = [readback.tokens.device_ptr for readback in gpu.workspace.readbacks]
    assert sampled_into == [sets[0], sets[1], sets[0], sets[1]]


def test_a_timed_step_that_fails_while_issuing_opens_its_gate_and_leaves_no_settings() -> None:
    """A step the kernel timer samples is issued behind the gate with its launches timed;
    when its forward raises, the gate is opened (what was queued runs) and the launches
    after it are made as between steps, untimed, and the next step runs."""
    hp = hparams(n_vocab=512)
    with fake_h100(hp, "deferred") as (gpu, model):
        gpu.kernel_timer.enabled, gpu.kernel_timer.every = True, 1

        def fails(batch: StepBatch) -> object:
            forward(gpu, model, batch)
            assert gpu.launcher.settings.timer is gpu.kernel_timer
            raise BackendError("lost")

        with pytest.raises(BackendError, match="lost"):
            gpu.run_step(StepBatch.decode([1], [5], [0]), fails, False)
        assert gpu.workspace.gate.view(np.uint32, 1)[0] == 1
        assert gpu.launcher.settings == BETWEEN_STEPS
        output = gpu.run_step(StepBatch.decode([1], [5], [0]), lambda b: forward(gpu, model, b),
                              False)  # fmt: skip
        assert len(output.tokens) == 1


def test_greedy_and_drawn_decode_steps_in_turn_replay_their_graphs_without_recapturing() -> None:
    """Greedy decode graphs and those of steps that draw differ in one argument of the argmax
    (whether it advances the step state), so they launch it through handles of their own:
    going back and forth captures each graph once (one a readback set) and re-captures none."""
    hp = hparams(n_vocab=512)
    drawn = RowSampling.of([Sampler(SamplingParams(temperature=1.0, seed=3))])
    with fake_h100(hp, "graph") as (gpu, model):
        for position in range(5, 14):
            sampling = (drawn,) if position % 3 == 2 else ()
            batch = StepBatch.decode([1], [position], [0], *sampling)
            gpu.run_step(batch, lambda b: forward(gpu, model, b), False)
        assert gpu.runtime_stats()["graph_captures"] == 4


def test_pipelined_decode_past_the_fold_threshold_takes_a_graph_with_a_fold_kernel_a_layer():
    """A decode step whose context reaches `fold_kernel_min_tiles` key tiles folds its
    attention in rf_attention_fold: one more kernel a layer, in a graph of its own. The
    step issued ahead of the first such step is not issued (its graph is not captured yet);
    the step that then captures it is followed by steps issued ahead again."""
    hp = hparams(n_vocab=512)
    folds_from_64 = AttentionTuning(fold_kernel_min_tiles=2)  # from position 64 on
    with fake_h100(hp, "graph", n_ctx=256, attention_tuning=folds_from_64) as (gpu, model):
        kernels, ahead = [], []
        output = gpu.run_step(StepBatch.decode([1], [61], [0]), lambda b: forward(gpu, model, b),
                              False, ahead=True)  # fmt: skip
        kernels.append(gpu.executor.kernels)
        for _ in range(3):  # positions 62, 63 issued ahead; 64 not
            ahead.append(output.ahead)
            if not output.ahead:
                break
            output = gpu.take_ahead(again=True)
            kernels.append(gpu.executor.kernels)
        output = gpu.run_step(StepBatch.decode([1], [64], [0]), lambda b: forward(gpu, model, b),
                              False, ahead=True)  # fmt: skip
        kernels.append(gpu.executor.kernels)
        ahead.append(output.ahead)
        gpu.take_ahead(again=False)
        kernels.append(gpu.executor.kernels)
    per_step = np.diff([0, *kernels])
    assert ahead == [True, True, False, True]
    assert per_step.tolist() == [per_step[0]] * 3 + [per_step[0] + hp.n_layer] * 2


def one_decode_step(hp, **capabilities: bool) -> tuple[list[LaunchHandle], FakeDriver]:
    """The launch handles of one greedy decode step of one row in deferred mode on a fake
    device with the driver's `capabilities` (supports_bulk_copy=True, ...), and the driver."""
    with FakeDriver(signatures()) as driver:
        for name, value in capabilities.items():
            setattr(driver, name, value)
        gpu = GpuBackend(driver, FakeCompiler(), hp, n_slots=1, n_ctx=64, max_tokens=4,
                         mode="deferred", batch_invariant=True)  # fmt: skip
        model = random_model(gpu, hp, np.random.default_rng(1))
        gpu.run_step(StepBatch.decode([1], [5], [0]), lambda b: forward(gpu, model, b), True)
        return list(gpu.launcher.handles.values()), driver


def test_the_lm_head_takes_the_bulk_kernel_where_the_device_has_bulk_copies() -> None:
    """Where the device has bulk copies, the one-row Q4_0 GEMVs of at least `gemv_bulk_min_n`
    outputs with no epilogue of their own over k a multiple of GEMV_BULK_K_MULTIPLE (here
    the LM head alone) launch their _bulk kernel, with a ring of as many slots a warp as
    fit the device's shared memory a block (48 KiB here: one)."""
    hp = hparams(n_embd=512, n_head=8, n_head_kv=2, n_vocab=MatmulTuning.gemv_bulk_min_n)
    assert hp.n_embd % GEMV_BULK_K_MULTIPLE == 0
    handles, _ = one_decode_step(hp, supports_bulk_copy=True)
    (head,) = [h for h in handles if h.name.endswith("_bulk")]
    assert struct.unpack_from("<i", head.packed_bytes, head.layout.offsets[2])[0] == hp.n_vocab
    assert struct.unpack_from("<i", head.packed_bytes, head.layout.offsets[-1])[0] == 1  # ring
    assert head.shared_bytes <= FAKE_INFO.max_shared_per_block < MatmulTuning.gemv_bulk_shared


def test_the_gate_up_gemv_quantizes_its_row_in_a_cluster_where_the_device_has_clusters() -> None:
    """Where the device has thread block clusters, the one-row gate|up GEMV over a row of
    2048 columns launches its _cl kernel in clusters of `gemv_cluster_blocks` (2), with no
    rf_quantize_q8_gemv before it; the Q|K|V GEMV and the LM head keep theirs."""
    handles, driver = one_decode_step(hparams(n_embd=2048, n_head=32, n_head_kv=8),
                                      supports_clusters=True)  # fmt: skip
    launched = [h.name for h in handles]
    clusters = [cluster for *_, cluster in driver.prepared if cluster > 1]
    assert [name for name in launched if name.endswith("_cl")] == ["rf_gemv_q4_0_b1_n2_swiglu_cl"]
    assert launched.count("rf_quantize_q8_gemv") == 2
    assert clusters == [MatmulTuning.gemv_cluster_blocks]


def test_a_bulk_gemv_ring_takes_the_slots_its_budget_fits_up_to_the_chunks_a_warp_takes() -> None:
    """A _bulk GEMV's ring: past the fold buffers (rounded up to 16 bytes), as many chunk
    slots a warp as fit the budget, no more than the chunks a warp takes, at least one."""
    slot = gemv_ring_slot_bytes("q4_0", 4, 32)
    budget = 100 << 10
    # an LM head of 128,256 rows x 4,096 columns on 264 blocks: 32 chunks a warp
    slots, shared = gemv_ring("q4_0", 4, 4096, 128256, 264, 32, 1000, budget)
    assert slots == (budget - 1008) // slot < 32
    assert shared == 1008 + slots * slot
    # one row group a warp over a single chunk of columns: one slot, whatever the budget
    assert gemv_ring("q4_0", 4, 256, 4 * 8, 1, 32, 0, budget) == (1, slot)
    # a budget under one slot still gets one
    assert gemv_ring("q4_0", 4, 4096, 128256, 264, 32, 0, slot - 1) == (1, slot)


CHUNK = MMV_MAX_ROWS + 6  # a prompt chunk past the MMV's rows: the GEMM path


class RecordingGemm:
    """Stands in for cuBLAS/hipBLAS: records each GEMM's arguments."""

    library = "fakeblas"

    def __init__(self, *args: object) -> None:
        self.calls: list[dict] = []

    def gemm(self, **kwargs: object) -> None:
        self.calls.append(kwargs)


def test_a_prompt_chunk_on_the_vendor_gemm_multiplies_each_matrix_once_over_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not batch invariant, a 70-row chunk multiplies Q|K|V, O, gate|up and down once each
    (the residual ones accumulating, gate|up into fp16) and the LM head in slabs of the fp16
    weight scratch that cover its rows once, each into its own band of output columns."""
    blas = RecordingGemm()
    monkeypatch.setattr("rocforge_rt.backends.gpu.backend.open_vendor_gemm", lambda *a: blas)
    hp = hparams(n_vocab=8192)
    with FakeDriver(signatures()) as driver:
        every_size = MatmulTuning(vendor_min_flop=0)  # this small model's matmuls too
        gpu = GpuBackend(driver, FakeCompiler(), hp, n_slots=2, n_ctx=128, max_tokens=CHUNK,
                         matmul_tuning=every_size)  # fmt: skip
        assert not gpu.batch_invariant
        model = random_model(gpu, hp, np.random.default_rng(1))
        batch = StepBatch.prefill(list(range(CHUNK)), 0, 0, "all")
        gpu.run_step(batch, lambda b: forward(gpu, model, b), want_logits=True)
        kernels = {kernel for _, kernel, _ in driver.log}
        w16, w16_bytes, logits = (
            gpu.workspace.w16.ptr,
            gpu.workspace.w16.nbytes,
            gpu.workspace.logits.ptr,
        )
    qkv = hp.q_dim + hp.kv_dim_k + hp.kv_dim_v
    # (n, out pitch, accumulate, fp16 out) of Q|K|V, O, gate|up, down:
    layer = [(qkv, qkv, False, False), (hp.n_embd, hp.n_embd, True, False),
             (2 * hp.n_ff, 2 * hp.n_ff, False, True), (hp.n_embd,) * 2 + (True, False)]  # fmt: skip
    got = [(c["n"], c["out_pitch"], c["accumulate"], c["out_f16"]) for c in blas.calls]
    assert got[:4] == layer
    assert all(c["rows"] == CHUNK and c["w_ptr"] == w16 for c in blas.calls)
    head = blas.calls[4:]
    slab = w16_bytes // (2 * hp.n_embd)
    assert [c["n"] for c in head] == [slab, slab, hp.n_vocab - 2 * slab]
    offsets = [c["out_ptr"] - logits for c in head]
    assert offsets == [0, slab * 4, 2 * slab * 4] and {c["out_pitch"] for c in head} == {8192}
    assert {"rf_rows_f16", "rf_dequant_f16_q4_0", "rf_swiglu_f16"} <= kernels
    assert not kernels & {"rf_quantize_q8_rows", "rf_gemm_q4_0"}


def test_matmuls_below_vendor_min_flop_take_the_int8_gemm(monkeypatch: pytest.MonkeyPatch):
    """Not batch invariant, a prompt chunk's matmul takes the vendor GEMM from `vendor_min_flop`
    on; smaller ones (here: 70 rows x the LM head of 8192 x 576 = 0.66 GFLOP) the int8 GEMM."""
    blas = RecordingGemm()
    monkeypatch.setattr("rocforge_rt.backends.gpu.backend.open_vendor_gemm", lambda *a: blas)
    hp = hparams(n_vocab=8192)
    with FakeDriver(signatures()) as driver:
        head_flop = 2 * CHUNK * 8192 * 576  # the LM head's, the biggest
        gpu = GpuBackend(driver, FakeCompiler(), hp, n_slots=2, n_ctx=128, max_tokens=CHUNK,
                         matmul_tuning=MatmulTuning(vendor_min_flop=head_flop))  # fmt: skip
        model = random_model(gpu, hp, np.random.default_rng(1))
        batch = StepBatch.prefill(list(range(CHUNK)), 0, 0, "all")
        gpu.run_step(batch, lambda b: forward(gpu, model, b), want_logits=True)
        kernels = [kernel for _, kernel, _ in driver.log]
    assert {c["out_pitch"] for c in blas.calls} == {8192}  # the LM head alone (in slabs)
    assert sum(c["n"] for c in blas.calls) == 8192
    assert kernels.count("rf_gemm_q4_0") == 4  # Q|K|V, O, gate|up, down


def test_every_mmv_shape_is_declared_for_its_tiles_up_to_the_mmv_rows() -> None:
    assert all(mmv_shapes(tiles) for tiles in (1, 2, 4, 8))
    assert {s.tiles for s in MMV_SHAPES} == {1, 2, 4, 8}
    assert 8 * mmv_tiles(MMV_MAX_ROWS) == MMV_MAX_ROWS


@pytest.mark.parametrize("source", sorted(GENERATED_KERNELS))
def test_every_generated_kernel_is_declared_once_after_its_source(source: str) -> None:
    """A source's table rows are appended to it as kernels of distinct names, after the
    file's own (so a compile error's line numbers are the file's)."""
    rows = GENERATED_KERNELS[source]
    own = kernel_names((KERNELS / source).read_text())
    assert kernel_names(kernel_source(KERNELS, source)) == own + [k.name for k in rows]
    assert len({k.name for k in rows}) == len(rows)
    assert generated_source(source).count("RF_KERNEL_BOUNDS(") == len(rows)


def test_the_generated_kernels_are_part_of_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = KernelLibrary(FakeCompiler(), cache_dir=tmp_path)
    before = library.load("rope_kv.hip")
    rows = {**GENERATED_KERNELS, "rope_kv.hip": GENERATED_KERNELS["rope_kv.hip"][:1]}
    monkeypatch.setattr("rocforge_rt.backends.gpu.kernel_variants.GENERATED_KERNELS", rows)
    after = library.load("rope_kv.hip")
    assert after.key != before.key and after.kernels == before.kernels[:1]


@pytest.mark.parametrize(
    ("n_ff", "spread"),
    [(8192, True), (14336, False), (16896, True), (4352, False), (1536, False)],
)  # 32-blocks on 132 SMs: Llama-3.2-1B 256 (1.03x the mean at most), Llama-3-8B 448 (1.18x),
# 528 (1x), 136 (1.94x), SmolLM2 48 (fewer than the SMs)
def test_a_gate_up_quantizes_for_the_down_projection_where_its_32_blocks_spread_evenly(
    n_ff: int, spread: bool
) -> None:
    caps = DeviceCaps(32, 132, 48 << 10, clusters=False, bulk_copy=False)
    assert swiglu_blocks_spread(n_ff, caps, MatmulTuning()) == spread
    # the down projection's blocks quantize it
    assert not swiglu_blocks_spread(n_ff, caps, MatmulTuning(gemv_prequant_min_k=n_ff + 1))


# --- constants -----------------------------------------------------------------------------
def test_every_compile_gets_the_kernel_constants_and_the_warp_size(tmp_path: Path) -> None:
    compiler = FakeCompiler()
    KernelLibrary(compiler, cache_dir=tmp_path).load("gate.hip")
    expected = {name: str(value) for name, value in KERNEL_DEFINES.items()}
    assert compiler.defines == [{**expected, "RF_WARP_SIZE": "32"}]


def test_the_kernel_constants_are_part_of_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = FakeCompiler()
    library = KernelLibrary(compiler, cache_dir=tmp_path)
    before = library.load("gate.hip")
    monkeypatch.setitem(KERNEL_DEFINES, "RF_GEMV_MAX_ROWS", 16)
    after = library.load("gate.hip")
    assert after.key != before.key and library.compiles == 2
    assert compiler.defines[-1]["RF_GEMV_MAX_ROWS"] == "16"


def test_a_caller_cannot_redefine_a_kernel_constant(tmp_path: Path) -> None:
    library = KernelLibrary(FakeCompiler(), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="RF_QK comes from kernel_constants.py"):
        library.load("gate.hip", defines={"RF_QK": 16})
    library.load("gate.hip", defines={"RF_QK": kernel_constants.QK})  # the same value is fine


def test_the_sampling_rules_numbers_are_the_kernels() -> None:
    from rocforge_rt.step.sampling import MAX_LOGPROBS, WEIGHT_SCALE

    assert KERNEL_DEFINES["RF_SAMPLE_MAX_TOP"] == MAX_LOGPROBS
    assert np.float32(float(str(KERNEL_DEFINES["RF_SAMPLE_WEIGHT_SCALE"]).rstrip("f"))) == (
        WEIGHT_SCALE
    )


def test_a_source_using_the_constants_compiles_through_the_library_with_their_values(
    tmp_path: Path,
) -> None:
    """Every constant reaches the compiler with the value Python holds."""
    checks = "\n".join(
        f'static_assert({name} == {value}, "{name}");' for name, value in KERNEL_DEFINES.items()
    )
    sources = tmp_path / "kernels"
    sources.mkdir()
    for name, text in HEADERS.items():
        (sources / name).write_text(text)
    (sources / "uses.hip").write_text(
        f'#include "rf_portability.h"\n#include "rf_constants.h"\n{checks}\n'
        "RF_KERNEL void rf_uses(int* out) { *out = RF_GEMV_MAX_ROWS; }\n"
    )
    library = KernelLibrary(real_compiler(), sources, tmp_path / "cache")
    assert library.load("uses.hip").code.startswith(b"\x7fELF")


def test_a_compile_without_the_constants_fails_loudly() -> None:
    compiler = real_compiler()
    source = '#include "rf_portability.h"\n#include "rf_constants.h"\nRF_KERNEL void k() {}\n'
    with pytest.raises(KernelCompileError, match="kernel constants missing"):
        compiler.compile(source, "lone.hip", HEADERS, {"RF_WARP_SIZE": compiler.warp_size})


def test_rf_constants_h_checks_exactly_the_kernel_constants() -> None:
    checked = set(re.findall(r"!defined\((\w+)\)", HEADERS["rf_constants.h"]))
    assert checked == set(KERNEL_DEFINES)


def test_no_kernel_file_defines_a_kernel_constant() -> None:
    for path in sorted(KERNELS.iterdir()):
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", path.read_text(), re.M))
        assert not defined & set(KERNEL_DEFINES), (path.name, sorted(defined & set(KERNEL_DEFINES)))


# --- records the host lays out -------------------------------------------------------------
C_DTYPES = {"float": "<f4", "int": "<i4", "uint32_t": "<u4", "uint64_t": "<u8"}


def record_dtype(struct_name: str) -> np.dtype:
    fields = struct_fields((KERNELS / "sampling.hip").read_text(), struct_name)
    return np.dtype([(name, C_DTYPES[c_type]) for c_type, name in fields], align=True)


def test_rf_sample_params_is_row_params_dtype_field_by_field() -> None:
    device = record_dtype("rf_sample_params")
    assert device.names == ROW_PARAMS_DTYPE.names
    assert [device.fields[n][:2] for n in device.names] == [
        ROW_PARAMS_DTYPE.fields[n][:2] for n in ROW_PARAMS_DTYPE.names
    ]
    assert device.itemsize == ROW_PARAMS_DTYPE.itemsize


def test_the_argmax_records_have_the_sizes_the_host_allocates() -> None:
    assert record_dtype("rf_argmax_part").itemsize == kernel_constants.ARGMAX_PART_BYTES
    assert record_dtype("rf_row_stats").itemsize == kernel_constants.ROW_STATS_BYTES

"""Kernel variants as data: one table a kernel family, from which its kernels are made.

A family's template lives in its kernels/*.hip source, with the macros of its parameter
list and its call; each row below is one kernel of it: its template parameters, its name
(`name`, the one place a name is spelled) and its C definition (`definition`), a
one-line wrapper ``RF_KERNEL_BOUNDS(bounds) void name(PARAMS) { call; }``.
`generated_source` gives a source's wrappers; the kernel library appends them to the
source before compiling it and reading its declarations (kernel_library.py
`kernel_source`), so they are part of its cache key, its signatures and its exports.
A call site picks a row (e.g. `gemv_kernel`) and launches `row.name`.

Adding a variant is one row of its table. The launch shape rules of a row that depend
on it alone (block, sums folded, blocks) are its methods; the rest is planned in
matmul_plan.py and the op modules.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from rocforge_rt.backends.gpu.kernel_constants import GEMV_MAX_ROWS, GEMV_THREADS, MMV_MAX_ROWS
from rocforge_rt.errors import BackendError

GENERATED_HEADER = "// Generated from rocforge_rt/backends/gpu/kernel_variants.py.\n"


def _wrapper(bounds: str, name: str, params: str, call: str) -> str:
    """The C definition of one generated kernel."""
    return f"RF_KERNEL_BOUNDS({bounds}) void {name}({params}) {{\n    {call};\n}}\n"


def _pool(kv_fp8: bool) -> str:
    """A kernel name's KV pool suffix: _fp8 for an fp8 pool, none for fp16."""
    return "_fp8" if kv_fp8 else ""


# --- GEMV (kernels/gemv.hip) ---------------------------------------------------------------
_GEMV_FORMATS = {"q4_0": "rf_q4_0_format", "q8_0": "rf_q8_0_format"}


@dataclass(frozen=True)
class GemvKernel:
    """An rf_gemv kernel: rf_gemv_<fmt>_b<rows>_n<no>[_<epilogue>][_fp8][_q8][_bulk][_cl].

    `rows` activation rows (1, or GEMV_MAX_ROWS: the b8 kernels), `no` output rows a
    warp; `epilogue` "" (store or add the residual), "swiglu" or "rope" (the QKV
    projection: RoPE + KV-append, `kv_fp8` into an fp8 pool); `q8_out` (SwiGLU) also
    writes the down projection's q8 row, its blocks owning 32-blocks of outputs;
    `bulk` takes the weights through rings in shared memory (an extra `ring` argument);
    `cluster` quantizes the row across a thread block cluster's blocks."""

    fmt: str
    rows: int
    no: int
    epilogue: str = ""
    q8_out: bool = False
    bulk: bool = False
    cluster: bool = False
    kv_fp8: bool = False

    @functools.cached_property
    def name(self) -> str:
        epilogue = f"_{self.epilogue}" if self.epilogue else ""
        return (
            f"rf_gemv_{self.fmt}_b{self.rows}_n{self.no}{epilogue}{_pool(self.kv_fp8)}"
            f"{'_q8' * self.q8_out}{'_bulk' * self.bulk}{'_cl' * self.cluster}"
        )

    @property
    def sums(self) -> int:
        """Sums a warp folds at once: its weight rows (2 * NO with SwiGLU) x its
        activation rows."""
        return (2 * self.no if self.epilogue == "swiglu" else self.no) * self.rows

    def blocks(self, n_out: int, warp_size: int) -> int:
        """Blocks that cover `n_out` outputs: a warp a row group, or with `q8_out` a
        block a 32-block of outputs."""
        if self.q8_out:
            return n_out // 32
        return math.ceil(math.ceil(n_out / self.no) / (GEMV_THREADS // warp_size))

    def definition(self) -> str:
        fmt = _GEMV_FORMATS[self.fmt]
        rcap = "1" if self.rows == 1 else "RF_GEMV_MAX_ROWS"
        swiglu = "true" if self.epilogue == "swiglu" else "false"
        q8 = "true" if self.q8_out else "false"
        params = "RF_GEMV_SWIGLU_Q8_PARAMS" if self.q8_out else "RF_GEMV_PARAMS"
        if self.bulk:
            params, call = "RF_GEMV_BULK_PARAMS", f"RF_GEMV_BULK_CALL({fmt}, {self.no})"
        elif self.cluster:
            xq_out = "xq_out" if self.q8_out else "nullptr"
            call = f"RF_GEMV_SWIGLU_CL_CALL({fmt}, {self.no}, {q8}, {xq_out})"
        elif self.q8_out:
            call = f"RF_GEMV_SWIGLU_Q8_CALL({fmt}, {self.no})"
        elif self.epilogue == "rope":
            params = "RF_GEMV_ROPE_PARAMS"
            call = f"RF_GEMV_ROPE_CALL({fmt}, {self.no}, {rcap}, {int(self.kv_fp8)})"
        else:
            call = f"RF_GEMV_CALL({fmt}, {self.no}, {swiglu}, {rcap})"
        return _wrapper("RF_GEMV_THREADS", self.name, params, call)


_B8 = GEMV_MAX_ROWS
GEMV_KERNELS = (
    # Q4_0, one activation row (decode).
    GemvKernel("q4_0", 1, 1),
    GemvKernel("q4_0", 1, 2),
    GemvKernel("q4_0", 1, 4),
    GemvKernel("q4_0", 1, 1, "swiglu"),
    GemvKernel("q4_0", 1, 1, "swiglu", q8_out=True),
    GemvKernel("q4_0", 1, 2, "swiglu"),
    GemvKernel("q4_0", 1, 2, "swiglu", q8_out=True),
    # Q4_0, up to GEMV_MAX_ROWS activation rows.
    GemvKernel("q4_0", _B8, 1),
    GemvKernel("q4_0", _B8, 1, "swiglu"),
    # Q4_0 with RoPE + KV-append; the pool's format is compile-time (a runtime switch
    # spilled the 1B shape's Q|K|V kernel).
    GemvKernel("q4_0", 1, 2, "rope"),
    GemvKernel("q4_0", 1, 4, "rope"),
    GemvKernel("q4_0", _B8, 2, "rope"),
    GemvKernel("q4_0", 1, 2, "rope", kv_fp8=True),
    GemvKernel("q4_0", 1, 4, "rope", kv_fp8=True),
    GemvKernel("q4_0", _B8, 2, "rope", kv_fp8=True),
    # Q4_0 one-row gate|up whose cluster's blocks quantize the row together.
    GemvKernel("q4_0", 1, 1, "swiglu", cluster=True),
    GemvKernel("q4_0", 1, 2, "swiglu", cluster=True),
    GemvKernel("q4_0", 1, 1, "swiglu", q8_out=True, cluster=True),
    GemvKernel("q4_0", 1, 2, "swiglu", q8_out=True, cluster=True),
    # Q4_0, one activation row, the weights through rf_weight_ring.
    GemvKernel("q4_0", 1, 1, bulk=True),
    GemvKernel("q4_0", 1, 2, bulk=True),
    GemvKernel("q4_0", 1, 4, bulk=True),
    # Q8_0.
    GemvKernel("q8_0", 1, 1),
    GemvKernel("q8_0", 1, 2),
    GemvKernel("q8_0", 1, 1, "swiglu"),
    GemvKernel("q8_0", 1, 1, "swiglu", q8_out=True),
    GemvKernel("q8_0", _B8, 1),
    GemvKernel("q8_0", _B8, 1, "swiglu"),
)
_GEMV_DECLARED = frozenset(GEMV_KERNELS)


def gemv_kernel(fmt: str, rows: int, no: int, epilogue: str = "", **options: bool) -> GemvKernel:
    """The declared GEMV kernel of these parameters; BackendError when none is."""
    kernel = GemvKernel(fmt, rows, no, epilogue, **options)
    if kernel not in _GEMV_DECLARED:
        raise BackendError(f"no GEMV kernel {kernel.name} (kernel_variants.py GEMV_KERNELS)")
    return kernel


def gemv_rows_per_warp(fmt: str, epilogue: str, rows: int) -> tuple[int, ...]:
    """Output rows a warp of the plain (fp16 pool, register-fed) GEMV kernels of `rows`
    activation rows may take, narrowest first."""
    return tuple(
        sorted(
            k.no
            for k in GEMV_KERNELS
            if (k.fmt, k.epilogue, k.rows) == (fmt, epilogue, rows)
            and not (k.q8_out or k.bulk or k.cluster or k.kv_fp8)
        )
    )


# --- MMV (kernels/gemm.hip) ----------------------------------------------------------------
_MMV_FORMATS = {"q4_0": "rf_mmv_q4_0", "q8_0": "rf_mmv_q8_0"}
_MMV_EPILOGUES = {"": "RF_MMV_PLAIN", "swiglu": "RF_MMV_SWIGLU"}


@dataclass(frozen=True)
class MmvShape:
    """A block's warps: KS * MS of them split k KS ways and its TW * MS 8-row tiles MS ways."""

    tw: int
    ks: int
    ms: int

    @property
    def tiles(self) -> int:
        return self.tw * self.ms

    @property
    def warps(self) -> int:
        return self.ks * self.ms


# By tiles (TW * MS), fewest warps first; each is declared for every MMV form below. Few
# blocks (Q|K|V, O, down) want 8 or more warps along k, many blocks (gate|up, the LM
# head) few (docs/performance.md).
MMV_SHAPES = (
    MmvShape(1, 2, 1),
    MmvShape(1, 8, 1),
    MmvShape(2, 2, 1),
    MmvShape(2, 8, 1),
    MmvShape(1, 8, 2),
    MmvShape(4, 1, 1),
    MmvShape(4, 8, 1),
    MmvShape(2, 8, 2),
    MmvShape(8, 1, 1),
    MmvShape(4, 8, 2),
)
# (format, epilogue, fp8 pool) of the MMV kernels: each takes every shape.
MMV_FORMS = (
    ("q4_0", "", False),
    ("q4_0", "swiglu", False),
    ("q4_0", "rope", False),
    ("q4_0", "rope", True),
    ("q8_0", "", False),
    ("q8_0", "swiglu", False),
)


def mmv_tiles(rows: int) -> int:
    """The 8-row tiles of the narrowest MMV shapes that take `rows` activation rows."""
    return min(s.tiles for s in MMV_SHAPES if 8 * s.tiles >= rows)


def mmv_shapes(tiles: int) -> tuple[MmvShape, ...]:
    """The MMV shapes of `tiles` 8-row tiles, fewest warps first."""
    return tuple(s for s in MMV_SHAPES if s.tiles == tiles)


@dataclass(frozen=True)
class MmvKernel:
    """An rf_mmv kernel: rf_mmv_<fmt>_t<TW>_k<KS>_m<MS>[_<epilogue>][_fp8], block 32 * KS *
    MS, for up to 8 * TW * MS activation rows; `epilogue` as `GemvKernel`'s."""

    fmt: str
    shape: MmvShape
    epilogue: str = ""
    kv_fp8: bool = False

    @functools.cached_property
    def name(self) -> str:
        s = self.shape
        epilogue = f"_{self.epilogue}" if self.epilogue else ""
        return f"rf_mmv_{self.fmt}_t{s.tw}_k{s.ks}_m{s.ms}{epilogue}{_pool(self.kv_fp8)}"

    @property
    def threads(self) -> int:
        return 32 * self.shape.warps

    def definition(self) -> str:
        fmt, s = _MMV_FORMATS[self.fmt], self.shape
        if self.epilogue == "rope":
            params = "RF_MMV_ROPE_PARAMS"
            call = f"RF_MMV_ROPE_CALL({fmt}, {s.tw}, {s.ks}, {s.ms}, {int(self.kv_fp8)})"
        else:
            params = "RF_MMV_PARAMS"
            call = f"RF_MMV_CALL({fmt}, {_MMV_EPILOGUES[self.epilogue]}, {s.tw}, {s.ks}, {s.ms})"
        return _wrapper(str(self.threads), self.name, params, call)


MMV_KERNELS = tuple(
    MmvKernel(fmt, shape, epilogue, fp8) for fmt, epilogue, fp8 in MMV_FORMS for shape in MMV_SHAPES
)
assert all(8 * s.tiles <= MMV_MAX_ROWS for s in MMV_SHAPES)


# --- The int8 GEMM and its quantize prologue (kernels/gemm.hip) ----------------------------
@dataclass(frozen=True)
class GemmKernel:
    """rf_gemm_<fmt>: the prompt chunks' int8 GEMM."""

    fmt: str

    @functools.cached_property
    def name(self) -> str:
        return f"rf_gemm_{self.fmt}"

    def definition(self) -> str:
        call = f"rf_gemm<rf_gemm_fmt_{self.fmt}>(RF_GEMM_ARGS)"
        return _wrapper("RF_GEMM_THREADS", self.name, "RF_GEMM_PARAMS", call)


@dataclass(frozen=True)
class QuantizeRowsKernel:
    """rf_quantize_q8_<layout>: rows normalized and quantized to q8 in the GEMM's
    ("rows") or the MMV's ("tiles") layout."""

    layout: str

    @functools.cached_property
    def name(self) -> str:
        return f"rf_quantize_q8_{self.layout}"

    def definition(self) -> str:
        call = f"rf_quantize_q8<rf_q8_{self.layout}_layout>(RF_Q8_QUANTIZE_ARGS)"
        return _wrapper("RF_Q8_THREADS", self.name, "RF_Q8_QUANTIZE_PARAMS", call)


# --- Attention (kernels/attention.hip) and RoPE + KV-append (kernels/rope_kv.hip) ----------
ATTENTION_HEAD_DIMS = (32, 64, 96, 128)


@dataclass(frozen=True)
class AttentionKernel:
    """rf_attention_<op>_d<head_dim>[_fp8]: `op` "decode", "prefill" or "fold" (the decode
    kernel's parts folded apart; it reads no pool, so it has no fp8 form)."""

    op: str
    head_dim: int
    kv_fp8: bool = False

    @functools.cached_property
    def name(self) -> str:
        return f"rf_attention_{self.op}_d{self.head_dim}{_pool(self.kv_fp8)}"

    def definition(self) -> str:
        op, args = self.op.upper(), f"{self.head_dim}"
        if self.op != "fold":
            args += f", {str(self.kv_fp8).lower()}"
        return _wrapper(
            "RF_ATTN_THREADS", self.name, f"RF_ATTN_{op}_PARAMS", f"RF_ATTN_{op}({args})"
        )


ATTENTION_KERNELS = (
    *(AttentionKernel("decode", d, fp8) for fp8 in (False, True) for d in ATTENTION_HEAD_DIMS),
    *(AttentionKernel("fold", d) for d in ATTENTION_HEAD_DIMS),
    *(AttentionKernel("prefill", d, fp8) for fp8 in (False, True) for d in ATTENTION_HEAD_DIMS),
)


@dataclass(frozen=True)
class RopeKvKernel:
    """rf_rope_kv_append[_fp8]: a prompt chunk's RoPE + KV-append into its pool's format."""

    kv_fp8: bool = False

    @functools.cached_property
    def name(self) -> str:
        return f"rf_rope_kv_append{_pool(self.kv_fp8)}"

    def definition(self) -> str:
        call = f"rf_rope_kv<{str(self.kv_fp8).lower()}>(RF_ROPE_KV_ARGS)"
        return _wrapper("RF_ROPE_THREADS", self.name, "RF_ROPE_KV_PARAMS", call)


# --- Embedding (kernels/embedding.hip) and fp16 operands (kernels/gemm_f16.hip) -------------
_EMBED_SPLIT_BITS = {"q4_0": 4, "q8_0": 8}


@dataclass(frozen=True)
class EmbedKernel:
    """rf_embed_<fmt>[_split]: the token gather from a GGUF table, or (`split`) from one
    repacked as the GEMV reads it (quants and scales apart)."""

    fmt: str
    split: bool = False

    @functools.cached_property
    def name(self) -> str:
        return f"rf_embed_{self.fmt}{'_split' * self.split}"

    def definition(self) -> str:
        if self.split:
            call = f"rf_embed_split_rows<{_EMBED_SPLIT_BITS[self.fmt]}>(RF_EMBED_SPLIT_ARGS)"
            return _wrapper("RF_EMBED_THREADS", self.name, "RF_EMBED_SPLIT_PARAMS", call)
        call = f"rf_embed_rows<rf_{self.fmt}_value>(RF_EMBED_ARGS)"
        return _wrapper("RF_EMBED_THREADS", self.name, "RF_EMBED_PARAMS", call)


@dataclass(frozen=True)
class DequantF16Kernel:
    """rf_dequant_f16_<fmt>: a slab of weight rows expanded to fp16 for the vendor GEMM."""

    fmt: str

    @functools.cached_property
    def name(self) -> str:
        return f"rf_dequant_f16_{self.fmt}"

    def definition(self) -> str:
        call = f"rf_dequant_f16<rf_dequant_{self.fmt}>(RF_DEQUANT_F16_ARGS)"
        return _wrapper("RF_F16_THREADS", self.name, "RF_DEQUANT_F16_PARAMS", call)


# Each source's generated kernels, in the order they are appended.
GENERATED_KERNELS = {
    "attention.hip": ATTENTION_KERNELS,
    "embedding.hip": (
        EmbedKernel("q8_0"),
        EmbedKernel("q4_0"),
        EmbedKernel("f16"),
        EmbedKernel("q8_0", split=True),
        EmbedKernel("q4_0", split=True),
    ),
    "gemm.hip": (
        QuantizeRowsKernel("rows"),
        QuantizeRowsKernel("tiles"),
        GemmKernel("q4_0"),
        GemmKernel("q8_0"),
        *MMV_KERNELS,
    ),
    "gemm_f16.hip": (DequantF16Kernel("q4_0"), DequantF16Kernel("q8_0")),
    "gemv.hip": GEMV_KERNELS,
    "rope_kv.hip": (RopeKvKernel(), RopeKvKernel(kv_fp8=True)),
}


def generated_source(source_name: str) -> str:
    """The generated kernel definitions of one kernels/ source ("" for none)."""
    kernels = GENERATED_KERNELS.get(source_name, ())
    if not kernels:
        return ""
    return "\n" + GENERATED_HEADER + "".join(k.definition() for k in kernels)

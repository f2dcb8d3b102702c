"""Kernel compile checks (no GPU): every kernels/*.hip builds for sm_90 with NVRTC and for
gfx90a + gfx1030 with hiprtc, exports the kernels it declares, and is cached on disk.

A missing compiler skips its tests with the reason, except under CI (CI=true), where it fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from rocforge_rt.backends.gpu.kernel_library import (
    CodeObject,
    Compiler,
    KernelLibrary,
    elf_function_symbols,
    kernel_names,
    kernel_source,
    kernels_dir,
)
from rocforge_rt.errors import BackendError, KernelCompileError

TARGETS = ("sm_90", "gfx90a", "gfx1030")
KERNELS = kernels_dir()
HEADER = "rf_portability.h"
SOURCES = sorted(p.name for p in KERNELS.glob("*.hip"))
EM_CUDA, EM_AMDGPU = 190, 224
VENDOR_MACROS = re.compile(
    r"__HIP_PLATFORM|__CUDACC__|__HIPCC__|__CUDA_ARCH__|__HIP_DEVICE_COMPILE__|__gfx|__GFX"
    r"|__HIP__|__NVCC__|__AMDGCN"
)

# Uses every helper of the portability header, so each is compiled for each target.
HEADER_SMOKE = """\
#include "rf_portability.h"

RF_KERNEL_BOUNDS(256)
void rf_smoke_warp(const float* RF_RESTRICT x, float* sums, float* maxes, int32_t* isums) {
    const float v = x[threadIdx.x];
    sums[threadIdx.x] = rf_warp_sum(v) + rf_shfl_xor(v, 1);
    maxes[threadIdx.x] = rf_warp_max(v);
    isums[threadIdx.x] = rf_warp_sum((int)threadIdx.x) + rf_shfl_xor((int)threadIdx.x, 1);
    sums[threadIdx.x] += rf_shfl(v, 3, RF_WARP_SIZE) + (float)rf_float_as_int(v);
    if (v < 0.0f) {
        rf_sleep_briefly();
    }
    rf_syncwarp();
    rf_pdl_begin();
}

RF_KERNEL void rf_smoke_scalar(const int32_t* a, const int32_t* b, const uint16_t* h,
                               int32_t* dot, uint16_t* h_out, float* f_out, uint64_t n) {
    const uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int8_t s8 = (int8_t)a[i];
    const int16_t s16 = (int16_t)b[i];
    const uint32_t u32 = (uint32_t)s8 + (uint32_t)s16;
    const int64_t s64 = (int64_t)u32;
    dot[i] = rf_dp4a(a[i], b[i], (int)s64);
    f_out[i] = rf_half_to_float(h[i]) + rf_load_half((const uint8_t*)(h + i));
    h_out[i] = rf_float_to_half(f_out[i]);
}

RF_KERNEL_BOUNDS(64)
void rf_smoke_mma(const uint16_t* h, const int32_t* a, float* f_out, int32_t* i_out) {
    __shared__ __align__(16) uint16_t tile[8 * 32 * 8];
    for (int i = threadIdx.x; i < 8 * 32; i += blockDim.x) {
        rf_cp_async16(tile + 8 * i, h + 8 * i, i % 3 != 0);
    }
    rf_cp_async_commit();
    rf_cp_async_wait<0>();
    __syncthreads();
    uint32_t fa[4], fb[4];
    rf_ldmatrix_x4(fa, tile + 8 * (threadIdx.x & 31u));
    rf_ldmatrix_x4_trans(fb, tile + 8 * (threadIdx.x & 31u));
    float c[4] = {0.0f, 0.0f, 0.0f, rf_exp2(f_out[0])};
    rf_mma_f16_m16n8k16(c, fa, fb);
    fb[0] = rf_float2_to_half2(c[0], c[1]);
    int ci[4] = {0, 0, 0, 0};
    const uint32_t ia[4] = {(uint32_t)a[0], (uint32_t)a[1], (uint32_t)a[2], (uint32_t)a[3]};
    rf_mma_s8_m16n8k32(ci, ia, fb);
    f_out[threadIdx.x] = c[0] + c[1] + c[2] + c[3];
    i_out[threadIdx.x] = ci[0] + ci[1] + ci[2] + ci[3];
}
"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def _make_compiler(arch: str) -> Compiler:
    if arch.startswith("sm_"):
        from rocforge_rt.backends.gpu.cuda import NvrtcCompiler

        return NvrtcCompiler(arch)
    from rocforge_rt.backends.gpu.hip import HiprtcCompiler

    return HiprtcCompiler(arch)


@pytest.fixture(scope="session")
def get_compiler() -> Callable[[str], Compiler]:
    """A compiler per target, probed once; unavailable ones skip (or fail under CI)."""
    made: dict[str, Compiler | str] = {}

    def get(arch: str) -> Compiler:
        if arch not in made:
            try:
                made[arch] = _make_compiler(arch)
            except BackendError as exc:
                made[arch] = f"no compiler for {arch}: {exc}"
        compiler = made[arch]
        if isinstance(compiler, str):
            if _in_ci():
                pytest.fail(f"{compiler} (CI is set, so this fails instead of skipping)")
            pytest.skip(compiler)
        return compiler

    return get


@pytest.fixture(scope="session")
def kernel_cache(cache_folder: Path) -> Path:
    """The session's kernel cache folder, empty at first: `built` compiles into it."""
    return cache_folder / "kernels"


@pytest.fixture(scope="session")
def cold_libraries() -> dict[str, KernelLibrary]:
    """`built`'s library per target: the first to load each source, from an empty cache."""
    return {}


@pytest.fixture(scope="session")
def built(
    get_compiler: Callable[[str], Compiler],
    kernel_cache: Path,
    cold_libraries: dict[str, KernelLibrary],
) -> Callable[[str, str], CodeObject]:
    """Code object of (target, source), compiled once per session: a target's first use
    compiles all its sources in parallel (one that fails is compiled again, alone, by the
    test that loads it, which fails with the log)."""

    def get(arch: str, source: str) -> CodeObject:
        if arch not in cold_libraries:
            library = KernelLibrary(get_compiler(arch), cache_dir=kernel_cache)
            with contextlib.suppress(KernelCompileError):
                library.build()
            cold_libraries[arch] = library
        return cold_libraries[arch].load(source)

    return get


def _headers() -> dict[str, str]:
    return {HEADER: (KERNELS / HEADER).read_text()}


def _elf_machine(code: bytes) -> int:
    return struct.unpack_from("<H", code, 0x12)[0]


def test_kernel_sources_present() -> None:
    assert "embedding.hip" in SOURCES
    assert (KERNELS / HEADER).is_file()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", TARGETS)
def test_source_compiles_to_elf(built: Callable[[str, str], CodeObject], arch: str, source: str):
    code = built(arch, source).code
    assert code[:4] == b"\x7fELF", "expected an ELF code object, not PTX/assembly text"
    assert _elf_machine(code) == (EM_CUDA if arch.startswith("sm_") else EM_AMDGPU)


@pytest.mark.parametrize("source", SOURCES)
def test_targets_export_declared_kernels(built: Callable[[str, str], CodeObject], source: str):
    declared = set(kernel_names(kernel_source(KERNELS, source)))
    assert declared, f"{source} declares no RF_KERNEL"
    exported = {arch: elf_function_symbols(built(arch, source).code) for arch in TARGETS}
    for arch, names in exported.items():
        assert declared <= names, f"{arch} lacks {sorted(declared - names)}"
    assert exported["sm_90"] == exported["gfx90a"] == exported["gfx1030"]


@pytest.mark.parametrize("arch", TARGETS)
def test_header_helpers_compile(get_compiler: Callable[[str], Compiler], arch: str) -> None:
    compiler = get_compiler(arch)
    code = compiler.compile(
        HEADER_SMOKE, "smoke.hip", _headers(), {"RF_WARP_SIZE": compiler.warp_size}
    )
    assert elf_function_symbols(code) == {"rf_smoke_warp", "rf_smoke_scalar", "rf_smoke_mma"}


@pytest.mark.parametrize(("arch", "wrong"), [("sm_90", 64), ("gfx90a", 32), ("gfx1030", 64)])
def test_warp_size_must_match_target(
    get_compiler: Callable[[str], Compiler], arch: str, wrong: int
) -> None:
    with pytest.raises(KernelCompileError, match="RF_WARP_SIZE"):
        get_compiler(arch).compile(HEADER_SMOKE, "smoke.hip", _headers(), {"RF_WARP_SIZE": wrong})


@pytest.mark.parametrize("arch", TARGETS)
def test_compile_error_carries_log(get_compiler: Callable[[str], Compiler], arch: str) -> None:
    compiler = get_compiler(arch)
    bad = '#include "rf_portability.h"\n\nRF_KERNEL void k() { rf_no_such_function(); }\n'
    with pytest.raises(KernelCompileError) as info:
        compiler.compile(bad, "bad_kernel.hip", _headers(), {"RF_WARP_SIZE": compiler.warp_size})
    message = str(info.value)
    assert "rf_no_such_function" in message
    assert re.search(r"bad_kernel\.hip[:(]3\b", message), message


@pytest.mark.parametrize("arch", TARGETS)
def test_warm_start_compiles_nothing(
    get_compiler: Callable[[str], Compiler],
    built: Callable[[str, str], CodeObject],
    kernel_cache: Path,
    cold_libraries: dict[str, KernelLibrary],
    arch: str,
) -> None:
    """The session's cold compiles (shared with the tests above, so each source compiles
    once a target; their later loads are the cache's hits) fill the cache; a new library
    over it compiles nothing."""
    first = {source: built(arch, source) for source in SOURCES}
    assert cold_libraries[arch].compiles == len(SOURCES)

    warm = KernelLibrary(get_compiler(arch), cache_dir=kernel_cache)
    again = warm.load_all()
    assert warm.compiles == 0 and warm.cache_hits == len(SOURCES)
    assert {n: c.code for n, c in again.items()} == {n: c.code for n, c in first.items()}

    changed = warm.load("embedding.hip", defines={"RF_TEST_VARIANT": 1})
    assert warm.compiles == 1
    assert changed.key != first["embedding.hip"].key
    assert not list(kernel_cache.glob(".*.tmp")), "temporary cache files left behind"


def test_failed_compile_is_not_cached(
    get_compiler: Callable[[str], Compiler], tmp_path: Path
) -> None:
    source_dir = tmp_path / "kernels"
    source_dir.mkdir()
    (source_dir / HEADER).write_text(_headers()[HEADER])
    (source_dir / "broken.hip").write_text(
        '#include "rf_portability.h"\nRF_KERNEL void k() { x }\n'
    )
    library = KernelLibrary(get_compiler("sm_90"), source_dir=source_dir, cache_dir=tmp_path / "c")
    with pytest.raises(KernelCompileError, match="broken.hip"):
        library.load("broken.hip")
    assert library.compiles == 0
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_hiprtc_crash_becomes_compile_error(get_compiler: Callable[[str], Compiler]) -> None:
    get_compiler("gfx90a")  # skips (or fails under CI) when hiprtc is missing
    from rocforge_rt.backends.gpu.hip import HiprtcCompiler

    compiler = HiprtcCompiler("gfx1100")  # unknown to HIP 5.2: its compiler crashes
    args = (HEADER_SMOKE, "smoke.hip", _headers(), {"RF_WARP_SIZE": compiler.warp_size})
    if "HIP 5." not in compiler.version:
        assert compiler.compile(*args)[:4] == b"\x7fELF"
        return
    with pytest.raises(KernelCompileError, match=r"hiprtc crashed .*gfx1100"):
        compiler.compile(*args)


def test_rdna_wave64_on_request(get_compiler: Callable[[str], Compiler]) -> None:
    get_compiler("gfx1030")  # skips (or fails under CI) when hiprtc is missing
    from rocforge_rt.backends.gpu.hip import HiprtcCompiler

    wave64 = HiprtcCompiler("gfx1030", warp_size=64)
    assert wave64.version != get_compiler("gfx1030").version  # distinct cache keys
    code = wave64.compile(HEADER_SMOKE, "smoke.hip", _headers(), {"RF_WARP_SIZE": 64})
    assert code[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="gfx90a"):
        HiprtcCompiler("gfx90a", warp_size=32)


def test_library_owns_warp_size(get_compiler: Callable[[str], Compiler], tmp_path: Path) -> None:
    library = KernelLibrary(get_compiler("sm_90"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="RF_WARP_SIZE"):
        library.load("embedding.hip", defines={"RF_WARP_SIZE": 64})
    with pytest.raises(ValueError, match="not a C identifier"):
        library.load("embedding.hip", defines={"BAD NAME": 1})


def test_vendor_conditionals_only_in_header() -> None:
    offenders = {
        path.name: sorted(set(VENDOR_MACROS.findall(path.read_text())))
        for path in sorted(KERNELS.iterdir())
        if path.is_file() and path.name != HEADER
    }
    assert not {name: found for name, found in offenders.items() if found}


def function_bodies(source: str) -> dict[str, str]:
    """Each top-level function body (and function-like macro) of a source, by name.

    A body is what a `{` at brace depth 0 encloses; its name is the identifier
    before the parameter list that precedes the brace. Comments are dropped.
    """
    code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    bodies: dict[str, str] = {}
    depth, start = 0, 0
    for i, char in enumerate(code):
        if char == "{":
            if depth == 0:
                start = i
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                head = code[code.rfind(";", 0, start) + 1 : start]
                name = re.search(
                    r"(\w+)\s*(?:<[^()]*>)?\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*$", head
                )
                if name:
                    bodies[name.group(1)] = code[start:i]
    for macro, body in re.findall(r"#\s*define\s+(\w+)\([^)]*\)((?:[^\n]*\\\n)*[^\n]*)", code):
        bodies[macro] = body
    return bodies


@pytest.mark.parametrize("source", SOURCES)
def test_every_kernel_waits_for_the_previous_kernel(source: str) -> None:
    """Kernels may be launched to overlap their predecessor (programmatic dependent
    launch), so each must reach rf_pdl_wait/rf_pdl_begin, itself or through a helper."""
    text = "\n".join(
        [kernel_source(KERNELS, source)]
        + [(KERNELS / name).read_text() for name in ("rf_q8.h", "rf_rope.h", HEADER)]
    )
    bodies = function_bodies(text)

    def waits(name: str, seen: set[str]) -> bool:
        body = bodies.get(name, "")
        if re.search(r"\brf_pdl_(wait|begin)\(", body):
            return True
        seen.add(name)
        called = set(re.findall(r"\b(\w+)\s*(?:<[^;{}()]*>)?\s*\(", body)) & set(bodies)
        return any(waits(callee, seen) for callee in called - seen)

    missing = [k for k in kernel_names(kernel_source(KERNELS, source)) if not waits(k, set())]
    assert not missing, f"{source}: {missing} never call rf_pdl_wait"


def includes(path: Path) -> list[str]:
    return re.findall(r'^\s*#\s*include\s*([<"][^>"]+[>"])', path.read_text(), re.M)


def test_header_is_self_contained() -> None:
    """The portability header includes nothing; every other file only kernels/ headers."""
    assert includes(KERNELS / HEADER) == []
    shared = {f'"{p.name}"' for p in KERNELS.glob("*.h")}
    for path in sorted(KERNELS.iterdir()):
        if path.is_file() and path.name != HEADER:
            found = includes(path)
            assert found[:1] == [f'"{HEADER}"'], f"{path.name} includes {found}"
            assert set(found) <= shared, f"{path.name} includes {found}"


def test_kernel_names_ignore_comments() -> None:
    source = """
    // RF_KERNEL void commented_out(int x);
    /* RF_KERNEL_BOUNDS(64) void also_commented(int x); */
    RF_KERNEL void first(int x) {}
    RF_KERNEL_BOUNDS(128)
    void second(const float* y) {}
    RF_KERNEL_BOUNDS_ONE(1024) void third(int z) {}
    """
    assert kernel_names(source) == ["first", "second", "third"]

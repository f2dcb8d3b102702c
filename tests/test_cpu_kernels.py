"""The CPU backend's compiled elementwise kernels are numpy's arithmetic, bit for bit."""

import os
import platform
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from rocforge_rt.backends.cpu_arithmetic import rms_normalize
from rocforge_rt.backends.cpu_intrinsics import _converts_halves
from rocforge_rt.backends.cpu_kernels import halves_as_singles, rms_norm_rows, rope_rows


def test_float16_to_float32_is_numpys_astype_for_every_half():
    """All 65536 float16 bit patterns: zeros, subnormals, normals, infinities, nans (with
    their payloads), both signs; a signalling nan comes back quiet where F16C converts it
    (as a product with it would be), as it is elsewhere."""
    halves = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(halves.shape, dtype=np.float32)
    halves_as_singles(halves, got)
    expected = halves.view(np.float16).astype(np.float32).view(np.uint32)
    signalling = (halves & 0x7E00 == 0x7C00) & (halves & 0x1FF != 0)
    if _converts_halves():
        expected = np.where(signalling, expected | 0x400000, expected)
    assert np.array_equal(got.view(np.uint32), expected)


def test_rope_rotates_adjacent_pairs_as_numpy_does_and_copies_the_rest():
    """(e, o) at pair i of each head -> (e * cos - o * sin, e * sin + o * cos) at the row's
    position, each operation rounded to float32; dimensions past the rotated ones unchanged."""
    rng = np.random.default_rng(8)
    rows, heads, head_dim, pairs = 3, 5, 64, 24  # 48 of 64 dimensions rotated
    x = rng.standard_normal((rows, heads, head_dim)).astype(np.float32)
    angles = rng.uniform(-4, 4, (10, pairs))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = np.array([7, 0, 9])
    got = np.empty_like(x)
    rope_rows(x, positions, cos, sin, got)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    even, odd = x[..., 0 : 2 * pairs : 2], x[..., 1 : 2 * pairs : 2]
    expected = x.copy()
    expected[..., 0 : 2 * pairs : 2] = even * c - odd * s
    expected[..., 1 : 2 * pairs : 2] = even * s + odd * c
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("rows", [1, 2, 9])
@pytest.mark.parametrize("n", [5, 64, 100, 576, 960, 2048, 5120, 8192])
def test_rms_norm_is_numpys_bit_for_bit(rows, n):
    """rms_norm_rows against rms_normalize (numpy's pairwise float32 mean included), on
    lengths below 8, within one pairwise block (128), and split into several, at scales
    from 1e-3 to 1e3."""
    rng = np.random.default_rng(rows * n)
    gain = rng.uniform(0.5, 2, n).astype(np.float32)
    for scale in (1e-3, 1.0, 1e3):
        x = (rng.standard_normal((rows, n)) * scale).astype(np.float32)
        got = np.empty_like(x)
        rms_norm_rows(x, gain, 1e-5, got)
        assert np.array_equal(got.view(np.uint32), rms_normalize(x, gain, 1e-5).view(np.uint32))


def test_the_kept_scale_is_numpys_fp16_rounding_of_the_scale():
    """_kept_scale (the matmul kernels' activation scales) against
    cpu_arithmetic.kept_scales: every midpoint between neighbouring fp16 values (ties: to
    even) and the float32s either side of it, subnormal fp16s included, and values past
    fp16's largest (saturating at 65504)."""
    from numba import njit

    from rocforge_rt.backends.cpu_arithmetic import kept_scales
    from rocforge_rt.backends.cpu_kernels import _kept_scale

    @njit
    def kept(values, out):
        for i in range(values.shape[0]):
            out[i] = _kept_scale(values[i])

    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((halves[:-1] + halves[1:]) / 2).astype(np.float32).view(np.uint32)
    beyond = np.float32([65504, 65519, 65520, 1e6, 3e38]).view(np.uint32)
    values = np.concatenate([ties - 1, ties, ties + 1, beyond]).view(np.float32)
    got = np.empty_like(values)
    kept(values, got)
    assert np.array_equal(got.view(np.uint32), kept_scales(values).view(np.uint32))


NO_F16C_SCRIPT = """
import numpy as np
from rocforge_rt.backends.cpu_arithmetic import q8_matmul, q8_matmul_reference
from rocforge_rt.backends.cpu_weights import BlockMatrix
from rocforge_rt.backends.cpu_intrinsics import _converts_halves
from rocforge_rt.backends.cpu_kernels import halves_as_singles

assert not _converts_halves()
halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
singles = np.empty(halves.shape, dtype=np.float32)
halves_as_singles(halves.view(np.uint16), singles)
assert np.array_equal(singles.view(np.uint32), halves.astype(np.float32).view(np.uint32))
rng = np.random.default_rng(0)
scales = rng.choice(halves[np.isfinite(halves)], (130, 5))  # subnormals and all
x = rng.standard_normal((3, 160)).astype(np.float32)
for low, high, size, dtype in ((0, 256, 16, np.uint8), (-128, 128, 32, np.int8)):
    matrix = BlockMatrix.from_blocks(rng.integers(low, high, (130, 5, size), dtype), scales)
    got, expected = q8_matmul(x, matrix), q8_matmul_reference(x, matrix)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
print("ok")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="compiles for an x86-64 without F16C")
def test_without_f16c_the_kernels_convert_halves_in_integers_exactly(compiled_for):
    """Compiled for an x86-64 CPU without F16C (where LLVM's fpext from half would call a
    runtime function numba does not link), the fp16 conversion of the KV pool's reads and
    of the matmul's weight scales is the integer one, numpy's `astype` bit for bit."""
    assert_ok(compiled_for["no-f16c"])


def check_matmul_is_the_reference_at_the_integer_extremes() -> None:
    """q8_matmul against q8_matmul_reference bit for bit, both layouts, on weights of random
    integers and of each extreme alone (Q4_0 nibbles all 0 or all 15: -8 or 7; int8 all
    -128 or all 127) in tiles of LANES and a narrow last one (130 = 2 * 64 + 2 rows), against
    1, 3, 64 and 128 activation rows of random values, all +-127 (+-127/128: d_x 2^-7) or
    +-127 in random signs."""
    from rocforge_rt.backends.cpu_arithmetic import q8_matmul, q8_matmul_reference
    from rocforge_rt.backends.cpu_weights import BlockMatrix

    rng = np.random.default_rng(11)
    n_out, n_blocks = 130, 5
    scales = rng.random((n_out, n_blocks)).astype(np.float16)
    nibbles = [rng.integers(0, 256, (n_out, n_blocks, 16), np.uint8)]
    nibbles += [np.full((n_out, n_blocks, 16), v, np.uint8) for v in (0, 0xFF)]
    int8s = [rng.integers(-128, 128, (n_out, n_blocks, 32), np.int8)]
    int8s += [np.full((n_out, n_blocks, 32), v, np.int8) for v in (-128, 127)]
    for quants in nibbles + int8s:
        matrix = BlockMatrix.from_blocks(quants, scales)
        for rows in (1, 3, 64, 128):
            x = rng.standard_normal((rows, 32 * n_blocks)).astype(np.float32)
            x[0] = np.float32(127 / 128)
            if rows > 1:
                x[1] = np.float32(-127 / 128)
                x[2] = rng.choice(np.float32([-127 / 128, 127 / 128]), 32 * n_blocks)
            got, expected = q8_matmul(x, matrix), q8_matmul_reference(x, matrix)
            assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), rows


def test_the_matmul_is_the_reference_at_the_integer_extremes():
    """On this machine's CPU (`cpu_intrinsics.block_dots`: its widest byte multiply-adds)."""
    check_matmul_is_the_reference_at_the_integer_extremes()


# x86-64 CPUs numba may compile for (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES), a codegen path
# each (`cpu_intrinsics.block_dots`): whether it has VNNI; its widest pmaddubsw (bytes, 0: none)
X86_PATHS = {
    "vnni": ("znver4", "+sse2,+ssse3,+avx,+avx2,+f16c,+avx512f,+avx512bw,+avx512vnni", True, 64),
    "avx512bw": ("skylake-avx512", "+sse2,+ssse3,+avx,+avx2,+f16c,+avx512f,+avx512bw", False, 64),
    "avx2": ("haswell", "+sse2,+ssse3,+avx,+avx2,+f16c", False, 32),
    "ssse3": ("x86-64", "+sse2,+ssse3,+cx16", False, 16),
    "generic": ("x86-64", "+sse2,+cx16", False, 0),
}

PATH_SCRIPT = """
import sys
from rocforge_rt.backends.cpu_intrinsics import _BYTE_PAIRS, _cpu_features, _has_vnni
import test_cpu_kernels

vnni, widest = sys.argv[1] == "True", int(sys.argv[2])
assert _has_vnni() == vnni
assert max([w for f, w, _ in _BYTE_PAIRS if f in _cpu_features()], default=0) == widest
test_cpu_kernels.check_matmul_is_the_reference_at_the_integer_extremes()
print("ok")
"""


@pytest.fixture(scope="module")
def compiled_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen]]:
    """The checks compiled for other x86-64 CPUs, each a child process of its own (numba
    reads the CPU it compiles for once), all started at once: each compiles for a minute
    on one core. By X86_PATHS name (those this CPU can run) and "no-f16c"."""
    from numba.core.codegen import get_host_cpu_features

    host = set(get_host_cpu_features().split(","))
    paths = [os.path.dirname(__file__), *filter(None, [os.environ.get("PYTHONPATH")])]
    runs: dict[str, subprocess.Popen] = {}

    def start(name: str, cpu: str, features: str, *args: str) -> None:
        env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features,
               "NUMBA_CACHE_DIR": str(tmp_path_factory.mktemp(name)),
               "PYTHONPATH": os.pathsep.join(paths)}  # fmt: skip
        runs[name] = subprocess.Popen([sys.executable, "-c", *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip

    if platform.machine() == "x86_64":
        start("no-f16c", "x86-64", "+sse2,+cx16", NO_F16C_SCRIPT)
        for name, (cpu, features, vnni, widest) in X86_PATHS.items():
            if set(features.split(",")) <= host:
                start(name, cpu, features, PATH_SCRIPT, str(vnni), str(widest))
    yield runs
    for run in runs.values():
        run.kill()
        run.communicate()


def assert_ok(run: subprocess.Popen) -> None:
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0 and out.strip() == "ok", err


@pytest.mark.skipif(platform.machine() != "x86_64", reason="compiles for x86-64 CPUs")
@pytest.mark.parametrize("path", list(X86_PATHS))
def test_each_x86_codegen_path_is_the_reference_bit_for_bit(path, compiled_for):
    """The matmul compiled for CPUs with VNNI, AVX-512BW without it, AVX2, SSSE3 and none of
    them (LLVM's generic vectors): the block dots' instructions differ, the bits do not."""
    if path not in compiled_for:
        pytest.skip(f"this CPU lacks some of {X86_PATHS[path][1]}")
    assert_ok(compiled_for[path])

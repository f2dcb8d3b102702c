"""The CPU backend's compiled elementwise kernels are numpy's arithmetic, bit for bit."""

import numpy as np

from rocforge_rt.backends.cpu import singles
from rocforge_rt.backends.cpu_kernels import rope_rows


def test_float16_to_float32_is_numpys_astype_for_every_half():
    """All 65536 float16 bit patterns: zeros, subnormals, normals, infinities, nans (with
    their payloads), both signs."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 2, 128)
    got = singles(halves)
    assert got.shape == halves.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), halves.astype(np.float32).view(np.uint32))


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

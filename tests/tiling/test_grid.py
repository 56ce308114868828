"""Tile planning over 1-D to 4-D shapes: coverage, the tile-count formula, alignment, determinism.

The checks recount everything from the plan's integers with independent arithmetic: every output
voxel is written exactly once when cores abut, every voxel has positive coverage when they overlap,
tile origins sit on the alignment grid, the last tile ends exactly at the (virtual) image edge, and the
number of tiles per axis is ``ceil((E - T) / stride) + 1`` (never the tail-dropping ``(E - T) // s + 1``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiling import BlendMode, TileGrid
from tiling.blend import axis_weights

CASES = [
    pytest.param((100,), 32, 4, 0, 1, id="1d-L100-T32-h4"),
    pytest.param((97,), 16, 3, 5, 1, id="1d-prime-overlap5"),
    pytest.param((7,), 32, 4, 0, 1, id="1d-smaller-than-tile"),
    pytest.param((1,), 8, 2, 1, 1, id="1d-single-voxel"),
    pytest.param((37, 41), (16, 12), (3, 2), (0, 2), 1, id="2d-primes-tile-per-axis"),
    pytest.param((64, 9), (20, 32), 4, 4, 4, id="2d-anisotropic-align4"),
    pytest.param((13, 17, 11), (8, 10, 6), (2, 1, 1), (1, 0, 2), (2, 1, 2), id="3d-mixed"),
    pytest.param((5, 30, 4), (8, 8, 8), 2, 0, 1, id="3d-thin-axes"),
    pytest.param((9, 8, 7, 6), (4, 5, 3, 6), 1, (0, 1, 0, 1), 1, id="4d"),
    pytest.param((11, 3, 10, 12), 6, (2, 0, 1, 1), (0, 1, 0, 1), (2, 1, 2, 3), id="4d-align"),
]


def _tuple(v, ndim):
    return tuple(v) if isinstance(v, tuple) else (v,) * ndim


def _expected_count(extent: int, tile: int, stride: int) -> int:
    if tile >= extent:
        return 1
    return len(range(0, extent - tile, stride)) + 1  # origins 0, s, 2s, ... below E - T, plus the last


@pytest.mark.parametrize(("shape", "tile", "halo", "overlap", "align"), CASES)
@pytest.mark.parametrize("border", [pytest.param(b, id=b) for b in ("clip", "pad")])
def test_plan_invariants(shape, tile, halo, overlap, align, border):
    grid = TileGrid.plan(shape, tile, halo, overlap=overlap, alignment=align, border=border, blend="hann")
    ndim = len(shape)
    tiles, halos, overlaps, aligns = (_tuple(v, ndim) for v in (tile, halo, overlap, align))
    assert grid.ndim == ndim and grid.out_shape == shape
    for a, (L, T, h, o, al) in enumerate(zip(shape, tiles, halos, overlaps, aligns, strict=True)):
        ax = grid.axes[a]
        pad = h if border == "pad" else 0
        extent = math.ceil((L + 2 * pad) / al) * al
        assert ax.extent == extent and ax.pad_lo == pad
        assert ax.tile == min(T, extent), "tiles shrink only to the (aligned) image"
        if T < extent:
            assert ax.stride == (T - 2 * h - o) // al * al
        assert ax.n_tiles == _expected_count(extent, ax.tile, ax.stride)
        assert all(s % al == 0 for s in ax.starts), "origins on the stride grid"
        assert ax.starts[0] == 0 and ax.starts[-1] + ax.tile == extent, "last tile ends at the edge"
        assert list(ax.starts) == sorted(set(ax.starts))
        for (c0, c1), (w0, w1), s in zip(ax.crops, ax.writes, ax.starts, strict=True):
            assert c1 - c0 == w1 - w0 > 0
            assert 0 <= c0 and c1 <= ax.tile, "crop inside the predictor output"
            assert w0 + pad == s + c0, "crop and write describe the same voxels"
    assert grid.n_tiles == math.prod(grid.grid_shape) == len(list(grid.tiles()))


@pytest.mark.parametrize(("shape", "tile", "halo", "overlap", "align"), CASES)
def test_cores_partition_or_cover_the_image(shape, tile, halo, overlap, align):
    grid = TileGrid.plan(shape, tile, halo, overlap=overlap, alignment=align, blend="gaussian")
    count = np.zeros(grid.out_shape, dtype=np.int64)
    for t in grid.tiles():
        count[t.write] += 1
    if not grid.blended:
        assert (count == 1).all(), "abutting cores must write every voxel exactly once"
    else:
        assert (count >= 1).all()
        # The plan's per-axis coverage is the sum of the per-axis weights over the tiles.
        for ax in grid.axes:
            weights = axis_weights(ax, grid.blend)
            assert (weights is None) == (not ax.blended)
            if weights is None:
                continue
            cov = np.zeros(ax.out_length, dtype=np.float64)
            for (w0, w1), w in zip(ax.writes, weights.weights, strict=True):
                assert w.dtype == np.float32 and w.shape == (w1 - w0,) and (w > 0).all()
                cov[w0:w1] += w
            np.testing.assert_allclose(weights.coverage, cov, rtol=1e-6)  # fp32 vs fp64 summation order
            assert (weights.coverage > 0).all()


def test_known_plan_1d():
    grid = TileGrid.plan((100,), 32, 4)
    ax = grid.axes[0]
    assert ax.starts == (0, 24, 48, 68)  # the last tile is shifted back to end at 100
    assert ax.writes == ((0, 28), (28, 52), (52, 76), (76, 100))
    assert ax.crops == ((0, 28), (4, 28), (4, 28), (8, 32))
    assert grid.stride == (24,) and not grid.blended


def test_tail_is_never_dropped():
    # The (L - k) // s + 1 formula gives 3 windows of 10 with stride 10 on L = 35, dropping 5 voxels.
    grid = TileGrid.plan((35,), 10)
    assert (35 - 10) // 10 + 1 == 3
    assert grid.axes[0].starts == (0, 10, 20, 25)
    assert grid.axes[0].writes[-1][1] == 35


def test_image_smaller_than_tile():
    grid = TileGrid.plan((5, 7, 3), 16, 4, overlap=2)
    assert grid.n_tiles == 1 and grid.used_tile_shape == (5, 7, 3) and grid.stride == (0, 0, 0)
    assert not grid.blended


def test_smaller_than_tile_rounds_up_to_alignment():
    grid = TileGrid.plan((5, 7), 16, 2, alignment=4)
    assert grid.used_tile_shape == (8, 8) and grid.out_shape == (5, 7)


def test_plan_is_deterministic_and_c_ordered():
    a = TileGrid.plan((30, 20, 10), (9, 8, 7), 1, overlap=1)
    b = TileGrid.plan((30, 20, 10), (9, 8, 7), 1, overlap=1)
    ia = [(t.index, t.starts, t.crop, t.write) for t in a.tiles()]
    ib = [(t.index, t.starts, t.crop, t.write) for t in b.tiles()]
    assert ia == ib
    assert [i for i, *_ in ia] == sorted(i for i, *_ in ia), "C order: axis 0 slowest"


def test_scaled_plan():
    up = TileGrid.plan((30, 21), 8, 2, scale=2)
    assert up.out_shape == (60, 42) and up.out_tile_shape == (16, 16)
    down = TileGrid.plan((30, 21), 8, 2, alignment=2, scale=Fraction(1, 2))
    assert down.out_shape == (15, 11) and down.out_tile_shape == (4, 4)


def test_summary_names_the_plan():
    s = TileGrid.plan((30, 20), (9, 8), 1, overlap=1, blend=BlendMode.GAUSSIAN).summary()
    for fragment in (
        "n_tiles=",
        "tile_shape=(9, 8)",
        "halo=(1, 1)",
        "stride=",
        "blend=gaussian",
        "border=clip",
    ):
        assert fragment in s


@st.composite
def plans(draw):
    ndim = draw(st.integers(1, 4))
    shape, tile, halo, overlap, align = [], [], [], [], []
    for _ in range(ndim):
        a = draw(st.integers(1, 4))
        t = a * draw(st.integers(1, 6))
        h = draw(st.integers(0, max(0, (t - a) // 2)))
        o = draw(st.integers(0, max(0, t - 2 * h - a)))
        shape.append(draw(st.integers(1, 30 if ndim < 4 else 9)))
        tile.append(t), halo.append(h), overlap.append(o), align.append(a)
    border = draw(st.sampled_from(["clip", "pad"]))
    return tuple(shape), tuple(tile), tuple(halo), tuple(overlap), tuple(align), border


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(plans())
def test_property_every_voxel_covered(plan):
    shape, tile, halo, overlap, align, border = plan
    grid = TileGrid.plan(
        shape, tile, halo, overlap=overlap, alignment=align, border=border, blend="triangular"
    )
    for ax, L, a in zip(grid.axes, shape, align, strict=True):
        written = np.zeros(L, dtype=np.int64)
        for w0, w1 in ax.writes:
            written[w0:w1] += 1
        assert (written >= 1).all()
        if not ax.blended:
            assert (written == 1).all()
        assert ax.starts[-1] + ax.tile == ax.extent and all(s % a == 0 for s in ax.starts)

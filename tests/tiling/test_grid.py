"""Tile planning over 1-D to 4-D shapes: coverage, the tile-count formula, alignment, determinism.

The checks recount everything from the plan's integers with independent arithmetic: every output
voxel is written exactly once when cores abut, every voxel has positive coverage when they overlap,
tile origins sit on the alignment grid, the last tile ends exactly at the (virtual) image edge, and the
number of tiles per axis is ``ceil((E - T) / stride) + 1`` (never the tail-dropping ``(E - T) // s + 1``)
for both placements: tiles sized to the grid (the default: the smallest aligned tile that still covers
with that count, origins spread evenly) and the fixed tile shape (last tile shifted back). Kept regions
are centred: neighbours discard margins that differ by at most one voxel.
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


def _stride(tile: int, halo: int, overlap: int, align: int) -> int:
    return (tile - 2 * halo - overlap) // align * align


@pytest.mark.parametrize(("shape", "tile", "halo", "overlap", "align"), CASES)
@pytest.mark.parametrize("border", [pytest.param(b, id=b) for b in ("clip", "pad")])
@pytest.mark.parametrize("fixed", [pytest.param(False, id="sized"), pytest.param(True, id="fixed")])
def test_plan_invariants(shape, tile, halo, overlap, align, border, fixed):
    grid = TileGrid.plan(shape, tile, halo, overlap=overlap, alignment=align, border=border, blend="hann",
                         fixed_tile_shape=fixed)  # fmt: skip
    ndim = len(shape)
    tiles, halos, overlaps, aligns = (_tuple(v, ndim) for v in (tile, halo, overlap, align))
    assert grid.ndim == ndim and grid.out_shape == shape
    for a, (L, T, h, o, al) in enumerate(zip(shape, tiles, halos, overlaps, aligns, strict=True)):
        ax = grid.axes[a]
        pad = h if border == "pad" else 0
        extent = math.ceil((L + 2 * pad) / al) * al
        assert ax.extent == extent and ax.pad_lo == pad
        if T >= extent:
            assert ax.tile == extent and ax.starts == (0,), "tiles shrink to the (aligned) image"
        else:
            s0 = _stride(T, h, o, al)
            n = _expected_count(extent, T, s0)
            assert ax.n_tiles == n, "the same tile count in both modes"
            if fixed:
                assert ax.tile == T and list(ax.starts) == [min(i * s0, extent - T) for i in range(n)]
            else:
                # The smallest aligned tile that still covers the extent with n tiles.
                assert ax.tile <= T and ax.tile % al == 0
                assert (n - 1) * _stride(ax.tile, h, o, al) + ax.tile >= extent
                smaller = ax.tile - al
                assert (
                    _stride(smaller, h, o, al) <= 0 or (n - 1) * _stride(smaller, h, o, al) + smaller < extent
                )
                gaps = np.diff(ax.starts)
                assert gaps.max() <= _stride(ax.tile, h, o, al), "neighbouring cores still meet"
                assert gaps.max() - gaps.min() <= al, "origins spread evenly"
        assert all(s % al == 0 for s in ax.starts), "origins on the stride grid"
        assert ax.starts[0] == 0 and ax.starts[-1] + ax.tile == extent, "last tile ends at the edge"
        assert list(ax.starts) == sorted(set(ax.starts))
        for (c0, c1), (w0, w1), s in zip(ax.crops, ax.writes, ax.starts, strict=True):
            assert c1 - c0 == w1 - w0 > 0
            assert 0 <= c0 and c1 <= ax.tile, "crop inside the predictor output"
            assert w0 + pad == s + c0, "crop and write describe the same voxels"
        _check_centred(ax, h, o)
    assert grid.n_tiles == math.prod(grid.grid_shape) == len(list(grid.tiles()))
    assert grid.work == pytest.approx(grid.n_tiles * math.prod(grid.used_tile_shape) / math.prod(shape))


def _check_centred(ax, halo: int, overlap: int) -> None:
    """Neighbouring kept regions share exactly ``overlap`` voxels, each at least ``halo`` from its own
    tile edge, and the two tiles discard margins that differ by at most one voxel (scale 1)."""
    pad = ax.pad_lo
    for i in range(ax.n_tiles - 1):
        t0, t1 = ax.starts[i], ax.starts[i + 1]
        hi0 = ax.windows[i][1] + pad  # virtual end of tile i's kept region
        lo1 = ax.windows[i + 1][0] + pad  # virtual start of tile i + 1's kept region
        assert hi0 - lo1 == overlap
        margin0, margin1 = t0 + ax.tile - hi0, lo1 - t1
        assert margin0 >= halo and margin1 >= halo
        assert abs(margin0 - margin1) <= 1, "the kept region is centred"


def test_sized_plan_never_feeds_more_than_the_fixed_one():
    for shape, tile, halo, overlap, align in [p.values for p in CASES]:
        sized = TileGrid.plan(shape, tile, halo, overlap=overlap, alignment=align)
        fixed = TileGrid.plan(shape, tile, halo, overlap=overlap, alignment=align, fixed_tile_shape=True)
        assert sized.grid_shape == fixed.grid_shape
        assert sized.work <= fixed.work


@pytest.mark.parametrize(
    ("shape", "tile", "halo", "align", "sized_tile", "sized_work", "fixed_work"),
    [
        # The benchmark's 3D case (MNI152 at 1.75 mm, BasicUNet, alignment 16): 2 x 2 x 2 tiles.
        pytest.param((113, 133, 108), 96, 12, 16, (80, 96, 80), 3.028, 4.361, id="unet-3d-tile96"),
        # log-3d (radius 8) on the same volume with its default tile 64, and with tile 96.
        pytest.param((113, 133, 108), 64, 8, 1, (49, 55, 62), 1.853, 2.907, id="log3d-tile64"),
        pytest.param((113, 133, 108), 96, 8, 1, (65, 75, 62), 1.490, 4.361, id="log3d-tile96"),
        # text-det-2d (alignment 32) on the 1955 x 1841 radiograph, tile 512, halo 64: 5 x 5 tiles.
        pytest.param((1955, 1841), 512, 64, 32, (512, 480), 1.707, 1.821, id="radiograph-2d"),
        # The README's example: (97, 131, 89), tile 64, halo 4.
        pytest.param((97, 131, 89), 64, 4, 1, (53, 49, 49), 1.350, 2.782, id="readme-example"),
    ],
)
def test_work_of_the_benchmark_cases(shape, tile, halo, align, sized_tile, sized_work, fixed_work):
    # Hand check of the first case, axis 0: extent 128 (113 up to a multiple of 16), stride 64, so
    # 2 tiles; tile 80 still covers (64 + 80 >= 128, stride(80) = 56 -> 48: 48 + 80 = 128), 64 does
    # not (stride 32: 32 + 64 < 128). Work = 8 * 80 * 96 * 80 / (113 * 133 * 108) = 3.028.
    sized = TileGrid.plan(shape, tile, halo, alignment=align)
    fixed = TileGrid.plan(shape, tile, halo, alignment=align, fixed_tile_shape=True)
    assert sized.used_tile_shape == sized_tile and fixed.used_tile_shape == (tile,) * len(shape)
    assert sized.work == pytest.approx(sized_work, abs=1e-3)
    assert fixed.work == pytest.approx(fixed_work, abs=1e-3)
    assert sized.n_tiles == fixed.n_tiles


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
    # L = 100, tile 32, halo 4: stride 24 needs 4 tiles. Tile 31 still covers (3 * 23 + 31 = 100),
    # origins 0, 23, 46, 69; each boundary is the midpoint of the zone both neighbours may keep
    # ((0 + 23 + 31) / 2 = 27, ...), so every interior tile discards 4 voxels on both sides.
    grid = TileGrid.plan((100,), 32, 4)
    ax = grid.axes[0]
    assert ax.tile == 31 and ax.starts == (0, 23, 46, 69)
    assert ax.writes == ((0, 27), (27, 50), (50, 73), (73, 100))
    assert ax.crops == ((0, 27), (4, 27), (4, 27), (4, 31))
    assert grid.stride == (23,) and not grid.blended
    assert grid.work == pytest.approx(4 * 31 / 100)


def test_known_plan_1d_fixed_tile_shape():
    # The fixed-shape plan: the last tile is shifted back to end at 100. The zone both tiles 2 and 3
    # may keep is [72, 76): the boundary is its midpoint 74 (before: 76, all slack on one side).
    grid = TileGrid.plan((100,), 32, 4, fixed_tile_shape=True)
    ax = grid.axes[0]
    assert ax.starts == (0, 24, 48, 68)
    assert ax.writes == ((0, 28), (28, 52), (52, 74), (74, 100))
    assert ax.crops == ((0, 28), (4, 28), (4, 26), (6, 32))
    assert grid.stride == (24,) and grid.work == pytest.approx(1.28)


def test_known_plan_1d_overlap_centred():
    # L = 40, tile 16, halo 2, overlap 3: stride 9 needs 4 tiles, tile 16 origins 0, 8, 16, 24. The
    # zone that tiles 0 and 1 may keep is [10, 14); the 3 kept voxels are centred in it: [10, 13).
    grid = TileGrid.plan((40,), 16, 2, overlap=3, blend="hann")
    ax = grid.axes[0]
    assert ax.starts == (0, 8, 16, 24)
    assert ax.windows == ((0, 13), (10, 21), (18, 29), (26, 40))
    assert ax.writes == ax.windows and grid.blended


def test_tail_is_never_dropped():
    # The (L - k) // s + 1 formula gives 3 windows of 10 with stride 10 on L = 35, dropping 5 voxels.
    assert (35 - 10) // 10 + 1 == 3
    fixed = TileGrid.plan((35,), 10, fixed_tile_shape=True)
    assert fixed.axes[0].starts == (0, 10, 20, 25)
    assert fixed.axes[0].writes[-1][1] == 35
    sized = TileGrid.plan((35,), 10)  # 4 tiles of 9 cover 35
    assert sized.axes[0].tile == 9 and sized.axes[0].starts == (0, 8, 17, 26)
    assert sized.axes[0].writes == ((0, 8), (8, 17), (17, 26), (26, 35))


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
    fixed = draw(st.booleans())
    return tuple(shape), tuple(tile), tuple(halo), tuple(overlap), tuple(align), border, fixed


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(plans())
def test_property_every_voxel_covered(plan):
    shape, tile, halo, overlap, align, border, fixed = plan
    grid = TileGrid.plan(
        shape, tile, halo, overlap=overlap, alignment=align, border=border, blend="triangular",
        fixed_tile_shape=fixed,
    )  # fmt: skip
    for ax, L, a, h, o in zip(grid.axes, shape, align, halo, overlap, strict=True):
        written = np.zeros(L, dtype=np.int64)
        for w0, w1 in ax.writes:
            written[w0:w1] += 1
        assert (written >= 1).all()
        if not ax.blended:
            assert (written == 1).all()
        assert ax.starts[-1] + ax.tile == ax.extent and all(s % a == 0 for s in ax.starts)
        _check_centred(ax, h, o)

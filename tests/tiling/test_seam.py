"""Seam measurement (``tiled_inference(..., seam=SeamStats())``) against a brute-force oracle.

The oracle records every tile's whole prediction in grid order and replays the definition on
full-size arrays: each tile is compared with the mean of the earlier tiles' predictions wherever
at least one lies (its extent taken from the tile's origin, not from the engine's write/crop
arithmetic), then joins them. A tile-dependent predictor (the input plus the tile's own mean)
makes overlapping tiles disagree by known amounts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tiling import SeamStats, TileGrid, tiled_inference


def plus_tile_mean(t: torch.Tensor) -> torch.Tensor:
    """Tile-dependent: each tile's values plus its own mean (per channel)."""
    return t + t.mean(dim=tuple(range(2, t.ndim)), keepdim=True)


class Recorder:
    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.tiles: list[torch.Tensor] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        y = self.predictor(batch)
        self.tiles.extend(y.clone())
        return y


def oracle(grid: TileGrid, predictions: list[torch.Tensor], transform=None) -> tuple[float, float, int]:
    """Max, mean and voxel count of the running-mean comparison, on full-size float64 arrays."""
    channels = predictions[0].shape[0]
    total = np.zeros((channels, *grid.spatial_shape))
    count = np.zeros(grid.spatial_shape)
    worst, diffs, n_values, n_voxels = 0.0, 0.0, 0, 0
    for tile, pred in zip(grid.tiles(), predictions, strict=True):
        values = (transform(pred) if transform else pred).double().numpy()
        out, src = [], []
        for axis, start in zip(grid.axes, tile.starts, strict=True):
            lo = start - axis.pad_lo  # image coordinate of the tile's first voxel (scale 1)
            a, b = max(lo, 0), min(lo + axis.tile, axis.length)
            out.append(slice(a, b))
            src.append(slice(a - lo, b - lo))
        values = values[(slice(None), *src)]
        c = count[tuple(out)]
        seen = c > 0
        if seen.any():
            mean = total[(slice(None), *out)] / np.maximum(c, 1)
            d = np.abs(values - mean)[:, seen]
            worst = max(worst, float(d.max()))
            diffs += float(d.sum())
            n_values += d.size
            n_voxels += int(seen.sum())
        total[(slice(None), *out)] += values
        count[tuple(out)] += 1
    return worst, diffs / n_values if n_values else math.nan, n_voxels


def test_two_tiles_hand_computed() -> None:
    """Tiles [0, 8) and [4, 12) of 0..11 have means 3.5 and 7.5: they differ by 4 on [4, 8)."""
    x = np.arange(12, dtype=np.float32)[None]
    stats = SeamStats()
    y = tiled_inference(x, plus_tile_mean, 8, overlap=4, blend="triangular", seam=stats)
    assert TileGrid.plan((12,), 8, overlap=4).axes[0].starts == (0, 4)
    assert (stats.max_abs, stats.mean_abs, stats.n_voxels, stats.n_values) == (4.0, 4.0, 4, 4)
    assert stats.header() == "max=4; mean=4; voxels=4" and (stats.n_tiles, stats.n_runs) == (2, 1)
    plain = tiled_inference(x, plus_tile_mean, 8, overlap=4, blend="triangular")
    np.testing.assert_array_equal(y, plain)  # measuring changes nothing in the output


@pytest.mark.parametrize(
    ("shape", "tile", "halo", "overlap", "border", "batch"),
    [
        pytest.param((37, 41), (16, 12), 3, (4, 2), "clip", 5, id="2d-halo-overlap"),
        pytest.param((37, 41), (16, 12), 3, 0, "pad", 2, id="2d-halo-only-pad"),
        pytest.param((23, 17, 19), (10, 8, 9), 0, (5, 4, 4), "clip", 3, id="3d-half-tile"),
        pytest.param((40,), 9, 2, 3, "pad", 1, id="1d"),
    ],
)
def test_matches_brute_force(rng, shape, tile, halo, overlap, border, batch) -> None:
    x = rng.standard_normal((2, *shape), dtype=np.float32)
    grid = TileGrid.plan(shape, tile, halo, overlap=overlap, border=border)
    assert grid.axes[0].n_tiles >= 3  # several rows: the meter drops rows as it moves along axis 0
    rec = Recorder(plus_tile_mean)
    stats = SeamStats()
    tiled_inference(x, rec, tile, halo=halo, overlap=overlap, border=border, batch_size=batch, seam=stats)
    worst, mean, voxels = oracle(grid, rec.tiles)
    assert voxels > 0 and stats.n_voxels == voxels and stats.n_values == 2 * voxels
    assert stats.max_abs == pytest.approx(worst, rel=1e-5) and stats.mean_abs == pytest.approx(mean, rel=1e-5)


def test_transform_and_several_runs_add_up(rng) -> None:
    """A torch batch of two images is two runs into one stats object; ``transform`` is applied first."""
    x = torch.from_numpy(rng.standard_normal((2, 3, 30, 26), dtype=np.float32))
    grid = TileGrid.plan((30, 26), 12, 2, overlap=3)
    rec = Recorder(plus_tile_mean)

    def softmax(t: torch.Tensor) -> torch.Tensor:
        return torch.softmax(t, dim=0)

    stats = SeamStats(transform=softmax)
    tiled_inference(x, rec, 12, halo=2, overlap=3, seam=stats)
    per_image = grid.n_tiles
    first = oracle(grid, rec.tiles[:per_image], softmax)
    second = oracle(grid, rec.tiles[per_image:], softmax)
    assert (stats.n_runs, stats.n_tiles) == (2, 2 * per_image)
    assert stats.n_voxels == first[2] + second[2]
    assert stats.max_abs == pytest.approx(max(first[0], second[0]), rel=1e-5)
    assert stats.mean_abs == pytest.approx((first[1] + second[1]) / 2, rel=1e-5)  # equal counts
    assert 0 < stats.max_abs <= 1  # probabilities


def test_local_network_agrees_where_tiles_overlap(rng) -> None:
    x = rng.standard_normal((1, 50, 45), dtype=np.float32)
    stats = SeamStats()
    tiled_inference(x, lambda t: 3 * t, 16, halo=2, overlap=4, blend="gaussian", seam=stats)
    assert stats.n_voxels > 0 and stats.max_abs <= 1e-6  # fp32 rounding of the running sum (|3 x| < 15)


def test_nothing_to_compare() -> None:
    x = np.ones((1, 20, 20), np.float32)
    one = SeamStats()
    tiled_inference(x, plus_tile_mean, 32, seam=one)  # one tile: no seam exists
    assert one.header() == "max=0; mean=0; voxels=0" and not one.measured and math.isnan(one.mean_abs)
    abut = SeamStats()
    tiled_inference(x, plus_tile_mean, 10, seam=abut)  # tiles abut: a seam exists, unmeasured
    assert abut.header() == "max=nan; mean=nan; voxels=0" and abut.n_tiles == 4

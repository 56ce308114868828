"""Tiles not run (issue 21 item 3): constant tiles answered from one computed tile, skipped tiles fed
as a blank of the skip rule's colour.

Oracles: the same engine with reuse off (``TileReuse(constant=False)``: every tile runs), which the
reused run must equal with difference 0 (the copied prediction is the network's output on an
identical array; ``batch_size=1`` keeps the predictor's rounding per tile identical); and the
whole-image forward pass of the conv stack (1e-5, as in test_exactness). Images are padded
scanner-style: a constant frame (2D) or the air outside a field of view (3D) around random content.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiling_nets import ConvStack, whole

from tiling import TileGrid, TileReuse, tiled_inference
from tiling.reuse import read_box


class Counting:
    """A predictor that counts the tiles it ran."""

    def __init__(self, net):
        self.net = net
        self.tiles = 0

    def __call__(self, x):
        self.tiles += int(x.shape[0])
        return self.net(x)


def _framed(shape, inner, value, channels=1, seed=0):
    rng = np.random.default_rng(seed)
    x = np.full((channels, *shape), value, np.float32)
    box = tuple(slice((s - n) // 2, (s - n) // 2 + n) for s, n in zip(shape, inner, strict=True))
    x[(slice(None), *box)] = rng.normal(size=(channels, *inner)).astype(np.float32)
    return x


@pytest.mark.parametrize(
    ("shape", "inner", "tile", "halo", "value", "channels"),
    [
        pytest.param((97, 131), (23, 29), 24, 3, 0.0, 1, id="2d-zero-frame"),
        pytest.param((97, 131), (23, 29), (20, 26), 4, 0.93, 3, id="2d-rgb-glass"),
        pytest.param((41, 37, 29), (9, 11, 7), 14, 3, -1024.0, 1, id="3d-ct-air"),
    ],
)
def test_constant_tiles_reused_exactly(shape, inner, tile, halo, value, channels):
    x = _framed(shape, inner, value, channels)
    net = ConvStack(len(shape), channels, 2)
    plain, reused = Counting(net), Counting(net)
    want = tiled_inference(x, plain, tile, halo=halo, reuse=TileReuse(constant=False))
    stats = TileReuse()
    got = tiled_inference(x, reused, tile, halo=halo, reuse=stats)
    assert np.abs(got - want).max() == 0.0  # exact: a copy of the network's output on the same array
    assert stats.n_reused > 0 and reused.tiles == plain.tiles - stats.n_reused == stats.n_run
    np.testing.assert_allclose(got, whole(net, x), atol=1e-5)  # and it is whole-image inference
    # the constant tiles are exactly those whose read box lies in the frame
    grid = TileGrid.plan(shape, tile, halo)
    constant = 0
    for t in grid.tiles():
        starts, stops = read_box(grid, t)
        region = x[(slice(None), *(slice(max(a, 0), b) for a, b in zip(starts, stops, strict=True)))]
        flat = region.reshape(channels, -1)
        constant += bool(np.all(flat == flat[:, :1]))
    assert stats.n_reused == constant - 1  # one per value runs


def test_batches_mix_run_and_reused_tiles():
    x = _framed((90, 90), (20, 20), 0.5)
    net = ConvStack(2, 1, 1)
    want = tiled_inference(x, net, 16, halo=3, batch_size=1, reuse=TileReuse(constant=False))
    stats = TileReuse()
    got = tiled_inference(x, net, 16, halo=3, batch_size=5, reuse=stats)
    np.testing.assert_allclose(got, want, atol=1e-6)  # batch 5 vs 1: the predictor's own rounding
    assert stats.n_reused > 0


def test_skip_rule_fills_tiles_unread_and_counts_them():
    x = _framed((80, 96), (24, 24), 0.25)
    x[:, :4, :4] = 0.26  # not the fill value: a tile the rule skips is not read, so this never shows
    net = ConvStack(2, 1, 1)
    grid = TileGrid.plan((80, 96), 20, 3)

    def skip(tile):
        starts, stops = read_box(grid, tile)
        return [0.25] if stops[0] <= 28 else None  # the top rows are "glass"

    stats = TileReuse(skip=skip)
    got = tiled_inference(x, net, grid=grid, reuse=stats)
    fed = x.copy()
    fed[:, :4, :4] = 0.25
    want = tiled_inference(fed, net, grid=grid, reuse=TileReuse(constant=False))
    assert np.abs(got - want).max() == 0.0
    assert stats.n_filled == sum(1 for t in grid.tiles() if read_box(grid, t)[1][0] <= 28) > 0
    assert stats.n_reused >= stats.n_filled - 1


def test_nan_tile_is_never_constant_and_torch_batches_share_the_cache():
    x = np.zeros((1, 40, 40), np.float32)
    x[0, :12, :12] = np.nan
    net = ConvStack(2, 1, 1)
    stats = TileReuse()
    tiled_inference(x, net, 12, halo=2, reuse=stats)
    assert stats.n_run >= 2  # the NaN tile ran, as did the first zero tile
    t = torch.zeros((3, 1, 30, 30))
    stats = TileReuse()
    y = tiled_inference(t, net, 12, halo=2, reuse=stats)
    assert stats.n_run == 1 and stats.n_tiles == 3 * TileGrid.plan((30, 30), 12, 2).n_tiles
    np.testing.assert_allclose(y[0].numpy(), whole(net, t[0].numpy()), atol=1e-5)

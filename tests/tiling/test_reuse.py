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


class _Syncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that move a tensor's values to the host (each a device sync on CUDA)."""

    NAMES = {"cpu", "item", "tolist", "numpy", "__bool__", "equal", "__index__", "__int__", "__float__"}

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES or (name == "to" and "cpu" in map(str, (*args[1:], *(kwargs or {}).values()))):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _keys_oracle(data, filled, constant):
    """Per tile: the bytes of its per-channel value when every value of each channel is equal
    (numpy; NaN never), and reuse is on or the tile was filled."""
    out = []
    for k, tile in enumerate(data.numpy()):
        flat = tile.reshape(tile.shape[0], -1)
        same = bool(np.all(flat == flat[:, :1]))
        out.append(flat[:, 0].tobytes() if same and (constant or filled[k]) else None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16])
@pytest.mark.parametrize("constant", [True, False])
def test_keys_of_a_batch_take_one_transfer_and_match_per_tile_keys(dtype, constant):
    """Review item 9: one reduction and one host transfer per batch (not one per tile), same keys."""
    rng = np.random.default_rng(3)
    tiles = rng.normal(size=(13, 3, 7, 5)) * 50
    tiles[[0, 4, 9]] = 7.0  # constant, every channel the same
    tiles[[2, 11]] = np.array([1.0, -2.0, 0.0])[:, None, None]  # constant per channel
    tiles[5] = -0.0
    tiles[6, 1] = 3.0  # one channel constant only: not a constant tile
    data = torch.from_numpy(tiles).to(dtype)
    if dtype.is_floating_point:
        data[12] = 0.0
        data[12, 0, 0, 0] = float("nan")  # NaN is never constant
    filled = [k % 2 == 0 for k in range(13)]
    with _Syncs() as syncs:
        keys = TileReuse(constant=constant).keys(data, filled)
    assert keys == _keys_oracle(data, filled, constant)
    assert sum(key is not None for key in keys) >= (6 if constant else 3)
    assert syncs.n <= 2, syncs.n

"""Streamed plans: memory follows the tile, not the volume (issue 20).

A streamed run's peak memory is its tile's (benchmarks/stream_rss: 125, 132 and 154 MiB for
tiles of 116x116x104, 116x116x112 and 116x116x128 on 512x512x800 CT). Tiles sized to the grid
made the 800-slice CT's tile 1.14x the 400-slice one's; :func:`models.planning.planner.smaller_tiles`
takes one more tile per axis where that costs at most 2 % more work on the axis.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from models import ModelRepository
from models.planning.params import parse_query
from models.planning.planner import SMALLER_TILE_WORK, smaller_tiles
from tiling import TileGrid

STREAMED = {"input_bytes": 0, "copies_input": False, "output_on_disk": True}


@pytest.fixture(scope="module")
def model():
    return ModelRepository(None, device="cpu").get("gaussian-3d")


def test_the_800_slice_ct_gets_no_larger_tile_than_the_400_slice_one(model):
    params = parse_query([])
    tiles = {z: model.plan((512, 512, z), params, **STREAMED).grid.used_tile_shape for z in (400, 800)}
    assert math.prod(tiles[800]) <= 1.05 * math.prod(tiles[400]), tiles
    whole = model.plan((512, 512, 800), params).grid  # the whole path keeps its grid
    assert whole.used_tile_shape == TileGrid.plan((512, 512, 800), 128, 8).used_tile_shape


@pytest.mark.parametrize("length", [37, 130, 255, 400, 512, 797, 800, 1009])
@pytest.mark.parametrize("alignment", [1, 16])
def test_smaller_tiles_cost_at_most_the_bound_and_cover_the_axis(length, alignment):
    grid = TileGrid.plan((length, 61), 128, 8, alignment=alignment)

    def plan(limit):
        return TileGrid.plan((length, 61), limit, 8, alignment=alignment)

    smaller = smaller_tiles(grid, plan, (alignment, alignment))
    for before, after in zip(grid.axes, smaller.axes, strict=True):
        assert after.tile <= before.tile and after.tile % alignment == 0
        assert after.n_tiles * after.tile <= (1 + SMALLER_TILE_WORK) * before.n_tiles * before.tile
    covered = np.zeros((length, 61), np.int32)  # the kept cores partition the image
    for tile in smaller.tiles():
        covered[tile.write] += 1
    assert np.all(covered == 1) and smaller.n_tiles >= grid.n_tiles

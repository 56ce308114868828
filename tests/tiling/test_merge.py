"""Mergers: the plan picks one; hand-computed overlap-add fixtures; slabs released row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiling import TileGrid
from tiling.merge import DirectWriter, SlabMerger, make_merger
from tiling.sink import Sink

CPU = torch.device("cpu")


class RecordingSink(Sink):
    """A numpy sink that records each write's axis-0 range and each flush."""

    def __init__(self, out_shape):
        super().__init__(None, out_shape, like="numpy")
        self.events: list[tuple] = []

    def write(self, write, values):
        self.events.append(("write", write[0].start, write[0].stop))
        super().write(write, values)

    def flush(self):
        self.events.append(("flush",))
        super().flush()


@pytest.mark.parametrize(
    ("overlap", "kind"),
    [
        pytest.param(0, DirectWriter, id="abutting"),
        pytest.param((0, 2), SlabMerger, id="overlap-on-axis-1-only"),
        pytest.param((2, 0), SlabMerger, id="overlap-on-axis-0-only"),
    ],
)
def test_plan_picks_the_merger(overlap, kind):
    grid = TileGrid.plan((20, 20), 8, 1, overlap=overlap, blend="hann")
    assert type(make_merger(grid, Sink(None, grid.out_shape, like="numpy"), None, CPU)) is kind


def test_one_tile_with_overlap_needs_no_accumulator():
    grid = TileGrid.plan((5, 5), 8, 1, overlap=2)
    assert isinstance(make_merger(grid, Sink(None, grid.out_shape, like="numpy"), None, CPU), DirectWriter)


def test_slab_merger_hand_computed_1d():
    # Tiles [0, 6) and [4, 10), triangular windows flat on the image-border side: tile 0 weighs
    # (1, 1, 1, 1, 2/3, 1/3), tile 1 (1/3, 2/3, 1, 1, 1, 1); coverage is 1 everywhere. Tile 0
    # predicts 2, tile 1 predicts 6: voxel 4 = 2 * 2/3 + 6 * 1/3 = 10/3, voxel 5 = 2/3 + 4 = 14/3.
    grid = TileGrid.plan((10,), 6, overlap=2, blend="triangular")
    assert grid.axes[0].starts == (0, 4)
    sink = Sink(None, grid.out_shape, like="numpy")
    merger = make_merger(grid, sink, None, CPU)
    for tile, value in zip(grid.tiles(), (2.0, 6.0), strict=True):
        crop = tile.crop[0]
        merger.add(tile, torch.full((1, crop.stop - crop.start), value))
    merger.finish()
    want = [2, 2, 2, 2, 10 / 3, 14 / 3, 6, 6, 6, 6]
    np.testing.assert_allclose(sink.result()[0], want, rtol=1e-6)


def test_slab_merger_releases_rows_in_order_and_reduces():
    # Three rows of tiles along axis 0: each finished row releases its slab (then flushes) before
    # the next row is added; the last slab comes from finish().
    grid = TileGrid.plan((26, 12), (12, 8), 1, overlap=(2, 2), blend="gaussian")
    assert grid.axes[0].n_tiles == 3
    sink = RecordingSink(grid.out_shape)
    merger = make_merger(grid, sink, lambda r: r[:1] * 10, CPU)
    for tile in grid.tiles():
        shape = [c.stop - c.start for c in tile.crop]
        merger.add(tile, torch.ones((2, *shape)))
    merger.finish()
    writes = [e[1:] for e in sink.events if e[0] == "write"]
    starts0 = [lo for lo, _ in grid.axes[0].writes]
    assert writes == [(0, starts0[1]), (starts0[1], starts0[2]), (starts0[2], 26)]
    assert sink.events[-1] == ("flush",) and sink.events.count(("flush",)) == 4
    np.testing.assert_allclose(sink.result(), 10.0, rtol=1e-6)  # ones, normalized, reduced


def test_direct_writer_reduces_each_tile():
    grid = TileGrid.plan((6, 4), (4, 4), 1)
    sink = Sink(None, grid.out_shape, like="numpy")
    merger = make_merger(grid, sink, lambda r: r.argmax(0, keepdim=True).to(torch.uint8), CPU)
    for tile in grid.tiles():
        shape = [c.stop - c.start for c in tile.crop]
        values = torch.zeros((3, *shape))
        values[tile.index[0] + 1] = 1.0
        merger.add(tile, values)
    merger.finish()
    got = sink.result()
    assert got.dtype == np.uint8
    rows = [w for w in grid.axes[0].writes]
    for i, (lo, hi) in enumerate(rows):
        assert (got[0, lo:hi] == i + 1).all()

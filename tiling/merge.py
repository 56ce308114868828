"""Mergers: where each tile's kept output goes, behind one protocol.

The engine hands every tile's cropped prediction to a :class:`Merger` in grid order (C order, axis 0
slowest) and calls :meth:`Merger.finish` once; it never asks which kind it holds.
:func:`make_merger` picks one from the plan:

- :class:`DirectWriter` when the cores abut on every axis: the kept parts partition the output, so
  each goes straight to the sink (no accumulator, no coverage).
- :class:`SlabMerger` when cores overlap on some axis: a :class:`~tiling.accumulate.SlabAccumulator`
  holds the rows (along axis 0) that tiles still add to; a row of tiles that is finished releases
  its normalized slab to the sink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tiling.accumulate import SlabAccumulator
from tiling.blend import AxisWeights, grid_weights
from tiling.grid import Tile, TileGrid
from tiling.sink import Sink

logger = logging.getLogger(__name__)

__all__ = ["DirectWriter", "Merger", "SlabMerger", "make_merger"]

Reducer = Callable[[torch.Tensor], torch.Tensor]


class Merger(Protocol):
    """Receives every tile's kept output ``(C_out, *region)`` (float32) in grid order."""

    def add(self, tile: Tile, values: torch.Tensor) -> None:
        """Merge ``values``, the crop ``tile.crop`` of the tile's prediction, at ``tile.write``."""

    def finish(self) -> None:
        """Write whatever is still held and flush the sink; nothing is added afterwards."""


def make_merger(
    grid: TileGrid, sink: Sink, reduce: Reducer | None, device: torch.device, *, origin: int = 0
) -> Merger:
    """The merger for ``grid``: a :class:`DirectWriter` when its writes partition the output, else a
    :class:`SlabMerger` whose accumulator lives on ``device`` and starts at output row ``origin``
    (axis 0; a resumed run's first write, :mod:`tiling.resume`)."""
    weights = grid_weights(grid)
    if all(w is None for w in weights):
        return DirectWriter(sink, reduce)
    return SlabMerger(grid, weights, sink, reduce, device, origin=origin)


class DirectWriter:
    """Abutting cores: each kept part is (reduced and) written straight to the sink.

    >>> import numpy as np
    >>> sink = Sink(None, (4,), like="numpy")
    >>> grid = TileGrid.plan((4,), 2)
    >>> writer = DirectWriter(sink, None)
    >>> for tile in grid.tiles():
    ...     writer.add(tile, torch.full((1, 2), float(tile.index[0])))
    >>> writer.finish()
    >>> sink.result().tolist()
    [[0.0, 0.0, 1.0, 1.0]]
    """

    def __init__(self, sink: Sink, reduce: Reducer | None) -> None:
        self.sink = sink
        self.reduce = reduce

    def add(self, tile: Tile, values: torch.Tensor) -> None:
        """Write ``values`` at ``tile.write``."""
        self.sink.write(tile.write, values if self.reduce is None else self.reduce(values))

    def finish(self) -> None:
        """Flush the sink."""
        self.sink.flush()


class SlabMerger:
    """Overlapping cores: weighted overlap-add in a slab accumulator, released row by row.

    Args:
        grid: the plan (tiles must arrive in its C order).
        weights: :func:`~tiling.blend.grid_weights` of ``grid``.
        sink: where normalized (and reduced) slabs go; flushed after each slab.
        reduce: optional map of each finished slab ``(C_out, *slab)`` to ``(C_red, *slab)``.
        device: where the accumulator (and the weights) live.
        origin: the first output row (axis 0) that tiles add to (0, or a resumed run's first write).
    """

    def __init__(
        self,
        grid: TileGrid,
        weights: Sequence[AxisWeights | None],
        sink: Sink,
        reduce: Reducer | None,
        device: torch.device,
        *,
        origin: int = 0,
    ) -> None:
        self.grid = grid
        self.origin = origin
        self.sink = sink
        self.reduce = reduce
        self.device = device
        self._coverages = [None if w is None else w.coverage for w in weights]
        self._weights = [
            None if w is None else tuple(torch.from_numpy(v).to(device) for v in w.weights) for w in weights
        ]
        per_row = grid.n_tiles // grid.axes[0].n_tiles
        self._rows_left = [per_row] * grid.axes[0].n_tiles
        self._acc: SlabAccumulator | None = None

    def add(self, tile: Tile, values: torch.Tensor) -> None:
        """Add ``values`` times the tile's weight; release the slab of a finished row of tiles."""
        if self._acc is None:
            channels = int(values.shape[0])
            rows = max(hi - lo for lo, hi in self.grid.axes[0].writes)  # the most one row holds
            self._acc = SlabAccumulator(
                channels, self.grid.out_shape, self._coverages, self.device, rows, origin=self.origin
            )
        self._acc.add(tile.write, values, self._tile_weight(tile))
        row = tile.index[0]
        self._rows_left[row] -= 1
        if self._rows_left[row] == 0 and row + 1 < len(self._rows_left):
            self._write(*self._acc.release(self.grid.axes[0].writes[row + 1][0]))

    def finish(self) -> None:
        """Release the remaining rows and flush the sink."""
        if self._acc is not None:
            self._write(*self._acc.finalize())
        self.sink.flush()

    def _tile_weight(self, tile: Tile) -> torch.Tensor | None:
        """The tile's weight over its written region: the outer product of per-axis weights."""
        total: torch.Tensor | None = None
        ndim = len(self._weights)
        for axis, (w, i) in enumerate(zip(self._weights, tile.index, strict=True)):
            if w is None:
                continue
            shape = [1] * ndim
            shape[axis] = w[i].shape[0]
            vec = w[i].reshape(shape)
            total = vec if total is None else total * vec
        return total

    def _write(self, lo: int, region: torch.Tensor) -> None:
        if region.shape[1] == 0:
            return
        write = (slice(lo, lo + region.shape[1]),) + tuple(slice(None) for _ in region.shape[2:])
        self.sink.write(write, region if self.reduce is None else self.reduce(region))
        self.sink.flush()

"""Resuming a tiled run from its last finished tile row (pure integer arithmetic, plus a row counter).

The engine merges tiles in C order (axis 0 slowest), so once the last tile of *tile row* ``r`` (the
tiles whose index along axis 0 is ``r``) is merged, the output rows ``[0, writes[r + 1].lo)`` along
axis 0 receive nothing more: they are final. With abutting cores the
:class:`~tiling.merge.DirectWriter` has written them; with overlapping cores the slab merger has
normalized and released them. A caller that keeps its ``out`` on disk (a memmap, flushed before it
is told) and records how many tile rows are final can stop, or be killed, and run again from there
with :class:`Resume`: the rows before are neither computed nor written again.

Worked 1-D example along axis 0: 100 voxels, tile 32, halo 4; the writes (output rows) of each
tile row are::

    overlap 0  [0, 27)  [27, 50)  [50, 73)  [73, 100)              rows_done=2: floor 50, rows 2-3 run
    overlap 4  [0, 25)  [21, 43)  [39, 60)  [56, 78)  [74, 100)    rows_done=2: floor 39, rows 1-4 run

With ``rows_done=2`` the output below ``floor = writes[2].lo`` is final. With overlap 0 the tile
rows from 2 on are all that write at or above it. With overlap 4 the region ``[39, 43)`` also holds
row 1's weighted contribution, so row 1 runs again and its output below the floor is dropped: one
tile row more, the price of blending across the slab boundary.

The first tile run is rounded down to a multiple of ``batch_size`` (:func:`resume_point`), so every
batch holds the same tiles as in an uninterrupted run: a backend's result may depend, to the last
bit, on the batch a tile ran in, and a resumed run must equal an uninterrupted one bit for bit. The
extra tiles (fewer than ``batch_size``) lie below the floor and are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tiling.grid import Tile, TileGrid

__all__ = ["Resume", "ResumePoint", "RowTracker", "resume_point"]


@dataclass(frozen=True, slots=True)
class Resume:
    """How a run continues one that stopped (see :mod:`tiling.resume`).

    Attributes:
        rows_done: tile rows along axis 0 whose output is already final in ``out`` (0: all run).
        on_rows: called with ``k`` each time the output of the first ``k`` tile rows is final and
            flushed (``k`` grows by one per finished row, up to the number of tile rows; never for
            ``k <= rows_done``). Record ``k`` to resume from it.
    """

    rows_done: int = 0
    on_rows: Callable[[int], object] | None = None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run starts (integers only).

    Attributes:
        rows_done: the tile rows already final, clamped to ``[0, n_rows]``.
        first_tile: index (grid C order) of the first tile that runs; ``n_tiles`` when none does.
        floor: output row (axis 0) below which nothing is written.
        origin: output row (axis 0) where the first tile that runs writes.
    """

    rows_done: int
    first_tile: int
    floor: int
    origin: int


def resume_point(grid: TileGrid, rows_done: int, batch_size: int) -> ResumePoint:
    """The first tile to run and the output floor when ``rows_done`` tile rows are final.

    >>> grid = TileGrid.plan((100, 8), (32, 8), halo=(4, 0), overlap=(4, 0))
    >>> grid.axes[0].writes
    ((0, 25), (21, 43), (39, 60), (56, 78), (74, 100))
    >>> resume_point(grid, 2, batch_size=1)
    ResumePoint(rows_done=2, first_tile=1, floor=39, origin=21)
    >>> resume_point(TileGrid.plan((100, 8), (32, 8), halo=(4, 0)), 2, batch_size=1).first_tile
    2
    """
    axis = grid.axes[0]
    n_rows = axis.n_tiles
    per_row = grid.n_tiles // n_rows
    done = max(0, min(int(rows_done), n_rows))
    if done == 0:
        return ResumePoint(0, 0, 0, 0)
    if done == n_rows:
        return ResumePoint(done, grid.n_tiles, axis.out_length, axis.out_length)
    floor = axis.writes[done][0]
    # The first tile row that writes at or above the floor: every later row does too.
    need = next(j for j in range(n_rows) if axis.writes[j][1] > floor)
    first = need * per_row // batch_size * batch_size
    return ResumePoint(done, first, floor, axis.writes[first // per_row][0])


class RowTracker:
    """Tells ``on_rows`` when tile rows become final, from the tiles merged in grid order.

    Args:
        grid: the plan.
        rows_done: tile rows final before the run started.
        on_rows: the callback of :class:`Resume` (``None``: nothing to tell).
        flush: flushes the output (called before ``on_rows``).
    """

    def __init__(
        self,
        grid: TileGrid,
        rows_done: int,
        on_rows: Callable[[int], object] | None,
        flush: Callable[[], None],
    ) -> None:
        self.n_rows = grid.axes[0].n_tiles
        self.last = tuple(a.n_tiles - 1 for a in grid.axes[1:])
        self.done = rows_done
        self.on_rows = on_rows
        self.flush = flush

    def merged(self, tile: Tile) -> None:
        """``tile`` was merged; the last tile of a row (but the grid's last) makes that row final."""
        if self.on_rows is None or tile.index[1:] != self.last:
            return
        rows = tile.index[0] + 1
        if self.done < rows < self.n_rows:  # the last row is final only once the merger finished
            self.flush()
            self.done = rows
            self.on_rows(rows)

    def finished(self) -> None:
        """The merger finished (and flushed): every row is final."""
        if self.on_rows is not None and self.done < self.n_rows:
            self.done = self.n_rows
            self.on_rows(self.n_rows)

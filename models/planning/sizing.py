"""Choosing the tile and batch size: halo and tile together, within a memory budget.

:meth:`models.Model.plan` gives this module a :class:`Sizer`: how to plan a grid for a tile limit
(with the halo that tile gets) and what a grid costs. Three rules, each a choice among candidate
tile limits (the starting tile ``T0`` scaled by a factor, the same on every axis, rounded up to
the alignment; the grid sizes each tile down to fit) and batch sizes:

- **grow** (the halo eats the tile): when the plan at ``T0`` feeds the network more than
  :data:`WORK_TARGET` voxels per input voxel (what MONAI's overlap 0.25 costs: ``(4/3)^3``), and the
  tile was not fixed by the request (or the halo is ``auto``), the smallest larger tile whose plan
  stays at or below the target is taken, as long as its peak memory fits the budget; when none
  does, the one of least work that fits. A calibrated halo of 40 on 96^3 tiles (core 16: 560 tiles
  on the 1 mm MNI152) becomes one whole-volume tile within a few GB.
- **fit** (``TILEWISE_MEMORY_BUDGET`` given, tile or batch size not given by the request): the plan
  of least predicted network time (:meth:`~models.measure.footprint.Footprint.seconds`) whose peak fits
  the budget (ties: less memory); when nothing fits, the least memory among the plans that feed
  the network no more than the starting tile's plan (or 2.4) voxels per input voxel: a budget
  below what the image itself holds never buys a run of tiny tiles (the request budget,
  ``TILEWISE_MAX_REQUEST_BYTES``, decides whether it runs).
- **shrink** (the device ran out of memory): half the batch, then half the tile
  (:func:`shrink_plan`).

Tile-dependent networks keep their tile (their output depends on it); only the batch may change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiling import GridError, TileGrid
from tiling.plan import per_axis, round_up

__all__ = ["Candidate", "Sizer", "WORK_TARGET", "batch_options", "shrink_tile"]

#: Voxels through the network per input voxel that a default plan should not exceed.
WORK_TARGET = 2.4
#: Growth factors tried above the starting tile (until the tile covers the image).
_GROW_STEP = 0.125
#: Shrink factors tried below it (fit only).
_SHRINK = (0.875, 0.75, 0.625, 0.5, 0.375, 0.25)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One tile limit, batch size and their grid, with the predicted peak and network time."""

    tile: tuple[int, ...]
    halo: tuple[int, ...]
    batch_size: int
    grid: TileGrid
    peak_bytes: int
    seconds: float

    @property
    def work(self) -> float:
        """The grid's :attr:`~tiling.TileGrid.work`."""
        return self.grid.work


@dataclass(frozen=True)
class Sizer:
    """What the rules need from the model.

    Attributes:
        start: the starting tile limit ``T0`` per axis (the request's or the spec's).
        alignment: the network's size divisor (one, or one per axis).
        extent: the image rounded up to the alignment, per axis (a tile never needs more).
        plan_grid: ``(tile limit) -> (grid, halo)``; raises :class:`~tiling.GridError` when the
            halo leaves no core.
        cost: ``(grid, batch) -> (peak bytes, network seconds)``.
    """

    start: tuple[int, ...]
    alignment: int | tuple[int, ...]
    extent: tuple[int, ...]
    plan_grid: Callable[[tuple[int, ...]], tuple[TileGrid, tuple[int, ...]]]
    cost: Callable[[TileGrid, int], tuple[int, float]]

    def candidate(self, tile: tuple[int, ...], batch: int) -> Candidate | None:
        """The candidate of one tile limit and batch, or ``None`` when the halo leaves no core."""
        try:
            grid, halo = self.plan_grid(tile)
        except GridError:
            return None
        peak, seconds = self.cost(grid, batch)
        return Candidate(tile, halo, batch, grid, peak, seconds)

    def tiles(self, *, grow: bool, shrink: bool) -> list[tuple[int, ...]]:
        """Tile limits to try: ``T0``, larger ones up to the image, smaller ones (distinct, sorted)."""
        out = {self._scaled(1.0)}
        if grow:
            factor = 1.0
            while any(t < e for t, e in zip(self._scaled(factor), self.extent, strict=True)):
                factor += _GROW_STEP
                out.add(self._scaled(factor))
        if shrink:
            out.update(self._scaled(f) for f in _SHRINK)
        return sorted(out, key=lambda t: (math.prod(t), t))

    def _scaled(self, factor: float) -> tuple[int, ...]:
        """``T0 * factor`` per axis, rounded up to the alignment; grown no further than the image."""
        out = []
        for t, e, a in zip(self.start, self.extent, per_axis(self.alignment, len(self.start)), strict=True):
            scaled = max(a, round_up(math.ceil(t * factor), a))
            out.append(min(scaled, max(e, t)) if factor > 1 else min(scaled, t))
        return tuple(out)

    def grow(self, batch: int, budget: int | Callable[[], int]) -> Candidate | None:
        """The **grow** rule (module docstring): ``None`` when ``T0``'s plan needs no growth.

        ``budget`` may be a callable, asked only when growth is needed (so is :attr:`cost`).
        """
        try:
            work = self.plan_grid(self.start)[0].work
        except GridError:
            work = math.inf
        if work <= WORK_TARGET:
            return None
        budget = budget() if callable(budget) else budget
        base = self.candidate(self.start, batch)
        larger = [
            c
            for t in self.tiles(grow=True, shrink=False)
            if all(a >= b for a, b in zip(t, self.start, strict=True))
            and (c := self.candidate(t, batch)) is not None
            and c.peak_bytes <= budget
        ]
        if not larger:
            return None
        good = [c for c in larger if c.work <= WORK_TARGET]
        if good:
            return min(good, key=lambda c: (math.prod(c.grid.used_tile_shape), c.work))
        best = min(larger, key=lambda c: (c.work, math.prod(c.grid.used_tile_shape)))
        return best if base is None or best.work < base.work else None

    def fit(self, batches: Sequence[int], budget: int, *, tile_fixed: bool) -> Candidate | None:
        """The **fit** rule (module docstring) over ``batches``; ``None`` when no plan exists."""
        tiles = [self.start] if tile_fixed else self.tiles(grow=True, shrink=True)
        options = [c for t in tiles for b in batches if (c := self.candidate(t, b)) is not None]
        if not options:
            return None
        fitting = [c for c in options if c.peak_bytes <= budget]
        if fitting:
            return min(fitting, key=lambda c: (c.seconds, c.peak_bytes))
        # the budget cannot be met: the least memory that costs no more work than the start
        start = [c.work for c in options if c.tile == self.start]
        limit = max(WORK_TARGET, min(start, default=WORK_TARGET))
        bounded = [c for c in options if c.work <= limit] or options
        return min(bounded, key=lambda c: (c.peak_bytes, c.seconds))


def batch_options(default: int, n_tiles_hint: int | None = None) -> tuple[int, ...]:
    """Batch sizes the fit rule tries: ``default`` and its halves down to 1.

    >>> batch_options(4), batch_options(1), batch_options(6)
    ((4, 2, 1), (1,), (6, 3, 1))
    """
    out = [max(1, int(default))]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    if n_tiles_hint is not None:
        out = [b for b in out if b <= max(1, n_tiles_hint)] or [1]
    return tuple(dict.fromkeys(out))


def shrink_tile(
    tile: Sequence[int], halo: Sequence[int], overlap: Sequence[int], alignment: int | Sequence[int]
) -> tuple[int, ...] | None:
    """Half of ``tile`` per axis (rounded down to the alignment), keeping a core of at least one
    alignment step beyond the halos and the overlap; ``None`` when no axis can shrink.

    >>> shrink_tile((96, 96, 96), (8, 8, 8), (0, 0, 0), 16)
    (48, 48, 48)
    >>> shrink_tile((48, 48), (20, 8), (0, 0), 16)
    (48, 32)
    >>> shrink_tile((48, 32), (20, 8), (0, 0), 16) is None
    True
    """
    out = []
    for t, h, o, a in zip(tile, halo, overlap, per_axis(alignment, len(tile)), strict=True):
        least = round_up(2 * h + o + a, a)
        out.append(max(least, t // 2 // a * a) if t > least else t)
    result = tuple(out)
    return None if result == tuple(tile) else result

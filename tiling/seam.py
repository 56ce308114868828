"""Seam measurement: how much overlapping tiles disagree where they overlap, measured during a run.

Shapes: ``C`` output channels, ``T`` a tile's output shape, ``S`` the output's spatial shape.

Every tile's whole prediction ``(C, *T)`` (its halo included: the tiles' predictions overlap over
their whole extent) is compared, voxel by voxel, with the mean of the predictions of the tiles
already seen there; then it joins that mean. With two tiles over a voxel this is exactly their
difference; where more overlap (corners), each later tile is compared with the earlier ones'
mean. Nothing is compared where only one tile lies, so a grid whose tiles abut (``halo = 0``,
``overlap = 0``) has nothing to measure (``n_voxels == 0``).

For a local network with a halo at least its receptive-field radius, the kept outputs agree, but
the discarded halos do not (they lack context), so the measure is not zero: it is what the halo
is there to discard; so a model that calibrated its halo (``halo="auto"``, tolerance met) reports
no seam at all (:meth:`models.measure.seams.SeamPolicy.seam_stats`): its kept output was compared with a
whole pass by the calibration. It is meant for tile-dependent networks (instance norm, attention), whose
kept outputs differ too, and for halos below the radius, where the halo's disagreement with the
neighbouring core is the seam's size.

The caller passes a :class:`SeamStats` to :func:`tiling.tiled_inference` (``seam=``) and reads
it afterwards; one object may gather several runs (e.g. the flipped passes of test-time
augmentation).

Memory: a running sum ``(C, R, *S[1:])`` and a count ``(R, *S[1:])`` in float32, ``R`` the rows
(along axis 0) one row of tiles spans: ``4 * (C + 1) * R * prod(S[1:])`` bytes, about as much as
the slab merger holds; rows no later tile reaches are dropped as the run moves along axis 0.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tiling.grid import Tile, TileGrid

__all__ = ["SeamMeter", "SeamStats"]

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SeamStats:
    """Disagreement between overlapping tiles, gathered by :class:`SeamMeter` (thread-safe).

    Attributes:
        transform: applied to each tile's ``(C, *T)`` prediction before comparing (e.g. the
            model's softmax, so differences are in probability units); ``None``: raw values.
        max_abs: the largest absolute difference seen.
        sum_abs: the sum of the absolute differences (float64).
        n_values: differences summed (voxels times channels).
        n_voxels: voxel comparisons (a voxel counts once per later tile that overlaps it).
        n_tiles: tiles seen, over all runs.
        n_runs: runs that reported here.

    >>> stats = SeamStats()
    >>> stats.update(0.5, 0.75, 3, 3)
    >>> stats.header()
    'max=0.5; mean=0.25; voxels=3'
    """

    transform: Transform | None = None
    max_abs: float = 0.0
    sum_abs: float = 0.0
    n_values: int = 0
    n_voxels: int = 0
    n_tiles: int = 0
    n_runs: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def mean_abs(self) -> float:
        """Mean absolute difference (``nan`` when nothing overlapped)."""
        return self.sum_abs / self.n_values if self.n_values else math.nan

    @property
    def measured(self) -> bool:
        """Whether any voxel was compared."""
        return self.n_voxels > 0

    def update(self, max_abs: float, sum_abs: float, n_values: int, n_voxels: int) -> None:
        """Add one comparison's figures."""
        with self._lock:
            self.max_abs = max(self.max_abs, max_abs)
            self.sum_abs += sum_abs
            self.n_values += n_values
            self.n_voxels += n_voxels

    def header(self) -> str:
        """``max=0.031; mean=0.0004; voxels=123456`` (4 significant digits).

        With nothing compared: ``max=0; mean=0; voxels=0`` when every run had one tile (no seam
        exists), ``max=nan; mean=nan; voxels=0`` when tiles abutted (a seam exists, unmeasured).
        """
        if not self.measured:
            value = "0" if self.n_tiles <= self.n_runs else "nan"
            return f"max={value}; mean={value}; voxels=0"
        return f"max={self.max_abs:.4g}; mean={self.mean_abs:.4g}; voxels={self.n_voxels}"


@dataclass
class _Span:
    """Where one tile's whole prediction lies: per axis, output ``(lo, hi)`` and the source offset."""

    out: tuple[slice, ...]
    src: tuple[slice, ...]


def _span(grid: TileGrid, tile: Tile) -> _Span:
    out, src = [], []
    for axis, (write, crop) in zip(grid.axes, zip(tile.write, tile.crop, strict=True), strict=True):
        lo = write.start - crop.start  # output coordinate of the prediction's first voxel
        a, b = max(lo, 0), min(lo + axis.out_tile, axis.out_length)
        out.append(slice(a, b))
        src.append(slice(a - lo, b - lo))
    return _Span(tuple(out), tuple(src))


class SeamMeter:
    """Compares every tile's whole prediction with the running mean of earlier ones (one run).

    Args:
        grid: the plan; tiles must arrive in its C order (axis 0 slowest), as the engine sends them.
        stats: where the figures go.
        device: where the running sum lives (the merge device).
    """

    def __init__(self, grid: TileGrid, stats: SeamStats, device: torch.device) -> None:
        self.grid = grid
        self.stats = stats
        self.device = device
        rows = grid.axes[0]
        # per row of tiles along axis 0: the first output row any of its predictions reaches
        self._row_lo = [max(0, w[0] - c[0]) for w, c in zip(rows.writes, rows.crops, strict=True)]
        self._lo = 0  # output row held in buffer row 0
        self._row = -1
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        with stats._lock:
            stats.n_tiles += grid.n_tiles
            stats.n_runs += 1

    def add(self, tile: Tile, prediction: torch.Tensor) -> None:
        """Compare ``prediction`` ``(C, *T)`` (the tile's whole output) with what lies there, then add it."""
        if self.grid.n_tiles == 1:
            return
        values = prediction.float()
        if self.stats.transform is not None:
            values = self.stats.transform(values)
        if tile.index[0] != self._row:
            self._advance(tile.index[0])
        span = _span(self.grid, tile)
        values = values[(slice(None), *span.src)]
        if self._sum is None or self._count is None:
            rows = max(self._rows_needed())
            rest = self.grid.out_shape[1:]
            self._sum = torch.zeros((values.shape[0], rows, *rest), dtype=torch.float32, device=self.device)
            self._count = torch.zeros((rows, *rest), dtype=torch.float32, device=self.device)
        local = (slice(span.out[0].start - self._lo, span.out[0].stop - self._lo), *span.out[1:])
        count = self._count[local]
        seen = count > 0
        n_voxels = int(seen.sum())
        if n_voxels:
            mean = self._sum[(slice(None), *local)] / count.clamp(min=1.0)
            diff = (values - mean).abs()[:, seen]
            self.stats.update(
                float(diff.max()), float(diff.sum(dtype=torch.float64)), int(diff.numel()), n_voxels
            )
        self._sum[(slice(None), *local)] += values
        count += 1.0

    def _rows_needed(self) -> list[int]:
        """Buffer rows each row of tiles needs: from its first reached row to the last one so far."""
        rows = self.grid.axes[0]
        ends = [min(w[0] - c[0] + rows.out_tile, rows.out_length) for w, c in zip(rows.writes, rows.crops,
                                                                                   strict=True)]  # fmt: skip
        return [max(ends[: i + 1]) - lo for i, lo in enumerate(self._row_lo)]

    def _advance(self, row: int) -> None:
        """Drop the output rows that no tile from ``row`` on reaches."""
        self._row = row
        new_lo = self._row_lo[row]
        if self._sum is not None and self._count is not None and new_lo > self._lo:
            shift = new_lo - self._lo
            held = max(self._sum.shape[1] - shift, 0)
            if held:
                self._sum[:, :held] = self._sum[:, shift:].clone()  # source and target overlap
                self._count[:held] = self._count[shift:].clone()
            self._sum[:, held:].zero_()
            self._count[held:].zero_()
        self._lo = new_lo

"""Tiles that are not run: constant inputs answered from one computed tile, background skipped.

Shapes: ``C`` channels, ``S`` spatial axes, ``B`` tiles in a batch.

Two decisions, both per tile, both made by the engine before the network sees a batch:

- *constant reuse* (exact): a tile whose whole input, halo and padding included, holds one value
  per channel (scanner padding, blank glass, the air outside a CT's field of view) gives the same
  prediction wherever it lies, since the network sees the same array. The first such tile of a
  value runs (with its batch); every tile of that value in a later batch takes a copy of that
  prediction. The crop and the blend window stay
  the tile's own, so the result equals a run without reuse (difference 0 on a deterministic
  predictor; up to the predictor's batch-size rounding otherwise).
- *skip* (a library caller's option): ``skip(tile)`` returns the per-channel values to feed
  instead of reading the tile (its input is never read), or ``None`` to read it. A filled tile is
  constant, so it is answered by constant reuse: a skipped tile equals what the network gives on a
  blank tile of that value, computed once. The service sets no ``skip``: a slide's background is
  skipped one level down, where its region source (``service.slides.SlideRegions``) returns blank
  glass for regions outside the tissue mask without reading them; those tiles are constant, so
  constant reuse answers them (counted in ``n_reused``; ``n_filled`` stays 0).

:class:`TileReuse` carries both settings into :func:`tiling.tiled_inference` and the counts out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiling.grid import Tile, TileGrid

__all__ = ["TileReuse", "read_box"]

#: At most this many distinct constant values keep their prediction (a few in practice: glass,
#: padding, air); a further value's tiles simply run.
MAX_CACHED = 16

SkipRule = Callable[[Tile], Sequence[float] | None]


def read_box(grid: TileGrid, tile: Tile) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(starts, stops)`` of the region ``tile`` reads, in image voxels per axis (halo and any
    padding included: it may reach beyond ``[0, spatial_shape)``)."""
    starts = tuple(s - a.pad_lo for s, a in zip(tile.starts, grid.axes, strict=True))
    return starts, tuple(s + a.tile for s, a in zip(starts, grid.axes, strict=True))


@dataclass
class TileReuse:
    """What :func:`tiling.tiled_inference` may leave unrun, and what it left.

    Attributes:
        skip: ``skip(tile)`` -> per-channel fill values (``C`` floats) for a tile that is not read
            but fed as that constant, or ``None`` to read it; called from the prefetch thread, so
            it must be thread-safe. ``None``: every tile is read.
        constant: reuse the prediction of a constant tile for every later tile of the same values.
        n_tiles: tiles of the run (each tile once; a torch batch of ``N`` images counts ``N`` times).
        n_filled: tiles fed as ``skip``'s fill values (not read).
        n_reused: tiles whose prediction was a copy (not run through the network).
    """

    skip: SkipRule | None = None
    constant: bool = True
    n_tiles: int = 0
    n_filled: int = 0
    n_reused: int = 0
    _cache: dict[bytes, torch.Tensor] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def n_run(self) -> int:
        """Tiles the network ran."""
        return self.n_tiles - self.n_reused

    def counts(self) -> tuple[int, int, int]:
        """``(n_tiles, n_filled, n_reused)`` now: :meth:`rewind` goes back to them."""
        return self.n_tiles, self.n_filled, self.n_reused

    def rewind(self, counts: tuple[int, int, int]) -> None:
        """Set the counts back to ``counts`` (from :meth:`counts`): a run that failed and is run
        again (out of device memory, smaller) counts its tiles once."""
        self.n_tiles, self.n_filled, self.n_reused = counts

    def forget(self) -> None:
        """Drop the kept predictions (a new run, maybe of another tile shape); counts stay."""
        self._cache.clear()

    def fill(self, tile: Tile) -> Sequence[float] | None:
        """The values to feed instead of reading ``tile`` (counted), or ``None``."""
        if self.skip is None:
            return None
        values = self.skip(tile)
        if values is not None:
            with self._lock:
                self.n_filled += 1
        return values

    def keys(self, data: torch.Tensor, filled: Sequence[bool]) -> list[bytes | None]:
        """Per tile of ``data`` ``(B, C, *S)``: the bytes of its per-channel value when it is
        constant (and constant reuse is on, or it was filled), else ``None``. NaN is never constant.

        One reduction over the batch and one transfer of its ``(2, B, C)`` minima and maxima to
        the host (one device sync per batch, not per tile)."""
        n = int(data.shape[0])
        wanted = [self.constant or bool(filled[k]) for k in range(n)]
        if not any(wanted):
            return [None] * n
        lo, hi = torch.aminmax(data.reshape(n, int(data.shape[1]), -1), dim=2)
        bounds = torch.stack([lo, hi]).cpu().numpy()  # the one transfer
        same = (bounds[0] == bounds[1]).all(axis=1)  # NaN != NaN: never constant
        return [bounds[0, k].tobytes() if wanted[k] and same[k] else None for k in range(n)]

    def predict(self, predictor: Callable[[torch.Tensor], Any], data: torch.Tensor, keys: list[bytes | None],
                check: Callable[[Any, int], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The predictions of the batch ``data`` ``(B, C, *S)``: the network runs every tile but the
        constant ones whose value an earlier batch ran (those are copies of its prediction).

        ``check(prediction, n)`` validates a raw predictor output for ``n`` tiles (shape, type) and
        returns it as a tensor.
        """
        self.n_tiles += len(keys)
        first: dict[bytes, int] = {}  # a value first seen in this batch: its first tile is kept
        run: list[int] = []
        for k, key in enumerate(keys):
            if key is None or key not in self._cache:  # a batch runs whole but for values seen before
                run.append(k)
                if key is not None:
                    first.setdefault(key, k)
        if len(run) == len(keys):
            pred = check(predictor(data), len(keys))
        elif run:
            index = torch.tensor(run, device=data.device)
            ran = check(predictor(data.index_select(0, index)), len(run))
            pred = ran.new_empty((len(keys), *ran.shape[1:]))
            pred[index.to(ran.device)] = ran
        else:
            sample = self._cache[next(k for k in keys if k is not None)]
            pred = sample.new_empty((len(keys), *sample.shape))
        for k, key in enumerate(keys):
            if key is None:
                continue
            if key in first:  # ran in this batch
                if first[key] == k and len(self._cache) < MAX_CACHED:
                    self._cache[key] = pred[k].clone()
                continue
            pred[k] = self._cache[key]
            self.n_reused += 1
        return pred

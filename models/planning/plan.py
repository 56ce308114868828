"""The run plan: every parameter of one request resolved, and its tile grid, made once.

:meth:`models.Model.plan` makes it on the preprocessed image's shape; the run, the metrics
(``tilewise_tiles_total``) and the response (``X-Tilewise-Plan``) all read this one object, so
nothing plans or calibrates again after a run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.planning.params import Blend, OutputKind, Tta
from tiling import TileGrid

if TYPE_CHECKING:
    from tiling.distributed import DaskPlan

__all__ = ["RunPlan"]


@dataclass(frozen=True, slots=True)
class RunPlan:
    """One request's resolved parameters and tile grid.

    Attributes:
        model: the model's name.
        spatial_shape: spatial shape of the preprocessed input (voxels).
        tile: requested tile per axis (voxels); the grid feeds ``grid.used_tile_shape``, smaller
            only where the image is.
        halo: halo per axis (voxels), given or calibrated (``halo="auto"``).
        overlap: overlap of neighbouring cores per axis (voxels).
        blend: blend window of overlapping cores.
        batch_size: tiles per forward pass.
        output: probabilities or labels.
        halo_source: ``"given"``, ``"one tile"`` (auto, nothing to calibrate), ``"tile-dependent"``
            (auto on a tile-dependent model: the blended default plan, no search) or the
            calibration's sample.
        grid: the tile grid the run executes (once per entry of :attr:`flips`).
        tta: test-time augmentation.
        warning: one sentence when a given halo is below a local model's receptive-field radius
            on an axis with more than one tile (the ``X-Tilewise-Warning`` header), else ``None``.
        mirror_axes: the spatial axes ``tta=mirror`` flips (the spec's ``mirror_axes``).
        tile_source: where :attr:`tile` came from: ``given`` (the request), ``default`` (the
            spec), ``grown`` (a larger tile where the halo ate the default one) or ``budget``
            (chosen within ``TILEWISE_MEMORY_BUDGET``); see :mod:`models.planning.planner`.
        skipped: tiles not run (outside a slide's tissue mask, or a constant input answered from one
            computed tile: :mod:`tiling.reuse`): after a run the count, before it the tiles expected
            to be skipped when known, else ``None``.
        chunked: the plan a run on a Dask cluster ran (:func:`tiling.distributed.plan_dask`: chunks,
            each block tiled on its own); then :attr:`halo` is its depth, and :attr:`n_tiles` and
            :attr:`work` are summed over the chunks. ``None``: :attr:`grid` ran in process.
    """

    model: str
    spatial_shape: tuple[int, ...]
    tile: tuple[int, ...]
    halo: tuple[int, ...]
    overlap: tuple[int, ...]
    blend: Blend
    batch_size: int
    output: OutputKind
    halo_source: str
    grid: TileGrid
    tta: Tta = Tta.NONE
    warning: str | None = None
    mirror_axes: tuple[int, ...] | None = None
    tile_source: str = "given"
    skipped: int | None = None
    chunked: DaskPlan | None = None

    @property
    def flips(self) -> tuple[tuple[int, ...], ...]:
        """Spatial axes flipped in each tiled pass: ``((),)``, or for ``tta=mirror`` every subset of
        :attr:`mirror_axes` (default: all axes), the empty one first."""
        if self.tta == Tta.NONE:
            return ((),)
        axes = range(len(self.spatial_shape)) if self.mirror_axes is None else self.mirror_axes
        return tuple(c for k in range(len(axes) + 1) for c in itertools.combinations(axes, k))

    @property
    def n_tiles(self) -> int:
        """Tiles fed to the network: the grid's (or the chunks' together), once per tiled pass."""
        per_pass = self.grid.n_tiles if self.chunked is None else self.chunked.n_tiles
        return per_pass * len(self.flips)

    @property
    def work(self) -> float:
        """Voxels fed to the network per input voxel (1.0: no overhead; halos and overlap add)."""
        per_pass = self.grid.work if self.chunked is None else self.chunked.work
        return per_pass * len(self.flips)

    def header(self) -> str:
        """The ``X-Tilewise-Plan`` header value.

        E.g. ``tile=96,96,96; halo=8,8,8; overlap=0,0,0; tiles=27; work=1.49``: the tile fed to the
        network, the halo and overlap per axis, the tile count (every pass) and :attr:`work`. With
        ``tta=mirror`` it ends in ``; passes=8`` (the grid of ``tiles / passes`` tiles ran once per
        flip), so a given tile's grid is seen to be the grid of the same request without TTA; then
        ``; skipped=N`` when tiles were (or are expected to be) skipped. A run on a Dask cluster
        (:attr:`chunked`) ends in ``; chunks=N``: its halo is the chunks' depth, its tiles and work
        those of every chunk's own grid.
        """

        def axes(values: tuple[int, ...]) -> str:
            return ",".join(str(v) for v in values)

        return (
            f"tile={axes(self.grid.used_tile_shape)}; halo={axes(self.halo)}; "
            f"overlap={axes(self.overlap)}; tiles={self.n_tiles}; work={self.work:.2f}"
            + (f"; passes={len(self.flips)}" if len(self.flips) > 1 else "")
            + (f"; skipped={self.skipped}" if self.skipped else "")
            + (f"; chunks={self.chunked.n_chunks}" if self.chunked is not None else "")
        )

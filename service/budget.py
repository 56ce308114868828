"""What one request may cost: batch size, tile count, work and memory, checked from its plan.

A request is refused before any work when its :class:`~models.RunPlan` asks for more than the
server's limits (``TILEWISE_MAX_BATCH_SIZE``, ``TILEWISE_MAX_TILES``, ``TILEWISE_MAX_WORK``,
``TILEWISE_MIN_VOXELS_PER_TILE``, ``TILEWISE_MAX_REQUEST_SECONDS``, ``TILEWISE_MAX_REQUEST_BYTES``);
the error names the figure that was too big and the limit. Every figure is the plan's, on the model
grid (after resampling to the spec's spacing), never the header's:

- ``batch_size``, tile count, ``work`` (voxels through the network per input voxel) and tiles per
  voxel (a tile per 64 input voxels at most, the first 64 tiles free: 29,791 tiles of 4^3 on 64^3
  is 8.8 voxels per tile): 422 ``over_budget`` (:class:`OverBudgetError`): the parameters make the
  request unreasonable; a larger tile, a smaller halo or overlap, or a smaller batch fixes it;
- predicted network time (``eta_s``, :func:`models.planning.cost.network_seconds`): 422 ``over_budget``,
  naming the figure; a run that still passes twice the limit is stopped (:mod:`service.deadline`);
- predicted memory (:func:`models.planning.cost.peak_bytes`, from the network's footprint measured at
  warm-up, plus the decoded input): 413 ``over_budget``
  (:class:`MemoryBudgetError`): the image is too large for this server with these parameters.

The route checks the query's ``batch_size`` before reading the upload and the plan made from the
file's header before queueing it (:func:`service.precheck.precheck`); the pipeline checks the
plan it runs again, before the network sees a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from models.planning.params import InferenceParams
from service.errors import MemoryBudgetError, OverBudgetError

__all__ = ["FREE_TILES", "Budget"]

#: Tiles of one pass never refused for their density (a small image may have few voxels per tile).
FREE_TILES = 64


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True, slots=True)
class Budget:
    """The most one request may ask for; ``None`` leaves a figure unbounded.

    Attributes:
        max_batch_size: tiles per forward pass.
        max_tiles: tiles fed to the network (all ``tta`` passes together).
        max_work: voxels fed to the network per input voxel (:attr:`models.RunPlan.work`).
        max_bytes: predicted peak memory of the request (bytes).
        max_seconds: predicted network seconds of the request (``eta_s``).
        min_voxels_per_tile: input voxels (model grid) per tile of one pass, at least, once the
            pass has more than :data:`FREE_TILES` tiles.
    """

    max_batch_size: int | None = None
    max_tiles: int | None = None
    max_work: float | None = None
    max_bytes: int | None = None
    max_seconds: float | None = None
    min_voxels_per_tile: int | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> Budget:
        """The budget of :class:`~service.settings.Settings` (``max_request_seconds=0``: unbounded)."""
        return cls(
            settings.max_batch_size,
            settings.max_tiles,
            settings.max_work,
            settings.max_request_bytes,
            max_seconds=settings.max_request_seconds or None,
            min_voxels_per_tile=settings.min_voxels_per_tile,
        )

    def check_params(self, params: InferenceParams) -> None:
        """Refuse a ``batch_size`` over the limit from the query alone (before the upload).

        Raises:
            OverBudgetError: naming ``batch_size`` and the limit.
        """
        if params.batch_size is not None:
            self._check_batch(params.batch_size)

    def _check_batch(self, batch_size: int) -> None:
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            raise OverBudgetError(
                f"batch_size={batch_size} exceeds max_batch_size={self.max_batch_size} "
                "(TILEWISE_MAX_BATCH_SIZE); use a smaller batch_size"
            )

    def check_plan(
        self,
        plan: Any,
        in_channels: int,
        out_channels: int,
        *,
        input_bytes: int = 0,
        footprint: Any = None,
        copies_input: bool = True,
        output_on_disk: bool = False,
    ) -> int:
        """Refuse ``plan`` (a :class:`~models.RunPlan`) if it costs more than this budget.

        Args:
            plan: the plan of the request.
            in_channels, out_channels: the model's channels.
            input_bytes: the decoded input's bytes, held beside the plan's own memory.
            footprint: the network's measured :class:`~models.measure.footprint.Footprint` (default: an
                estimate).
            copies_input: whether preprocessing copies the input (:func:`models.planning.cost.peak_bytes`).
            output_on_disk: the output is written to disk as it finishes (a streamed request).

        Returns:
            the predicted peak memory (bytes).

        Raises:
            OverBudgetError: batch size, tile count, tiles per voxel, work or predicted seconds over
                the limit (422).
            MemoryBudgetError: predicted memory over the limit (413).
        """
        from models.planning.cost import peak_bytes

        self._check_batch(plan.batch_size)
        shape = "x".join(str(n) for n in plan.spatial_shape)
        grid = plan.grid
        what = (
            f"tile={','.join(map(str, grid.used_tile_shape))} halo={','.join(map(str, plan.halo))} "
            f"overlap={','.join(map(str, plan.overlap))} on {shape}"
        )
        if self.max_tiles is not None and plan.n_tiles > self.max_tiles:
            raise OverBudgetError(
                f"the plan has {plan.n_tiles} tiles ({what}); the limit is max_tiles={self.max_tiles} "
                "(TILEWISE_MAX_TILES): use a larger tile or a smaller overlap"
            )
        self._check_density(plan, what)
        if self.max_work is not None and plan.work > self.max_work:
            raise OverBudgetError(
                f"the plan feeds work={plan.work:.2f} voxels to the network per input voxel ({what}); "
                f"the limit is max_work={self.max_work:g} (TILEWISE_MAX_WORK): use a larger tile, or a "
                "smaller halo or overlap"
            )
        self.check_seconds(plan, footprint, what)
        need = peak_bytes(
            plan, in_channels, out_channels, footprint, input_bytes=input_bytes, copies_input=copies_input,
            output_on_disk=output_on_disk,
        )  # fmt: skip
        if self.max_bytes is not None and need > self.max_bytes:
            raise MemoryBudgetError(
                f"the request would hold about {need} bytes ({_size(need)}: {what}, "
                f"batch_size={plan.batch_size}); the limit is max_request_bytes={self.max_bytes} "
                f"({_size(self.max_bytes)}, TILEWISE_MAX_REQUEST_BYTES): send a smaller image or use "
                "a smaller tile or batch_size"
            )
        return need

    def _check_density(self, plan: Any, what: str) -> None:
        if self.min_voxels_per_tile is None:
            return
        voxels, tiles = math.prod(plan.spatial_shape), plan.grid.n_tiles
        if tiles > max(FREE_TILES, voxels // self.min_voxels_per_tile):
            raise OverBudgetError(
                f"the plan has {tiles} tiles for {voxels} voxels ({voxels / tiles:.1f} voxels per tile: "
                f"{what}); the limit is min_voxels_per_tile={self.min_voxels_per_tile} "
                "(TILEWISE_MIN_VOXELS_PER_TILE): use a larger tile or a smaller overlap"
            )

    def check_seconds(self, plan: Any, footprint: Any = None, what: str = "") -> float:
        """Refuse ``plan`` when its predicted network time is over ``max_seconds``.

        Args:
            plan: the plan (a :class:`~models.RunPlan`).
            footprint: the network's :class:`~models.measure.footprint.Footprint` (default: an estimate).
            what: the plan in words, for the message.

        Returns:
            the predicted seconds (``eta_s``).

        Raises:
            OverBudgetError: naming ``eta_s`` and ``max_request_seconds`` (422).
        """
        from models.measure.footprint import Footprint
        from models.planning.cost import network_seconds

        fp = footprint or Footprint.estimate(1)
        eta = network_seconds(plan, fp)
        if self.max_seconds is not None and eta > self.max_seconds:
            where = f" ({what})" if what else ""
            raise OverBudgetError(
                f"the plan is predicted to take eta_s={eta:.1f} s of network time{where}; the limit is "
                f"max_request_seconds={self.max_seconds:g} (TILEWISE_MAX_REQUEST_SECONDS): send a "
                "smaller image or fewer tiles (tta=none, a smaller overlap)"
            )
        return eta

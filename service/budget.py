"""What one request may cost: batch size, tile count, work and memory, checked from its plan.

A request is refused before any work when its :class:`~models.RunPlan` asks for more than the
server's limits (``TILEWISE_MAX_BATCH_SIZE``, ``TILEWISE_MAX_TILES``, ``TILEWISE_MAX_WORK``,
``TILEWISE_MAX_REQUEST_BYTES``); the error names the figure that was too big and the limit:

- ``batch_size``, tile count and ``work`` (voxels through the network per input voxel): 422
  ``over_budget`` (:class:`OverBudgetError`): the parameters make the request unreasonable; a larger
  tile, a smaller halo or overlap, or a smaller batch fixes it;
- predicted memory (:func:`models.cost.peak_bytes`, from the network's footprint measured at
  warm-up, plus the decoded input): 413 ``over_budget``
  (:class:`MemoryBudgetError`): the image is too large for this server with these parameters.

The route checks the query's ``batch_size`` before reading the upload and the plan made from the
file's header before queueing it (:func:`service.precheck.precheck`); the pipeline checks the
plan it runs again, before the network sees a tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.params import InferenceParams
from service.errors import MemoryBudgetError, OverBudgetError

__all__ = ["Budget"]


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
    """

    max_batch_size: int | None = None
    max_tiles: int | None = None
    max_work: float | None = None
    max_bytes: int | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> Budget:
        """The budget of :class:`~service.settings.Settings`."""
        return cls(settings.max_batch_size, settings.max_tiles, settings.max_work, settings.max_request_bytes)

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
            footprint: the network's measured :class:`~models.footprint.Footprint` (default: an
                estimate).
            copies_input: whether preprocessing copies the input (:func:`models.cost.peak_bytes`).
            output_on_disk: the output is written to disk as it finishes (a streamed request).

        Returns:
            the predicted peak memory (bytes).

        Raises:
            OverBudgetError: batch size, tile count or work over the limit (422).
            MemoryBudgetError: predicted memory over the limit (413).
        """
        from models.cost import peak_bytes

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
        if self.max_work is not None and plan.work > self.max_work:
            raise OverBudgetError(
                f"the plan feeds work={plan.work:.2f} voxels to the network per input voxel ({what}); "
                f"the limit is max_work={self.max_work:g} (TILEWISE_MAX_WORK): use a larger tile, or a "
                "smaller halo or overlap"
            )
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

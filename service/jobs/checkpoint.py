"""A job's partial output on disk, and the record of its finished slabs.

The network's output goes to ``partial.npy`` in the job's folder, a ``.npy`` memmap of the whole
result (``(C_out, *spatial)`` float32/float16 values, or ``(*spatial)`` uint8 labels), with the
spatial axes in the memory order of the output it is copied to at the end: Fortran for a NIfTI
(the last spatial axis slowest, so that the copy goes slab by slab along it, each slab one run of
the checkpoint and one run per channel of the NIfTI), C otherwise. The price of Fortran order:
every tile row dirties pages across the whole file, so the flush after each row writes about the
whole file again (an 800-slice CT job wrote 5.9 GB against 2.7 GB in C order, and ran 18 %
faster: no transposing copy at the end). A record saved before the order was kept names C. The engine
writes it slab by slab along axis 0; a *slab* is the output of one tile row (every tile with the
same index along axis 0), final once the row's last tile is merged (:mod:`tiling.resume`). Each
finished slab is flushed (``msync``), then recorded in the job's ``state.json``
(``checkpoint.rows_done``), in that order, so a record never names a slab that is not on disk.

A run that starts over (the owner died; another replica, or the restarted one, took the job) finds
the memmap and the record. When the record was made for the same plan (the ``X-Tilewise-Plan``
header, the grid, the batch size, the output layout), the run continues after the last recorded
slab; otherwise it starts from zero. Tiles computed twice after a kill: those of the slab in
progress (at most one tile row), plus one more row when cores overlap along axis 0, plus fewer
than ``batch_size`` to keep the batches of an uninterrupted run (so that the result is bit for bit
the same).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiling import Resume, ResumePoint, resume_point

__all__ = ["SlabCheckpoint"]

logger = logging.getLogger(__name__)


class SlabCheckpoint:
    """:class:`service.pipeline.Checkpoint` over a job's folder.

    Args:
        path: the memmap file (``partial.npy``).
        saved: the record of an earlier run (``state.json``'s ``checkpoint``), or ``None``.
        save: persists a new record (durably: it is what a later run trusts).
        on_start: told where the run starts (the plan and the resume point), before any tile runs.
    """

    def __init__(
        self,
        path: Path,
        saved: dict[str, Any] | None,
        save: Callable[[dict[str, Any]], None],
        on_start: Callable[[Any, ResumePoint], None],
    ) -> None:
        self.path = path
        self.saved = saved
        self.save = save
        self.on_start = on_start
        self._key: dict[str, Any] = {}

    def start(
        self, plan: Any, shape: tuple[int, ...], dtype: np.dtype[Any], order: str = "C"
    ) -> tuple[Any, Resume]:
        """The memmap for ``plan`` (memory ``order`` ``"C"`` or ``"F"``) and the
        :class:`tiling.Resume` that continues the saved run."""
        key = {
            "plan": plan.header(),
            "grid": list(plan.grid.grid_shape),
            "batch_size": int(plan.batch_size),
            "shape": list(shape),
            "dtype": str(dtype),
            "order": order,
        }
        self._key = key
        rows = 0
        out: Any = None
        saved = self.saved or {}
        before = saved.get("key")
        if isinstance(before, dict) and "order" not in before:  # saved before the order was kept: C
            before = {**before, "order": "C"}
        if before == key and self.path.is_file() and len(plan.flips) == 1:
            try:
                out = np.lib.format.open_memmap(self.path, mode="r+")
            except (OSError, ValueError) as exc:
                logger.warning("%s unreadable (%s): starting over", self.path, exc)
            else:
                if out.shape == tuple(shape) and out.dtype == dtype and _in_order(out, order):
                    rows = int(saved.get("rows_done", 0))
                else:  # a file that does not match its record (replaced, or written by another run)
                    logger.warning("%s does not match its record: starting over", self.path)
                    out = None
        if out is None:
            out = np.lib.format.open_memmap(
                self.path, mode="w+", dtype=dtype, shape=tuple(shape), fortran_order=order == "F"
            )
            self.save({"key": key, "rows_done": 0})
        point = resume_point(plan.grid, rows, int(plan.batch_size))
        self.on_start(plan, point)
        return out, Resume(point.rows_done, self._rows_done)

    def _rows_done(self, rows: int) -> None:
        self.save({"key": self._key, "rows_done": rows})


def _in_order(array: np.ndarray, order: str) -> bool:
    """Whether ``array``'s memory is in ``order`` (``"C"`` or ``"F"``); an array with at most one
    axis longer than 1 is in both."""
    return bool(array.flags.f_contiguous if order == "F" else array.flags.c_contiguous)

"""Coverage-normalized overlap-add over a slab of the output.

The accumulator holds fp32 weighted sums for the output rows (along axis 0) that tiles still add
to; finished rows are divided by the coverage, handed back, and dropped. Coverage is the product of
per-axis 1-D coverages (the grid is Cartesian and the windows separable), so no full-size coverage
map exists, and no count is ever held in a narrow integer or fp16 type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from tiling.errors import AccumulatorStateError, CoverageError

__all__ = ["SlabAccumulator"]


class SlabAccumulator:
    """Accumulate weighted tile outputs and release normalized slabs along axis 0.

    Args:
        channels: output channels ``C``.
        out_shape: spatial shape of the whole output (voxels).
        coverages: per axis, a ``(out_shape[a],)`` coverage vector, or ``None`` for all ones.
        device: where the fp32 buffer lives.
        rows: buffer rows to allocate up front: the most rows one row of tiles holds at once (the
            slab merger passes the longest kept span along axis 0). ``0``: grow on demand.

    Memory: ``4 * C * rows * prod(out_shape[1:])`` bytes, with ``rows`` at most one core plus the
    overlap along axis 0. The buffer is allocated once (grown only if a later row needs more than
    ``rows``; while it grows, old and new buffer coexist) and reused row after row, so no slab-sized
    temporaries are churned through the allocator.
    """

    def __init__(
        self,
        channels: int,
        out_shape: Sequence[int],
        coverages: Sequence[npt.NDArray[np.float32] | None],
        device: torch.device,
        rows: int = 0,
        *,
        origin: int = 0,
    ) -> None:
        self.channels = channels
        self.out_shape = tuple(out_shape)
        self.device = device
        self._cov = [
            None if c is None else torch.from_numpy(np.asarray(c, dtype=np.float32)).to(device)
            for c in coverages
        ]
        self._lo = origin  # output row held in buffer row self._off
        self._off = 0
        self._rows = 0  # rows held from self._off; buffer rows from self._off + self._rows on are zero
        self._buf = torch.zeros((channels, rows, *self.out_shape[1:]), dtype=torch.float32, device=device)
        self._done = False

    @property
    def lo(self) -> int:
        """First output row (axis 0) still held."""
        return self._lo

    def add(self, write: Sequence[slice], values: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Add ``values * weight`` at ``write`` (output coordinates).

        Args:
            write: one slice per spatial axis, in output coordinates.
            values: ``(C, *region)`` float32.
            weight: ``(*region)`` float32 blend weights, or ``None`` for ones.

        Raises:
            AccumulatorStateError: after :meth:`finalize`, or for rows already released.
        """
        if self._done:
            raise AccumulatorStateError("add() after finalize()")
        start, stop = write[0].start, write[0].stop
        if start < self._lo:
            raise AccumulatorStateError(f"rows {start}..{self._lo} were already released")
        need = stop - self._lo
        if self._off + need > self._buf.shape[1]:
            self._make_room(need)
        self._rows = max(self._rows, need)
        base = self._off - self._lo
        local = (slice(None), slice(base + start, base + stop), *write[1:])
        if weight is None:
            self._buf[local] += values
        else:
            self._buf[local].addcmul_(values, weight)  # in place: no tile-sized temporary

    def release(self, until: int) -> tuple[int, torch.Tensor]:
        """Normalize and hand back rows ``[lo, until)``; returns ``(lo, (C, rows, ...))``.

        The returned tensor is a view of the reused buffer: consume (write or copy) it before the
        next :meth:`add`.

        Raises:
            AccumulatorStateError: after :meth:`finalize`.
            CoverageError: a released voxel has zero coverage (an engine bug).
        """
        if self._done:
            raise AccumulatorStateError("release() after finalize()")
        n = until - self._lo
        if n > self._rows:
            raise AccumulatorStateError(
                f"rows up to {until} were never added (held up to {self._lo + self._rows})"
            )
        lo = self._lo
        region = self._buf[:, self._off : self._off + n]
        self._normalize(region, lo, until)  # in place: no slab-sized temporaries
        self._off += n
        self._rows -= n
        self._lo = until
        return lo, region

    def finalize(self) -> tuple[int, torch.Tensor]:
        """Release every remaining row; the accumulator accepts nothing afterwards."""
        out = self.release(self._lo + self._rows)
        self._done = True
        return out

    def _make_room(self, need: int) -> None:
        """Move the held rows to the front of the buffer (growing it to ``need`` rows if smaller)."""
        held = self._buf[:, self._off : self._off + self._rows]
        if need <= self._buf.shape[1]:
            self._buf[:, : self._rows] = held.clone()  # the source may overlap the destination
            self._buf[:, self._rows :].zero_()
        else:
            grown = torch.zeros((self.channels, need, *self.out_shape[1:]), dtype=torch.float32,
                                device=self.device)  # fmt: skip
            grown[:, : self._rows] = held
            self._buf = grown
        self._off = 0

    def _normalize(self, region: torch.Tensor, lo: int, hi: int) -> None:
        """Divide ``region`` (rows ``lo..hi``) in place by the coverage, one per-axis vector at a time.

        The coverage is the product of per-axis vectors; dividing by each in turn never materializes
        a slab-sized coverage tensor.
        """
        ndim = len(self.out_shape)
        for axis, cov in enumerate(self._cov):
            if cov is None:
                continue
            vec = cov[lo:hi] if axis == 0 else cov
            if not bool((vec > 0).all()):  # pragma: no cover - plan guarantees positive coverage
                raise CoverageError(f"zero coverage in output rows {lo}..{hi} (axis {axis})")
            shape = [1] * (ndim + 1)
            shape[axis + 1] = vec.shape[0]
            region /= vec.reshape(shape)

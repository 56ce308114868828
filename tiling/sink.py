"""Output sinks: where finished regions go (in-memory array, ``out`` array, or memmap)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiling.errors import ShapeMismatchError

__all__ = ["Sink"]


class Sink:
    """Receives finished ``(C, *region)`` tensors and writes them into the output array.

    The output is allocated on the first write (when its channel count and dtype are known) unless
    ``out`` is given, whose shape is checked against ``(C, *out_shape)``.

    Args:
        out: array to fill (numpy, ``numpy.memmap``, torch tensor) or ``None``.
        out_shape: spatial shape of the output (voxels).
        like: ``"numpy"`` or ``"torch"``: the array type to allocate when ``out`` is ``None``.
        device: device of an allocated torch output.
        floor: output row (axis 0) below which nothing is written (a resumed run,
            :mod:`tiling.resume`: the rows below are final already).
    """

    def __init__(
        self,
        out: Any,
        out_shape: Sequence[int],
        *,
        like: str,
        device: torch.device | None = None,
        floor: int = 0,
    ) -> None:
        self.out = out
        self.floor = floor
        self.out_shape = tuple(out_shape)
        self.like = like
        self.device = device
        if out is not None and tuple(out.shape[1:]) != self.out_shape:
            raise ShapeMismatchError(
                f"out has shape {tuple(out.shape)}; expected (C, *{self.out_shape}) for this input"
            )

    def write(self, write: Sequence[slice], values: torch.Tensor) -> None:
        """Write ``values`` ``(C, *region)`` at the spatial slices ``write`` (minus rows below the floor)."""
        lo, hi = write[0].start, write[0].stop
        if lo < self.floor:
            if hi <= self.floor:
                return
            values = values[:, self.floor - lo :]
            write = (slice(self.floor, hi), *write[1:])
        if self.out is None:
            shape = (values.shape[0], *self.out_shape)
            if self.like == "torch":
                self.out = torch.zeros(shape, dtype=values.dtype, device=self.device)
            else:
                self.out = np.zeros(shape, dtype=_numpy_dtype(values.dtype))
        elif self.out.shape[0] != values.shape[0]:
            raise ShapeMismatchError(
                f"out has {self.out.shape[0]} channels but the (reduced) output has {values.shape[0]}"
            )
        index = (slice(None), *write)
        if isinstance(self.out, torch.Tensor):
            self.out[index] = values.to(self.out.device, self.out.dtype)
        else:
            self.out[index] = values.detach().cpu().numpy()

    def flush(self) -> None:
        """Flush a memory-mapped output to disk (finished slabs leave the page cache dirty-free)."""
        flush = getattr(self.out, "flush", None)
        if callable(flush) and not isinstance(self.out, torch.Tensor):
            flush()

    def result(self) -> Any:
        """The filled output array."""
        if self.out is None:  # pragma: no cover - every plan writes at least one region
            raise ShapeMismatchError("no output was written")
        return self.out


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return torch.empty((), dtype=dtype).numpy().dtype

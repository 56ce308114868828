"""Lazy reading of tile regions from numpy arrays, memmaps, torch tensors and array-likes.

Only the voxels one tile needs are read: a contiguous slice of the source (so nibabel's
``ArrayProxy`` and ``numpy.memmap`` read just that part from disk), then the virtual coordinates
beyond the image edge are filled by the padding mode. Padding follows ``numpy.pad``: ``constant``
(zeros), ``reflect`` (mirror without repeating the edge voxel) and ``replicate`` (numpy's ``edge``),
for pads of any width, including pads wider than the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tiling.geometry import PaddingMode

__all__ = ["read_region", "source_indices"]


def source_indices(start: int, stop: int, length: int, mode: PaddingMode) -> npt.NDArray[np.int64]:
    """Map image indices ``start .. stop - 1`` (possibly outside ``[0, length)``) into the image.

    Returns:
        ``(stop - start,)`` int64 indices into ``[0, length)``; ``-1`` marks voxels that take the
        constant padding value.

    >>> source_indices(-3, 6, 4, PaddingMode.REFLECT).tolist()
    [3, 2, 1, 0, 1, 2, 3, 2, 1]
    """
    v = np.arange(start, stop, dtype=np.int64)
    if mode is PaddingMode.CONSTANT:
        return np.where((v >= 0) & (v < length), v, -1)
    if mode is PaddingMode.REPLICATE or length == 1:
        return np.clip(v, 0, length - 1)
    period = 2 * (length - 1)
    m = np.mod(v, period)
    return np.where(m >= length, period - m, m)


def read_region(
    source: Any,
    starts: Sequence[int],
    stops: Sequence[int],
    spatial_shape: Sequence[int],
    mode: PaddingMode,
) -> torch.Tensor:
    """Read ``source[:, starts:stops]`` as float32, padding outside the image.

    Args:
        source: ``(C, *spatial)`` numpy array, memmap, torch tensor or array-like with
            ``__getitem__`` taking a tuple of slices.
        starts, stops: the region per spatial axis in image coordinates (may lie outside).
        spatial_shape: the image's spatial shape.
        mode: padding for voxels outside the image.

    Returns:
        ``(C, *(stops - starts))`` float32 tensor (on the source's device for torch sources, else
        on the CPU).
    """
    index_maps = [source_indices(a, b, n, mode) for a, b, n in zip(starts, stops, spatial_shape, strict=True)]
    slices: list[slice] = [slice(None)]
    takes: list[npt.NDArray[np.int64] | None] = []
    for idx in index_maps:
        valid = idx[idx >= 0]
        lo, hi = (int(valid.min()), int(valid.max()) + 1) if valid.size else (0, 0)
        slices.append(slice(lo, hi))
        identity = valid.size == idx.size and hi - lo == idx.size and bool(np.all(np.diff(idx) == 1))
        takes.append(None if identity else idx - lo)
    if isinstance(source, torch.Tensor):
        block = source[tuple(slices)].to(torch.float32)
    else:
        array = np.ascontiguousarray(np.asarray(source[tuple(slices)], dtype=np.float32))
        if not array.flags.writeable:  # e.g. a contiguous slice of a read-only memmap: torch warns
            array = array.copy()
        block = torch.from_numpy(array)
    if all(t is None for t in takes):
        return block.contiguous()
    for axis, take in enumerate(takes, start=1):
        if take is None:
            continue
        pad = take < 0
        if pad.any():
            zero = torch.zeros((*block.shape[:axis], 1, *block.shape[axis + 1 :]), dtype=block.dtype,
                               device=block.device)  # fmt: skip
            block = torch.cat([block, zero], dim=axis)
            take = np.where(pad, block.shape[axis] - 1, take)
        block = torch.index_select(block, axis, torch.from_numpy(take).to(block.device))
    return block.contiguous()

"""Lazy reading of tile regions from numpy arrays, memmaps, torch tensors and array-likes.

Only the voxels one tile needs are read: a contiguous slice of the source (so nibabel's
``ArrayProxy`` and ``numpy.memmap`` read just that part from disk), copied once into the tile's
buffer; then the virtual coordinates beyond the image edge are filled by the padding mode.
Padding follows ``numpy.pad``: ``constant`` (zeros), ``reflect`` (mirror without repeating the edge
voxel) and ``replicate`` (numpy's ``edge``), for pads of any width, including pads wider than the
image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tiling.geometry import PaddingMode

__all__ = ["read_into", "read_region", "source_indices"]


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
    """Read ``source[:, starts:stops]`` as a new float32 tensor, padding outside the image.

    Args:
        source: ``(C, *spatial)`` numpy array, memmap, torch tensor or array-like with
            ``__getitem__`` taking a tuple of slices.
        starts, stops: the region per spatial axis in image coordinates (may lie outside).
        spatial_shape: the image's spatial shape.
        mode: padding for voxels outside the image.

    Returns:
        ``(C, *(stops - starts))`` contiguous float32 tensor (on the source's device for torch
        sources, else on the CPU).
    """
    device = source.device if isinstance(source, torch.Tensor) else torch.device("cpu")
    sizes = [int(b) - int(a) for a, b in zip(starts, stops, strict=True)]
    dst = torch.empty((int(source.shape[0]), *sizes), dtype=torch.float32, device=device)
    read_into(source, starts, stops, spatial_shape, mode, dst)
    return dst


def read_into(
    source: Any,
    starts: Sequence[int],
    stops: Sequence[int],
    spatial_shape: Sequence[int],
    mode: PaddingMode,
    dst: torch.Tensor,
) -> None:
    """Fill ``dst`` with ``source[:, starts:stops]``, padding outside the image, one copy per voxel.

    The part of the region inside the image is copied from the source straight into ``dst`` (one
    copy, with the cast to ``dst``'s dtype). The padding is filled strip by strip: for each axis,
    the voxels beyond the image on that axis (and inside it on the axes before): zeros for
    ``constant``, else gathered from the block that was read (temporaries only as large as a strip).

    Args:
        source: as for :func:`read_region`.
        starts, stops: the region per spatial axis in image coordinates (may lie outside).
        spatial_shape: the image's spatial shape.
        mode: padding for voxels outside the image.
        dst: ``(C, *(stops - starts))`` tensor to fill (e.g. one slot of a batch buffer); a CPU tensor
            for numpy and array-like sources.

    >>> dst = torch.empty(1, 6)
    >>> read_into(np.arange(4.0)[None], (-1,), (5,), (4,), PaddingMode.REFLECT, dst)
    >>> dst.tolist()
    [[1.0, 0.0, 1.0, 2.0, 3.0, 2.0]]
    """
    maps = [source_indices(a, b, n, mode) for a, b, n in zip(starts, stops, spatial_shape, strict=True)]
    lows: list[int] = []
    slices: list[slice] = [slice(None)]
    for idx in maps:
        valid = idx[idx >= 0]
        lo, hi = (int(valid.min()), int(valid.max()) + 1) if valid.size else (0, 0)
        lows.append(lo)
        slices.append(slice(lo, hi))
    block = source[tuple(slices)]  # a view for numpy, memmap and torch; a read for array proxies
    if not isinstance(block, torch.Tensor):
        block = np.asarray(block)
    # inner[a] = (d0, d1): the positions of dst along axis a that lie inside the image
    inner = []
    for a, b, n in zip(starts, stops, spatial_shape, strict=True):
        size = int(b) - int(a)
        d0 = min(max(-int(a), 0), size)
        inner.append((d0, min(max(int(n) - int(a), d0), size)))
    if all(d1 > d0 for d0, d1 in inner):
        src = tuple(
            slice(a + d0 - lo, a + d1 - lo) for a, (d0, d1), lo in zip(starts, inner, lows, strict=True)
        )
        _copy(dst[(slice(None), *(slice(d0, d1) for d0, d1 in inner))], block[(slice(None), *src)])
    ndim = len(maps)
    for axis in range(ndim):
        d0, d1 = inner[axis]
        for p0, p1 in ((0, d0), (d1, dst.shape[axis + 1])):
            if p1 <= p0:
                continue
            region = (
                [slice(*inner[j]) for j in range(axis)] + [slice(p0, p1)] + [slice(None)] * (ndim - axis - 1)
            )
            strip = dst[(slice(None), *region)]
            if strip.numel() == 0:
                continue
            if mode is PaddingMode.CONSTANT:
                strip.zero_()
                continue
            picks = (
                [maps[j][slice(*inner[j])] for j in range(axis)]
                + [maps[axis][p0:p1]]
                + list(maps[axis + 1 :])
            )
            _copy(strip, _gather(block, [m - lo for m, lo in zip(picks, lows, strict=True)]))


def _gather(block: Any, picks: Sequence[npt.NDArray[np.int64]]) -> Any:
    """``block[:, picks[0], picks[1], ...]`` (outer product), one axis at a time.

    The axis that shrinks the block most goes first, so the temporaries stay about the size of the
    result (numpy's outer-product fancy indexing would also build result-sized index arrays).
    """
    order = sorted(range(len(picks)), key=lambda a: len(picks[a]) / max(int(block.shape[a + 1]), 1))
    out = block
    for axis in order:
        idx = picks[axis]
        if idx.size == out.shape[axis + 1] and bool(np.all(idx == np.arange(idx.size))):
            continue
        if isinstance(out, torch.Tensor):
            out = torch.index_select(out, axis + 1, torch.from_numpy(idx).to(out.device))
        else:  # not np.take: it first copies a non-contiguous block whole
            out = out[(slice(None),) * (axis + 1) + (idx,)]
    return out


def _copy(dst: torch.Tensor, src: Any) -> None:
    """Copy a torch tensor or numpy array into ``dst`` (casting to its dtype), without aliasing."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif dst.device.type == "cpu":
        np.copyto(dst.numpy(), src, casting="unsafe")  # also non-native byte order, read-only sources
    else:
        dst.copy_(torch.from_numpy(np.array(src, dtype=np.float32)))

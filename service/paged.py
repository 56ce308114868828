"""Memory-mapped arrays whose pages go back to the page cache as the run moves on.

A shared file mapping counts in the process's resident memory (``RssFile``, and so ``VmHWM``)
for every page touched, until it is unmapped: writing a 6 GB output through ``numpy.memmap``
"costs" 6 GB of RSS although the kernel could drop every page at will. :class:`PagedMemmap` is a
``numpy.memmap`` that keeps few of its pages mapped: before a read or write that would take them
past :data:`HOLD_BYTES`, after a write that leaves more than :data:`PIECE_BYTES`, and on
:meth:`~PagedMemmap.flush`, it advises the kernel that it no longer needs the pages mapped so far
(``madvise(MADV_DONTNEED)``). For a shared file mapping that discards nothing: the data stay in
the page cache (dirty ones are written back) and a later access maps them again. Views (slices,
``reshape``, ``moveaxis``, ``[None]``) keep the behaviour; they share one counter.

What an access maps is bounded by the bytes its view *spans* (first to last byte), not by the
bytes it holds: the kernel maps a faulted page's whole page-cache folio, and folios are large
(up to :data:`FOLIO_BYTES`) when read-ahead is (issue 20: one 99 x 99 x 112 float32 tile written
into a Fortran-ordered 512 x 512 x 400 NIfTI holds 4.2 MiB of data on about 22 MiB of 4 KiB
pages, and mapped 87 MiB). So every access counts its span plus a folio at each end, and a write
spanning more than :data:`PIECE_BYTES` is cut into pieces that do not (along its axes of largest
stride; the pieces of a tile then lie on separate folios), each counted before it is written. A
mapping's resident pages stay under :data:`HOLD_BYTES` during a write and under
:data:`PIECE_BYTES` between two writes (while the engine computes the next tiles), whatever the
layout (C or Fortran order) and the shape of the writes: well under :data:`DROP_BYTES`, what
the cost model counts. A read's view cannot be cut: it maps up to its own cost (callers read in
blocks).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from models.planning.cost import STREAMED_OUTPUT_BYTES

__all__ = [
    "DROP_BYTES",
    "FOLIO_BYTES",
    "HOLD_BYTES",
    "PIECE_BYTES",
    "PagedMemmap",
    "open_paged",
    "paged",
    "unit_to_uint8",
]

#: What the cost model counts for an output on disk (64 MiB): the bound on one mapping's
#: resident pages that :data:`HOLD_BYTES` and :data:`PIECE_BYTES` keep well under.
DROP_BYTES = STREAMED_OUTPUT_BYTES
#: Most bytes of one mapping's pages resident during a write (16 MiB).
HOLD_BYTES = DROP_BYTES // 4
#: Most bytes a write spans in one piece, and most kept mapped after a write (8 MiB).
PIECE_BYTES = DROP_BYTES // 8


def _folio_bytes() -> int:
    """The largest page-cache folio the kernel maps on one fault: the PMD size (2 MiB on x86-64),
    from ``/sys/kernel/mm/transparent_hugepage/hpage_pmd_size``; at most 8 MiB."""
    try:
        size = int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        size = 2 << 20
    return max(mmap.PAGESIZE, min(size, 8 << 20))


#: Bytes an access may map beyond each end of what it spans (a whole folio; see the module docstring).
FOLIO_BYTES = _folio_bytes()


class _Counter:
    __slots__ = ("lock", "touched")

    def __init__(self) -> None:
        self.touched = 0
        self.lock = threading.Lock()


class PagedMemmap(np.memmap):
    """A ``numpy.memmap`` whose mapped pages are handed back as it goes (see the module
    docstring). Make one with :func:`open_paged`."""

    _counter: _Counter | None = None
    #: Values written are probabilities stored as uint8: ``round(255 * clip(p, 0, 1))``.
    _unit_to_uint8: bool = False

    def __array_finalize__(self, obj: Any) -> None:
        super().__array_finalize__(obj)
        self._counter = getattr(obj, "_counter", None)
        self._unit_to_uint8 = getattr(obj, "_unit_to_uint8", False)

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._unit_to_uint8:
            value = unit_to_uint8(np.asarray(value))
        if self._counter is None:
            super().__setitem__(key, value)
            return
        target = np.ndarray.__getitem__(self, key) if _basic(key) else None
        if not isinstance(target, np.ndarray):  # one element, or a fancy index (the whole span)
            self._reserve(_cost(self) if target is None else 2 * FOLIO_BYTES)
            super().__setitem__(key, value)
            self._settle()
            return
        value = np.asarray(value)
        if np.may_share_memory(value, target):  # pieces must not read what earlier ones wrote
            value = value.copy()
        extra = value.ndim - target.ndim  # numpy drops leading length-1 axes of the value
        if extra > 0 and all(n == 1 for n in value.shape[:extra]):
            value = value.reshape(value.shape[extra:])
        value = np.broadcast_to(value, target.shape)
        for piece in _pieces(target.shape, target.strides, target.itemsize):
            view = np.ndarray.__getitem__(target, piece)
            self._reserve(_cost(view))
            np.copyto(view, value[piece], casting="unsafe")
        self._settle()

    def __getitem__(self, key: Any) -> Any:
        got = super().__getitem__(key)
        if isinstance(got, np.ndarray) and self._counter is not None:
            self._reserve(_cost(got))  # before the caller reads it
        return got

    def flush(self) -> None:
        """Write dirty pages back and hand every page of the mapping back."""
        super().flush()
        self.drop()

    def drop(self) -> None:
        """Advise the kernel that no page of the mapping is needed now (data stay in the file)."""
        mm = getattr(self, "_mmap", None)
        if mm is not None and not mm.closed:
            mm.madvise(mmap.MADV_DONTNEED)
        if self._counter is not None:
            self._counter.touched = 0

    def _settle(self) -> None:
        """After a write: hand the pages back when more than :data:`PIECE_BYTES` are mapped, so that
        between writes (while the engine computes the next tiles) a mapping holds little."""
        counter = self._counter
        if counter is not None and counter.touched > PIECE_BYTES:
            self.drop()

    def _reserve(self, cost: int) -> None:
        """Count ``cost`` bytes about to be mapped; hand the mapped pages back first when they
        would pass :data:`HOLD_BYTES`."""
        counter = self._counter
        if counter is None or cost <= 0:
            return
        with counter.lock:
            due = counter.touched > 0 and counter.touched + cost > HOLD_BYTES
            counter.touched = cost if due else counter.touched + cost
        if due:
            mm = getattr(self, "_mmap", None)
            if mm is not None and not mm.closed:
                mm.madvise(mmap.MADV_DONTNEED)


def paged(array: np.memmap) -> PagedMemmap:
    """``array`` (a ``numpy.memmap``, e.g. ``np.lib.format.open_memmap``'s) as a
    :class:`PagedMemmap` on the same mapping."""
    view = array.view(PagedMemmap)
    view._counter = _Counter()
    return view


def unit_to_uint8(values: np.ndarray) -> np.ndarray:
    """Probabilities as uint8: ``round(255 * clip(p, 0, 1))`` (NaN as 0)."""
    if values.dtype == np.uint8:
        return values
    scaled: np.ndarray = np.rint(
        np.clip(np.nan_to_num(values.astype(np.float32, copy=False)), 0.0, 1.0) * 255.0
    )
    return scaled.astype(np.uint8)


def _span(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the first to the last byte of a strided view (0 when it is empty)."""
    if 0 in shape:
        return 0
    return itemsize + sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True))


def _cost(view: np.ndarray) -> int:
    """Bytes of pages an access to ``view`` may map: its span and a folio beyond each end."""
    span = _span(view.shape, view.strides, view.itemsize)
    return span + 2 * FOLIO_BYTES if span else 0


def _basic(key: Any) -> bool:
    """``key`` is a basic index (ints, slices, ``None``, ``...``): ``array[key]`` is a view."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(
        isinstance(k, (int, np.integer, slice)) or k is None or k is Ellipsis for k in parts
    ) and not any(isinstance(k, bool) for k in parts)


def _pieces(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, budget: int = 0
) -> Iterator[tuple[slice, ...]]:
    """Slices (one per axis) cutting a view of ``shape`` and ``strides`` into pieces that each span
    at most ``budget`` bytes (default :data:`PIECE_BYTES`), cut along the axes of largest stride
    first; a piece never spans less than one run along the axis of smallest stride would need."""
    budget = budget or PIECE_BYTES
    whole = tuple(slice(0, n) for n in shape)
    axes = [a for a, n in enumerate(shape) if n > 1]
    if not axes or _span(shape, strides, itemsize) <= budget:
        yield whole
        return
    axis = max(axes, key=lambda a: abs(strides[a]))
    n, stride = shape[axis], abs(strides[axis])
    one = (*shape[:axis], 1, *shape[axis + 1 :])
    rest = _span(one, strides, itemsize)
    if rest <= budget:
        step = (budget - rest) // stride + 1
        for i in range(0, n, step):
            yield (*whole[:axis], slice(i, min(i + step, n)), *whole[axis + 1 :])
        return
    inner = list(_pieces(one, strides, itemsize, budget))
    for i in range(n):
        for sub in inner:
            yield (*sub[:axis], slice(i, i + 1), *sub[axis + 1 :])


def open_paged(
    path: str | Path,
    dtype: Any,
    shape: tuple[int, ...],
    *,
    mode: Literal["r", "r+", "w+"] = "r+",
    offset: int = 0,
    order: Literal["C", "F"] = "C",
) -> PagedMemmap:
    """Map ``path`` (from byte ``offset``) as a :class:`PagedMemmap` of ``shape`` and ``dtype``.

    ``mode``: ``"r"`` (read), ``"r+"`` (read and write an existing file, at least ``offset +``
    the array's bytes long), ``"w+"`` (create or overwrite).
    """
    array = np.memmap(path, dtype=dtype, mode=mode, shape=shape, offset=offset, order=order).view(PagedMemmap)
    array._counter = _Counter()
    return array

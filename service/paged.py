"""Memory-mapped arrays whose pages go back to the page cache as the run moves on.

A shared file mapping counts in the process's resident memory (``RssFile``, and so ``VmHWM``)
for every page touched, until it is unmapped: writing a 6 GB output through ``numpy.memmap``
"costs" 6 GB of RSS although the kernel could drop every page at will. :class:`PagedMemmap` is a
``numpy.memmap`` that, after roughly :data:`DROP_BYTES` of pages touched by its reads and writes,
and on :meth:`~PagedMemmap.flush`, advises the kernel that it no longer needs them
(``madvise(MADV_DONTNEED)``). For a shared file mapping that discards nothing: the data stay in
the page cache (dirty ones are written back) and a later access maps them again. Views
(slices, ``reshape``, ``moveaxis``, ``[None]``) keep the behaviour; they share one counter.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np

from models.planning.cost import STREAMED_OUTPUT_BYTES

__all__ = ["DROP_BYTES", "PagedMemmap", "open_paged", "paged", "unit_to_uint8"]

#: Bytes of pages touched between two ``MADV_DONTNEED`` (64 MiB: what the cost model counts for
#: an output on disk).
DROP_BYTES = STREAMED_OUTPUT_BYTES
_PAGE = mmap.PAGESIZE


class _Counter:
    __slots__ = ("lock", "touched")

    def __init__(self) -> None:
        self.touched = 0
        self.lock = threading.Lock()


class PagedMemmap(np.memmap):
    """A ``numpy.memmap`` whose touched pages are handed back every :data:`DROP_BYTES` (see the
    module docstring). Make one with :func:`open_paged`."""

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
        super().__setitem__(key, value)
        self._touch(np.ndarray.__getitem__(self, key))

    def __getitem__(self, key: Any) -> Any:
        got = super().__getitem__(key)
        if isinstance(got, np.ndarray):
            self._touch(got)
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

    def _touch(self, view: np.ndarray) -> None:
        counter = self._counter
        if counter is None or view.size == 0:
            return
        with counter.lock:
            counter.touched += _touched_bytes(view)
            due = counter.touched >= DROP_BYTES
            if due:
                counter.touched = 0
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


def _touched_bytes(view: np.ndarray) -> int:
    """Bytes of pages a strided view touches, about: each contiguous run costs at least a page."""
    strides = [abs(s) for s, n in zip(view.strides, view.shape, strict=True) if n > 1]
    if not strides:
        return _PAGE
    axis = int(
        np.argmin([abs(s) if n > 1 else np.inf for s, n in zip(view.strides, view.shape, strict=True)])
    )
    if abs(view.strides[axis]) != view.itemsize:
        return view.size * _PAGE  # every element in its own page, at worst
    run = int(view.shape[axis]) * view.itemsize
    return (view.size // int(view.shape[axis])) * max(run, _PAGE)


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

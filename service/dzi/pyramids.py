"""An image file as a pyramid of levels, read by box, for Deep Zoom tiles (issue 21 item 6).

Shapes: a level's box is ``(h, w, C)`` in the file's dtype; ``levels[k] = (width, height)``.

No tile is cut from a fully decoded level 0. A tile is read from the file's own pyramid level
``k`` with the largest downsample ``s_k <= d`` (tiffslide, from the ``slides`` extra, for
pyramidal TIFF, SVS, NDPI and OME-TIFF; tifffile's zarr store for any other TIFF, or when
tiffslide is not installed), only the level-``k`` box under the tile
(``floor(x0 * d / s_k) .. ceil(x1 * d / s_k)``: :func:`source_box`), and resized to the tile's
size (:mod:`service.dzi.render`). When even the coarsest level would need more than
:data:`MAX_READ_PIXELS` for one tile (a flat TIFF seen from afar), an overview
(``coarsest[::f, ::f]``, at most :data:`OVERVIEW_EDGE` a side) is made once, band by band (memory
``f`` rows of the coarsest level), and kept beside the file; it then serves as one more level.
Where the file's next level is far coarser than the one a tile would read (a big gap between
levels), the coarser one is read and upsampled rather than more than :data:`MAX_READ_PIXELS` of the
finer one. So a request costs at most :data:`MAX_READ_PIXELS` decoded pixels, except the one that
builds an overview (one pass over the coarsest level, memory one band; a lock per file). PNG and
JPEG are one compressed stream: they are decoded whole (within Pillow's decompression-bomb limit),
once for all their tiles (:func:`opened` keeps the last few files open).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from service.dzi.layout import TILE_SIZE, TileBox
from service.errors import UnsupportedMediaTypeError
from service.sniff import sniff_file

__all__ = [
    "MAX_READ_PIXELS",
    "OPEN_PYRAMIDS",
    "OVERVIEW_EDGE",
    "Pyramid",
    "open_pyramid",
    "opened",
    "source_box",
]

#: Most source pixels one tile request decodes (past it, the overview serves).
MAX_READ_PIXELS = 4096 * 4096
#: Longest side of an overview (pixels).
OVERVIEW_EDGE = 1024
#: Open pyramids kept between requests (:func:`opened`).
OPEN_PYRAMIDS = 8
_OVERVIEW_SUFFIX = ".dzi-overview.npy"
_LOCKS_GUARD = threading.Lock()
_LOCKS: dict[str, threading.Lock] = {}


def _overview_lock(path: Path) -> threading.Lock:
    """The lock of one overview file (one build at a time per file, never across files)."""
    with _LOCKS_GUARD:
        if len(_LOCKS) > 256:  # forget the unheld ones (files of expired jobs)
            for key in [k for k, lock in _LOCKS.items() if not lock.locked()]:
                del _LOCKS[key]
        return _LOCKS.setdefault(str(path), threading.Lock())


class Pyramid:
    """One image as levels of decreasing size: ``levels[k] = (width, height)`` (level 0 the full
    image), :meth:`read` a level's box as ``(h, w, C)`` in the file's dtype."""

    levels: list[tuple[int, int]]
    dtype: np.dtype[Any]

    def read(self, level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release the file."""


class _Slide(Pyramid):
    """A TIFF tiffslide opens with axes ``YXS``, ``CYX`` or ``YX`` (SVS, NDPI, OME-TIFF, tiled)."""

    def __init__(self, path: Path) -> None:
        import tiffslide
        import zarr

        self.slide = tiffslide.TiffSlide(str(path))
        axes = self.slide.properties.get("tiffslide.series-axes")
        if axes not in ("YXS", "CYX", "YX"):
            self.slide.close()
            raise ValueError(f"axes {axes}")
        self.levels = [tuple(map(int, d)) for d in self.slide.level_dimensions]  # type: ignore[misc]
        level0 = self.slide.zarr_group["0"]
        assert isinstance(level0, zarr.Array)  # tiffslide's group holds one array per level
        self.dtype = np.dtype(level0.dtype)

    def read(self, level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        ds = self.slide.level_downsamples[level]
        base = []
        for v in (x0, y0):  # the level-0 location that tiffslide maps back to (v, ...): int(b / ds)
            b = math.ceil(v * ds - 1e-6)
            while int(b / ds) < v:
                b += 1
            while b > 0 and int(b / ds) > v:
                b -= 1
            base.append(b)
        out = self.slide.read_region(
            (base[0], base[1]), level, (x1 - x0, y1 - y0), as_array=True, padding=False
        )
        return np.asarray(out)

    def close(self) -> None:
        self.slide.close()


class _TiffLevels(Pyramid):
    """Any other TIFF: the first series' levels through tifffile's zarr store."""

    def __init__(self, path: Path) -> None:
        import tifffile
        import zarr

        self.tif = tifffile.TiffFile(path)
        series = self.tif.series[0]
        self.axes = series.axes
        if "Y" not in self.axes or "X" not in self.axes:
            self.tif.close()
            raise UnsupportedMediaTypeError(f"the TIFF's first series has axes {self.axes}: no 2D image")
        self.arrays = [zarr.open_array(series.aszarr(level=k), mode="r") for k in range(len(series.levels))]
        iy, ix = self.axes.index("Y"), self.axes.index("X")
        self.levels = [(int(a.shape[ix]), int(a.shape[iy])) for a in self.arrays]
        self.dtype = np.dtype(series.dtype)

    def read(self, level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        return _select(self.arrays[level], self.axes, x0, y0, x1, y1)

    def close(self) -> None:
        self.tif.close()


def _select(array: Any, axes: str, x0: int, y0: int, x1: int, y1: int, step: int = 1) -> np.ndarray:
    """``array[...]`` with axes ``axes`` as ``(h, w, C)``: Y and X sliced, S and C kept, any
    other axis at index 0."""
    key: list[Any] = []
    kept = []
    for axis in axes:
        if axis == "Y":
            key.append(slice(y0, y1, step))
        elif axis == "X":
            key.append(slice(x0, x1, step))
        elif axis in "SC":
            key.append(slice(None))
        else:
            key.append(0)
            continue
        kept.append(axis)
    out = np.asarray(array[tuple(key)])
    order = [kept.index("Y"), kept.index("X")] + [i for i, a in enumerate(kept) if a not in "YX"]
    out = out.transpose(order)
    return out.reshape(out.shape[0], out.shape[1], -1)


class _Flat(Pyramid):
    """PNG or JPEG: decoded whole (one compressed stream), one level."""

    def __init__(self, path: Path) -> None:
        from PIL import Image

        with Image.open(path) as image:
            if image.mode == "P":  # a label PNG: the ids, not the colours
                array = np.asarray(image)
            else:
                array = np.asarray(image.convert("RGB") if image.mode in ("CMYK", "YCbCr") else image)
        self.array = array.reshape(array.shape[0], array.shape[1], -1)
        self.levels = [(int(self.array.shape[1]), int(self.array.shape[0]))]
        self.dtype = self.array.dtype

    def read(self, level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:  # noqa: ARG002
        return self.array[y0:y1, x0:x1]


class _WithOverview(Pyramid):
    """``inner``'s levels plus one overview: ``coarsest[::f, ::f]``, kept in ``path`` (.npy)."""

    def __init__(self, inner: Pyramid, path: Path) -> None:
        self.inner = inner
        self.dtype = inner.dtype
        cw, ch = inner.levels[-1]
        f = max(1, -(-max(cw, ch) // OVERVIEW_EDGE))
        if not path.is_file():  # built once; other files' requests never wait for it
            with _overview_lock(path):
                if not path.is_file():
                    bands = []
                    band_rows = f * max(1, (1 << 22) // max(1, cw * f))  # ~4 Mpixel per band read
                    for y in range(0, ch, band_rows):
                        band = inner.read(len(inner.levels) - 1, 0, y, cw, min(ch, y + band_rows))
                        bands.append(band[::f, ::f].copy())  # not a view: the band is let go
                        del band
                    partial = path.with_name(path.name + ".partial.npy")
                    np.save(partial, np.concatenate(bands, axis=0))
                    partial.replace(path)
        self.overview = np.load(path, mmap_mode="r")
        self.levels = [*inner.levels, (int(self.overview.shape[1]), int(self.overview.shape[0]))]

    def read(self, level: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
        if level < len(self.inner.levels):
            return self.inner.read(level, x0, y0, x1, y1)
        return np.asarray(self.overview[y0:y1, x0:x1])

    def close(self) -> None:
        self.inner.close()


def _needs_overview(levels: list[tuple[int, int]], tile_size: int = TILE_SIZE) -> bool:
    """Whether the coarsest level is too fine for the whole image's Deep Zoom level 0 .. 1 tile."""
    cw, ch = levels[-1]
    return cw * ch > MAX_READ_PIXELS and (cw > tile_size or ch > tile_size)


def open_pyramid(path: Path) -> Pyramid:
    """The image at ``path`` (TIFF family, PNG or JPEG, by content) as a :class:`Pyramid`.

    Raises:
        UnsupportedMediaTypeError: not a 2D image of these formats (a NIfTI, a DICOM series).
    """
    kind = sniff_file(path) if path.is_file() else None
    pyramid: Pyramid
    if kind == "tiff":
        try:
            pyramid = _Slide(path)
        except Exception:  # noqa: BLE001 - any layout tiffslide cannot read goes to tifffile
            pyramid = _TiffLevels(path)
    elif kind in ("png", "jpeg"):
        pyramid = _Flat(path)
    else:
        raise UnsupportedMediaTypeError(f"no deep-zoom view of a {kind or 'non-image'} file: 2D images only")
    if _needs_overview(pyramid.levels):
        pyramid = _WithOverview(pyramid, path.with_name(path.name + _OVERVIEW_SUFFIX))
    return pyramid


class _Open:
    """One cached pyramid: its reads are serialized (one file handle); ``closed`` once evicted."""

    def __init__(self, pyramid: Pyramid) -> None:
        self.pyramid, self.lock, self.closed = pyramid, threading.Lock(), False

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                self.pyramid.close()


_OPEN: OrderedDict[tuple[str, int, int], _Open] = OrderedDict()
_OPEN_GUARD = threading.Lock()


@contextmanager
def opened(path: Path) -> Iterator[Pyramid]:
    """:func:`open_pyramid` of ``path`` kept open between requests: the last :data:`OPEN_PYRAMIDS`
    files, keyed by path, mtime and size (a rewritten file is opened anew), so a tile request
    neither re-parses a TIFF nor re-decodes a PNG or JPEG. Reads of one file are serialized while
    the context is held; entries of deleted files are closed on the next call.

    Raises:
        UnsupportedMediaTypeError: as :func:`open_pyramid`.
    """
    while True:
        stat = path.stat() if path.is_file() else None
        key = (str(path), 0 if stat is None else stat.st_mtime_ns, 0 if stat is None else stat.st_size)
        with _OPEN_GUARD:
            entry = _OPEN.get(key)
            if entry is not None:
                _OPEN.move_to_end(key)
            gone = [k for k in _OPEN if k != key and not Path(k[0]).is_file()]
            stale = [_OPEN.pop(k) for k in gone]
        for old in stale:
            old.close()
        if entry is None:
            fresh = _Open(open_pyramid(path))
            with _OPEN_GUARD:
                entry = _OPEN.setdefault(key, fresh)
                evicted = [_OPEN.popitem(last=False)[1] for _ in range(max(0, len(_OPEN) - OPEN_PYRAMIDS))]
            if entry is not fresh:
                fresh.close()
            for old in evicted:
                old.close()
        with entry.lock:
            if not entry.closed:
                yield entry.pyramid
                return
        # evicted between the look-up and the lock: open it again


def source_box(pyramid: Pyramid, box: TileBox) -> tuple[int, int, int, int, int]:
    """``(k, kx0, ky0, kx1, ky1)``: the level ``k`` (largest downsample <= the tile's; the next
    coarser one whose box fits :data:`MAX_READ_PIXELS` when that box is larger) and the box of it
    under ``box``."""
    w0, h0 = pyramid.levels[0]
    d = box.downsample
    k = 0
    for j, (w, h) in enumerate(pyramid.levels):
        if w0 / w <= d + 1e-9 and h0 / h <= d + 1e-9:
            k = j
    gx0, gy0 = box.x0 * d, box.y0 * d
    gx1, gy1 = min(w0, box.x1 * d), min(h0, box.y1 * d)
    while True:
        w, h = pyramid.levels[k]
        sx, sy = w0 / w, h0 / h
        kx0, ky0 = min(w - 1, math.floor(gx0 / sx)), min(h - 1, math.floor(gy0 / sy))
        kx1, ky1 = max(kx0 + 1, min(w, math.ceil(gx1 / sx))), max(ky0 + 1, min(h, math.ceil(gy1 / sy)))
        # a file whose next level is far coarser (a big gap): the coarser one, upsampled, rather
        # than more than MAX_READ_PIXELS of this one
        if (kx1 - kx0) * (ky1 - ky0) <= MAX_READ_PIXELS or k == len(pyramid.levels) - 1:
            return k, kx0, ky0, kx1, ky1
        k += 1

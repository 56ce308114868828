"""A slide read by region at one resolution, with its tissue mask (issue 21 items 1-3).

Shapes: ``(C, H, W)`` channel-first (``C = 3``, RGB), ``H, W`` at the resolution read
(:mod:`service.slides.resolution`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from service.regions import RegionSource, full_slices
from service.slides.readers import SlideInfo, _Slide, open_slide
from service.slides.resolution import Resolution
from service.slides.tissue import TissueMask, thumbnail

__all__ = ["SlideRegions", "open_slide_regions"]

logger = logging.getLogger(__name__)


class SlideRegions(RegionSource):
    """A slide read by region at one :class:`Resolution`: ``(3, H, W)``, uint8 when a level is
    read as it is, float32 when resampled. With a ``mask``, a region wholly outside the tissue is
    ``glass`` (per channel) and is not read.

    Args:
        slide: the open slide (closed by :meth:`close`).
        resolution: the level and resampling.
        mask: the tissue mask (``mask=auto``), or ``None`` (every region is read).
    """

    def __init__(self, slide: _Slide, resolution: Resolution, mask: TissueMask | None = None) -> None:
        self.slide = slide
        self.resolution = resolution
        self.shape = (3, *resolution.shape)
        self.dtype = slide.dtype if resolution.factor == 1.0 else np.dtype(np.float32)
        self.slab_axis = 0
        self.mask = mask
        self.glass: np.ndarray | None = None
        if mask is not None and mask.far is not None:
            fy, fx = mask.far
            H, W = resolution.shape
            cy, cx = int(fy * H), int(fx * W)
            patch = self._read(max(cy - 4, 0), min(cy + 4, H), max(cx - 4, 0), min(cx + 4, W))
            self.glass = np.median(patch.reshape(3, -1), axis=1).astype(self.dtype)
        self.regions_skipped = 0

    def close(self) -> None:
        """Close the slide."""
        self.slide.close()

    def __getitem__(self, key: Any) -> np.ndarray:
        c, ys, xs = full_slices(key, 3)
        H, W = self.resolution.shape
        y0, y1, _ = ys.indices(H)
        x0, x1, _ = xs.indices(W)
        if self.glass is not None and self.mask is not None and self.mask.background(y0, y1, x0, x1):
            self.regions_skipped += 1
            block = np.broadcast_to(self.glass[:, None, None], (3, max(y1 - y0, 0), max(x1 - x0, 0)))
            return np.ascontiguousarray(block[c])
        return np.ascontiguousarray(self._read(y0, y1, x0, x1)[c])

    def _read(self, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        level, f = self.resolution.level, self.resolution.factor
        if y1 <= y0 or x1 <= x0:
            return np.zeros((3, max(y1 - y0, 0), max(x1 - x0, 0)), self.dtype)
        if f == 1.0:
            return np.moveaxis(self.slide.read(level, y0, y1, x0, x1), -1, 0)
        Hs, Ws = self.slide.level_shape(level)
        (iy, jy, wy), (ix, jx, wx) = _taps(y0, y1, f, Hs), _taps(x0, x1, f, Ws)
        r0, r1, c0, c1 = int(iy.min()), int(jy.max()) + 1, int(ix.min()), int(jx.max()) + 1
        block = self.slide.read(level, r0, r1, c0, c1).astype(np.float32)
        rows = block[iy - r0] * (1 - wy)[:, None, None] + block[jy - r0] * wy[:, None, None]
        out = rows[:, ix - c0] * (1 - wx)[None, :, None] + rows[:, jx - c0] * wx[None, :, None]
        return np.moveaxis(out.astype(np.float32), -1, 0)


def _taps(a: int, b: int, f: float, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps of output pixels ``a .. b - 1`` on a source axis of ``n`` pixels:
    ``(lower index, upper index, weight of the upper)``, pixel centres aligned."""
    pos = np.clip((np.arange(a, b, dtype=np.float64) + 0.5) * f - 0.5, 0, n - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    return lo, hi, (pos - lo).astype(np.float32)


def open_slide_regions(path: Path, info: SlideInfo, resolution: Resolution, mask: bool) -> SlideRegions:
    """The slide at ``path`` as a :class:`SlideRegions` at ``resolution``, with a tissue mask made
    from a low level when ``mask`` (skipped with a log line when scikit-image is absent)."""
    slide = open_slide(path, info)
    tissue = None
    if mask:
        try:
            tissue = TissueMask(thumbnail(slide), resolution.shape)
        except ImportError:
            logger.warning("mask=auto needs scikit-image (the `slides` extra): every tile is read")
    return SlideRegions(slide, resolution, tissue)

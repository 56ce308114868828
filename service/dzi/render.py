"""Deep Zoom tiles as pictures: the input as JPEG, the result in the page's colours (issue 21 item 6).

Shapes: a tile is ``(h, w, 3)`` (input) or ``(h, w, 4)`` (result) uint8, resized by Pillow from
the pyramid level's box (:func:`service.dzi.pyramids.source_box`) to the tile's size: BOX for the
input, NEAREST for an overlay, so label ids never mix.

Pictures: the input as JPEG (RGB; grey or non-8-bit data stretched over the coarsest level's
range); the result as RGBA PNG coloured like the page's legend: labels in
:data:`service.codecs.image_encode.LABEL_PALETTE` (label 0 transparent), probabilities of one
channel in the page's ramp (dark red, orange, yellow; below 0.1 of the range transparent).
"""

from __future__ import annotations

import io
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from service.codecs.image_encode import LABEL_PALETTE
from service.dzi.layout import TileBox
from service.dzi.pyramids import Pyramid, open_pyramid, source_box

__all__ = ["RAMP_THRESHOLD", "display_window", "encode_tile", "render_tile"]

#: Probabilities below this share of the range are not drawn (as ``RAMP_THRESHOLD`` in palette.js).
RAMP_THRESHOLD = 0.1


def _ramp() -> np.ndarray:
    """The page's probability ramp (``palette.js`` ``RAMP``): ``(256, 3)`` uint8."""
    stops = [(0.0, (150, 0, 0)), (0.5, (255, 96, 0)), (1.0, (255, 255, 0))]
    out = np.zeros((256, 3), np.uint8)
    for k in range(256):
        t = k / 255
        j = 0
        while j < len(stops) - 2 and t > stops[j + 1][0]:
            j += 1
        (t0, c0), (t1, c1) = stops[j], stops[j + 1]
        u = (t - t0) / (t1 - t0)
        out[k] = [math.floor(c + (d - c) * u + 0.5) for c, d in zip(c0, c1, strict=True)]
    return out


_RAMP = _ramp()
_PALETTE = np.array(LABEL_PALETTE, np.uint8)


@lru_cache(maxsize=32)
def _window(path: str, mtime_ns: int) -> tuple[float, float]:  # noqa: ARG001 - the cache key
    """The coarsest level's value range of a non-8-bit input (its display window)."""
    pyramid = open_pyramid(Path(path))
    try:
        w, h = pyramid.levels[-1]
        step = max(1, -(-max(w, h) // 2048))
        data = pyramid.read(len(pyramid.levels) - 1, 0, 0, w, h)[::step, ::step].astype(np.float64)
        finite = data[np.isfinite(data)]
        return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    finally:
        pyramid.close()


def _picture(data: np.ndarray, window: tuple[float, float] | None) -> np.ndarray:
    """``(h, w, C)`` input data as ``(h, w, 3)`` uint8 RGB."""
    rgb = data[..., :3] if data.shape[2] >= 3 else np.repeat(data[..., :1], 3, axis=2)
    if rgb.dtype == np.uint8:
        return np.ascontiguousarray(rgb)
    lo, hi = window or (0.0, 1.0)
    scaled = (rgb.astype(np.float64) - lo) * (255.0 / (hi - lo) if hi > lo else 0.0)
    return np.clip(np.nan_to_num(scaled), 0, 255).astype(np.uint8)


def _overlay(data: np.ndarray, kind: str, channel: int, window: tuple[float, float] | None) -> np.ndarray:
    """``(h, w, C)`` output data as ``(h, w, 4)`` uint8 RGBA in the legend's colours
    (probabilities: ``t = (v - lo) / (hi - lo)`` over ``window``, default ``[0, 1]``)."""
    h, w = data.shape[:2]
    out = np.zeros((h, w, 4), np.uint8)
    if kind == "labels":
        ids = data[..., 0].astype(np.int64)
        out[..., :3] = _PALETTE[ids % 256]
        out[..., 3] = np.where(ids != 0, 255, 0)
        return out
    if channel >= data.shape[2]:
        raise LookupError(f"channel {channel} is past the output's {data.shape[2]} channels")
    lo, hi = window or (0.0, 1.0)
    values = data[..., channel].astype(np.float64)
    t = np.clip(np.nan_to_num((values - lo) / (hi - lo if hi > lo else 1.0)), 0.0, 1.0)
    out[..., :3] = _RAMP[np.round(t * 255).astype(np.int64)]
    out[..., 3] = np.where(t >= RAMP_THRESHOLD, 255, 0)
    return out


def render_tile(
    pyramid: Pyramid,
    box: TileBox,
    *,
    role: str,
    kind: str = "labels",
    channel: int = 0,
    window: tuple[float, float] | None = None,
) -> np.ndarray:
    """Tile ``box`` of ``pyramid`` as an RGB (``role="input"``) or RGBA (``role="result"``,
    ``kind`` ``labels`` or ``probabilities``) uint8 array ``(y1 - y0, x1 - x0, 3 | 4)``;
    ``window`` as :func:`display_window` gives it.

    Raises:
        LookupError: ``channel`` past the output's channels.
    """
    from PIL import Image

    k, kx0, ky0, kx1, ky1 = source_box(pyramid, box)
    data = pyramid.read(k, kx0, ky0, kx1, ky1)
    size = (box.x1 - box.x0, box.y1 - box.y0)
    if role == "input":
        image = Image.fromarray(_picture(data, window), "RGB")
        resample = Image.Resampling.BOX
    else:
        image = Image.fromarray(_overlay(data, kind, channel, window), "RGBA")
        resample = Image.Resampling.NEAREST
    if image.size != size:
        image = image.resize(size, resample)
    return np.asarray(image)


def encode_tile(tile: np.ndarray, fmt: str) -> bytes:
    """``tile`` as JPEG (quality 90) or PNG bytes."""
    from PIL import Image

    sink = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(tile).save(sink, "JPEG", quality=90)
    else:
        Image.fromarray(tile).save(sink, "PNG", compress_level=3)
    return sink.getvalue()


def display_window(path: Path, pyramid: Pyramid, role: str, kind: str) -> tuple[float, float] | None:
    """The value range drawn (cached per file): ``None`` for an 8-bit input or labels; for other
    inputs the coarsest level's range; for probabilities ``[min(0, lo), hi]`` of it, as the
    page's legend shows them."""
    if (role == "input" and pyramid.dtype == np.uint8) or (role == "result" and kind == "labels"):
        return None
    lo, hi = _window(str(path), path.stat().st_mtime_ns)
    return (min(lo, 0.0), hi) if role == "result" else (lo, hi)

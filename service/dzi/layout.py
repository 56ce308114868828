"""The Deep Zoom layout: levels, tile boxes and the ``.dzi`` descriptor (issue 21 item 6).

OpenSeadragon reads a Deep Zoom image as an XML descriptor (``.dzi``: ``TileSize``, ``Overlap``,
``Format``, ``Size``) and a folder of tiles ``{level}_files/{level}/{col}_{row}.{format}``. Level
``L`` of ``0 .. max_level`` (``max_level = ceil(log2(max(W, H)))``) is the image downsampled by
``d = 2 ** (max_level - L)``: ``ceil(W / d) x ceil(H / d)`` pixels; tile ``(col, row)`` covers
``[col*T - O, (col+1)*T + O)`` of it (``T`` tile size, ``O`` overlap), clipped to the level, so
the last column and row are narrower and the image border carries no overlap::

    W = 600, T = 256, O = 1, level max_level (d = 1):
    col 0: x [0, 257)   col 1: x [255, 513)   col 2: x [511, 600)   (89 px: an edge tile)

Integers only: no pixel is read here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.errors import BadParameterError

__all__ = ["OVERLAP", "TILE_SIZE", "DeepZoom", "TileBox", "dzi_xml"]

#: Deep Zoom tile edge (pixels) and overlap (pixels on each inner side).
TILE_SIZE = 256
OVERLAP = 1


@dataclass(frozen=True, slots=True)
class TileBox:
    """Where one Deep Zoom tile lies: its box ``[x0, x1) x [y0, y1)`` in level pixels and the
    level's downsample ``d`` from level 0."""

    x0: int
    y0: int
    x1: int
    y1: int
    downsample: int


class DeepZoom:
    """The Deep Zoom layout of a ``width x height`` image (pixels of level 0).

    Raises:
        BadParameterError: a level, column or row that is not a non-negative integer (400).
        LookupError: a level, column or row past the image (404).
    """

    def __init__(self, width: int, height: int, tile_size: int = TILE_SIZE, overlap: int = OVERLAP) -> None:
        self.width, self.height, self.tile_size, self.overlap = width, height, tile_size, overlap
        self.max_level = max(0, math.ceil(math.log2(max(width, height, 1))))

    def level_size(self, level: int) -> tuple[int, int]:
        """``(width, height)`` of Deep Zoom level ``level``."""
        d = 2 ** (self.max_level - level)
        return -(-self.width // d), -(-self.height // d)

    def box(self, level: Any, col: Any, row: Any) -> TileBox:
        """The box of tile ``(col, row)`` of ``level`` (strings from a URL accepted)."""
        values = []
        for name, value in (("level", level), ("col", col), ("row", row)):
            text = str(value)
            if not text.isascii() or not text.isdigit() or len(text) > 9:
                raise BadParameterError(f"{name} must be a non-negative integer, got {text[:20]!r}")
            values.append(int(text))
        lv, c, r = values
        if lv > self.max_level:
            raise LookupError(f"level {lv} is past the last level {self.max_level}")
        w, h = self.level_size(lv)
        t, o = self.tile_size, self.overlap
        if c * t >= w or r * t >= h:
            cols, rows = -(-w // t), -(-h // t)
            raise LookupError(f"tile {c}_{r} is outside level {lv} ({cols} columns x {rows} rows)")
        x0, y0 = max(0, c * t - o), max(0, r * t - o)
        x1, y1 = min(w, (c + 1) * t + o), min(h, (r + 1) * t + o)
        return TileBox(x0, y0, x1, y1, 2 ** (self.max_level - lv))


def dzi_xml(width: int, height: int, fmt: str, tile_size: int = TILE_SIZE, overlap: int = OVERLAP) -> str:
    """The ``.dzi`` descriptor (Deep Zoom schema 2008) of a ``width x height`` image."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<Image xmlns="http://schemas.microsoft.com/deepzoom/2008" '
        f'TileSize="{tile_size}" Overlap="{overlap}" Format="{fmt}">'
        f'<Size Width="{width}" Height="{height}"/></Image>\n'
    )

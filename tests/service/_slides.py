"""Synthetic whole-slide images written with tifffile from scikit-image's real microscopy image.

``skimage.data.immunohistochemistry()`` (512 x 512 RGB, IHC-stained human colon) is tiled out
(mirrored, so there are no seams) over a tissue area, with flat glass around it; levels are 2x box
means of the one below. Two layouts:

- SVS (Aperio): ``Aperio Image Library`` description with ``MPP``, tiled JPEG pages, level 0 first,
  a stripped thumbnail second, the lower levels after it;
- OME-TIFF with SubIFDs (the pyramid levels under level 0), PhysicalSizeX in um.

Pixels come from :func:`content`, a function of position, so a 50,000 x 50,000 slide is written tile
by tile without existing in memory, and an oracle can read any window of any level.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

GLASS = (238, 236, 242)


def _ihc() -> np.ndarray:
    from skimage import data

    img = data.immunohistochemistry()
    # mirror once per axis: a 1024-periodic tiling with no seam
    top = np.concatenate([img, img[:, ::-1]], axis=1)
    return np.concatenate([top, top[::-1]], axis=0)


_IHC: np.ndarray | None = None


def content(
    y0: int, y1: int, x0: int, x1: int, shape: tuple[int, int], tissue: tuple[float, ...]
) -> np.ndarray:
    """Level-0 pixels ``[y0, y1) x [x0, x1)`` ``(h, w, 3)`` uint8 of a slide of ``shape`` ``(H, W)``
    whose tissue is the box ``tissue = (top, left, bottom, right)`` (fractions of the slide)."""
    global _IHC
    if _IHC is None:
        _IHC = _ihc()
    H, W = shape
    out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
    out[...] = GLASS
    ty0, tx0, ty1, tx1 = int(tissue[0] * H), int(tissue[1] * W), int(tissue[2] * H), int(tissue[3] * W)
    a0, a1, b0, b1 = max(y0, ty0), min(y1, ty1), max(x0, tx0), min(x1, tx1)
    if a1 > a0 and b1 > b0:
        rows = np.arange(a0, a1) % _IHC.shape[0]
        cols = np.arange(b0, b1) % _IHC.shape[1]
        out[a0 - y0 : a1 - y0, b0 - x0 : b1 - x0] = _IHC[rows][:, cols]
    return out


def level_content(level: int, y0: int, y1: int, x0: int, x1: int, shape, tissue) -> np.ndarray:
    """Pixels of ``level`` (each level the 2x box mean of the one below, rounded) in its own coordinates."""
    if level == 0:
        return content(y0, y1, x0, x1, shape, tissue)
    H, W = shape
    f = 1 << level
    if (y1 * f <= int(tissue[0] * H) or y0 * f >= int(tissue[2] * H) or x1 * f <= int(tissue[1] * W)
            or x0 * f >= int(tissue[3] * W)):  # fmt: skip
        out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)  # all glass: its box mean is the glass
        out[...] = GLASS
        return out
    below = level_content(level - 1, 2 * y0, 2 * y1, 2 * x0, 2 * x1, shape, tissue).astype(np.float32)
    h, w = below.shape[0] // 2, below.shape[1] // 2
    return np.round(below[: 2 * h, : 2 * w].reshape(h, 2, w, 2, 3).mean(axis=(1, 3))).astype(np.uint8)


def _tiles(level: int, lshape: tuple[int, int], tile: int, shape, tissue):
    H, W = lshape
    for y in range(0, H, tile):
        for x in range(0, W, tile):
            block = np.empty((tile, tile, 3), np.uint8)
            block[...] = GLASS
            got = level_content(level, y, min(y + tile, H), x, min(x + tile, W), shape, tissue)
            block[: got.shape[0], : got.shape[1]] = got
            yield block


def _encoded(tiles, compression: str):
    """``tiles`` as compressed bytes (tifffile writes an iterator of bytes as they are), each
    distinct tile compressed once: a slide's glass tiles are one tile (blake2b of the pixels)."""
    import hashlib

    import imagecodecs

    encode = {"zstd": imagecodecs.zstd_encode, "zlib": imagecodecs.zlib_encode}[compression]
    done: dict[bytes, bytes] = {}
    for block in tiles:
        key = hashlib.blake2b(block.tobytes(), digest_size=16).digest()
        data = done.get(key)
        if data is None:
            data = encode(block)
            if len(done) < 64:
                done[key] = data
        yield data


def _level_tiles(level, lshape, tile, shape, tissue, compression):
    """The tiles of one level: arrays for JPEG (tifffile encodes them), compressed bytes else."""
    tiles = _tiles(level, lshape, tile, shape, tissue)
    return tiles if compression == "jpeg" else _encoded(tiles, compression)


def _thumbnail(shapes, shape, tissue, side: int = 1024) -> np.ndarray:
    """The lowest level, built tile by tile, then every ``k``-th pixel so that it is at most ``side``."""
    k = len(shapes) - 1
    h, w = shapes[k]
    low = np.empty((h, w, 3), np.uint8)
    for y in range(0, h, 1024):
        for x in range(0, w, 1024):
            low[y : y + 1024, x : x + 1024] = level_content(
                k, y, min(y + 1024, h), x, min(x + 1024, w), shape, tissue
            )
    step = max(1, -(-max(h, w) // side))
    return np.ascontiguousarray(low[::step, ::step])


def level_shapes(shape: tuple[int, int], n_levels: int) -> list[tuple[int, int]]:
    """``(H, W)`` per level (each half the one below, rounded down)."""
    return [(shape[0] >> k, shape[1] >> k) for k in range(n_levels)]


def write_svs(path: Path, shape=(3000, 4000), n_levels=3, mpp=0.25, tissue=(0.3, 0.25, 0.7, 0.75), tile=256,
              compression="jpeg") -> Path:  # fmt: skip
    """An Aperio SVS-layout slide (see the module docstring)."""
    import tifffile

    H, W = shape
    desc = (
        f"Aperio Image Library v12.0.15 \r\n{W}x{H} [0,0 {W}x{H}] ({tile}x{tile}) JPEG/RGB Q=90"
        f"|AppMag = 40|MPP = {mpp}|Filename = synthetic"
    )
    shapes = level_shapes(shape, n_levels)
    kw = {"photometric": "rgb", "compression": compression, "tile": (tile, tile), "dtype": np.uint8,
          "metadata": None}  # fmt: skip
    with tifffile.TiffWriter(path, bigtiff=H * W * 3 > 2**31) as tif:
        tif.write(
            _level_tiles(0, shapes[0], tile, shape, tissue, compression),
            shape=(H, W, 3),
            description=desc,
            **kw,
        )
        thumb = _thumbnail(shapes, shape, tissue)
        tif.write(
            thumb,
            photometric="rgb",
            metadata=None,
            description=f"Aperio Image Library v12.0.15 \r\n{W}x{H} -> thumb",
        )
        for level in range(1, n_levels):
            h, w = shapes[level]
            tif.write(_level_tiles(level, (h, w), tile, shape, tissue, compression), shape=(h, w, 3),
                      description=f"Aperio Image Library v12.0.15 \r\n{W}x{H} -> {w}x{h}", **kw)  # fmt: skip
    return path


def write_ome(path: Path, shape=(3000, 4000), n_levels=3, mpp=0.25, tissue=(0.3, 0.25, 0.7, 0.75), tile=256,
              compression="zlib") -> Path:  # fmt: skip
    """An OME-TIFF slide with its levels in SubIFDs (see the module docstring)."""
    import tifffile

    H, W = shape
    shapes = level_shapes(shape, n_levels)
    kw = {"photometric": "rgb", "compression": compression, "tile": (tile, tile), "dtype": np.uint8}
    meta = {"axes": "YXS", "PhysicalSizeX": mpp, "PhysicalSizeY": mpp, "PhysicalSizeXUnit": "µm",
            "PhysicalSizeYUnit": "µm"}  # fmt: skip
    with tifffile.TiffWriter(path, bigtiff=H * W * 3 > 2**31, ome=True) as tif:
        res = {"resolution": (1e4 / mpp, 1e4 / mpp), "resolutionunit": "CENTIMETER"}
        level0 = _level_tiles(0, shapes[0], tile, shape, tissue, compression)
        tif.write(level0, shape=(H, W, 3), subifds=n_levels - 1, metadata=meta, **res, **kw)
        for level in range(1, n_levels):
            h, w = shapes[level]
            tif.write(
                _level_tiles(level, (h, w), tile, shape, tissue, compression),
                shape=(h, w, 3),
                subfiletype=1,
                **kw,
            )
    return path


def tissue_fraction(tissue) -> float:
    """The tissue box's share of the slide."""
    return (tissue[2] - tissue[0]) * (tissue[3] - tissue[1])


def n_tiles(shape, tile) -> int:
    """Tiles of ``tile`` pixels covering ``shape``."""
    return math.prod(math.ceil(s / tile) for s in shape)

"""Decoded stored tiles of an open slide, kept while neighbouring regions need them.

A slide level is stored as tiles (SVS: JPEG, 240 or 256 pixels a side) and read through its zarr
array, whose chunks are those tiles: reading a region decodes every tile it touches, and neither
tifffile's zarr store nor zarr keeps a decoded tile. The engine's regions (a tile of the network
plus its halo) are not aligned to the stored tiles, so a stored tile under the corner of four
regions was decoded four times.

:func:`read_tiles` reads a region as the stored tiles it touches, each looked up in a
:class:`TileCache` first; the tiles a read misses are read from the array in one call per row of
consecutive missing tiles (each decoded once) and kept. The engine reads its regions in raster
order: the cache drops first the rows of tiles above the region read (done with) and the tiles of
other levels, then the least recently used. Each stored tile is then decoded once per pass when
the rows of tiles a row of regions spans fit in the bound (``rows x level width x tile height x
3`` bytes: 3 rows of a 20,000 pixel wide level of 256-pixel tiles are 44 MiB, within
:data:`TILE_CACHE_BYTES`); on a wider level the tiles the regions to the right share are still
kept (a few columns), and the tiles of the rows two rows of regions share are decoded twice.

Reads the cache cannot serve well go to the array directly: a region whose stored tiles are more
than half the cache (a thumbnail's strips, a short region across a wide level), or stored tiles
larger than a quarter of it (a level stored as one strip).

Memory: at most ``max_bytes`` of tiles beside the region read, plus, during a read, the tiles of
that region.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = ["TILE_CACHE_BYTES", "TileCache", "read_tiles"]

#: The default bound of one open slide's cache of decoded tiles (bytes).
TILE_CACHE_BYTES = 64 << 20


class TileCache:
    """Decoded tiles bounded in bytes, least recently used first out, but for the tiles its
    caller says it is done with, which go first; safe to share between threads.

    Args:
        max_bytes: the bound on the bytes of the tiles held (a tile larger than it is not kept).

    Attributes:
        hits: look-ups answered from the cache.
        misses: look-ups not answered (tiles then read and, usually, kept).
    """

    def __init__(self, max_bytes: int = TILE_CACHE_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.hits = 0
        self.misses = 0
        self._tiles: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the tiles held (at most ``max_bytes``)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._tiles)

    def get(self, key: Hashable) -> np.ndarray | None:
        """The tile kept under ``key`` (made the most recently used), else ``None``."""
        with self._lock:
            tile = self._tiles.get(key)
            if tile is None:
                self.misses += 1
                return None
            self._tiles.move_to_end(key)
            self.hits += 1
            return tile

    def put(self, key: Hashable, tile: np.ndarray, done: Callable[[Hashable], bool] | None = None) -> None:
        """Keep ``tile`` (read-only from then on) under ``key``, then drop tiles beyond
        ``max_bytes``: first those ``done(key)`` is true of, then the least recently used.
        A tile larger than ``max_bytes`` is not kept.

        Notes:
            Each dropped tile scans the tiles held for a done one, oldest first: a few hundred
            look-ups at most (a 64 MiB bound holds 341 RGB tiles of 256 x 256).
        """
        size = int(tile.nbytes)
        if size > self.max_bytes:
            return
        tile.flags.writeable = False
        with self._lock:
            old = self._tiles.pop(key, None)
            if old is not None:
                self._nbytes -= int(old.nbytes)
            self._tiles[key] = tile
            self._nbytes += size
            while self._nbytes > self.max_bytes:
                first = next((k for k in self._tiles if done(k)), None) if done is not None else None
                dropped = self._tiles.pop(first) if first is not None else self._tiles.popitem(last=False)[1]
                self._nbytes -= int(dropped.nbytes)

    def clear(self) -> None:
        """Drop every tile."""
        with self._lock:
            self._tiles.clear()
            self._nbytes = 0


def read_tiles(
    array: Any, y0: int, y1: int, x0: int, x1: int, cache: TileCache, key: Hashable = 0
) -> np.ndarray:
    """``array[y0:y1, x0:x1]`` read as the stored tiles it touches, through ``cache``.

    Args:
        array: a zarr array ``(H, W[, S])`` whose ``chunks`` are the stored tiles (``(th, tw[, S])``).
        y0, y1, x0, x1: the region, within ``0 <= y0 <= y1 <= H``, ``0 <= x0 <= x1 <= W``.
        cache: where the decoded tiles are kept.
        key: what tells this array's tiles from others' in ``cache`` (a level's number).

    Returns:
        ``(y1 - y0, x1 - x0[, S])`` of the array's dtype, a new array.
    """
    H, W = (int(n) for n in array.shape[:2])
    th, tw = (int(n) for n in array.chunks[:2])
    tail = tuple(int(n) for n in array.shape[2:])
    itemsize = np.dtype(array.dtype).itemsize * int(np.prod(tail, dtype=np.int64))
    region = (y1 - y0) * (x1 - x0) * itemsize
    tile_bytes = th * tw * itemsize
    inside = 0 <= y0 < y1 <= H and 0 <= x0 < x1 <= W
    if not inside:
        return np.asarray(array[y0:y1, x0:x1])
    # the stored tiles the region touches, read whole and kept: a short, wide region touches
    # far more than its own bytes (a 60-row strip of a 40,960-wide level: 7 MiB, its tiles 60 MiB)
    touched = (-(-y1 // th) - y0 // th) * (-(-x1 // tw) - x0 // tw) * tile_bytes
    if max(region, touched) > cache.max_bytes // 2 or tile_bytes > cache.max_bytes // 4:
        return np.asarray(array[y0:y1, x0:x1])
    out = np.empty((y1 - y0, x1 - x0, *tail), np.dtype(array.dtype))
    cols = range(x0 // tw, -(-x1 // tw))
    top = y0 // th

    def done(k: Any) -> bool:  # in raster order: another level's tiles, and rows above this read
        return bool(k[0] != key or k[1] < top)

    for ty in range(y0 // th, -(-y1 // th)):
        tiles: dict[int, np.ndarray | None] = {tx: cache.get((key, ty, tx)) for tx in cols}
        missing = [tx for tx in cols if tiles[tx] is None]
        for a, b in _runs(missing):  # consecutive missing tiles: one read, each tile decoded once
            block = np.asarray(array[ty * th : min((ty + 1) * th, H), a * tw : min((b + 1) * tw, W)])
            for tx in range(a, b + 1):
                stored = np.ascontiguousarray(block[:, (tx - a) * tw : (tx - a + 1) * tw])
                cache.put((key, ty, tx), stored, done)
                tiles[tx] = stored
        ra, rb = max(y0, ty * th), min(y1, (ty + 1) * th)
        for tx in cols:
            ca, cb = max(x0, tx * tw), min(x1, (tx + 1) * tw)
            tile = tiles[tx]
            assert tile is not None
            part = tile[ra - ty * th : rb - ty * th, ca - tx * tw : cb - tx * tw]
            out[ra - y0 : rb - y0, ca - x0 : cb - x0] = part
    return out


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` of the runs of consecutive integers in sorted ``values``."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs

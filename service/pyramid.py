"""Pyramidal OME-TIFF outputs (``format=ome.tiff``), written tile by tile (issue 21 item 4).

``C`` channels, ``H x W`` pixels, level ``k`` of ``ceil(H / 2**k) x ceil(W / 2**k)`` pixels. Levels
are added until the largest side fits one tile (:data:`PYRAMID_TILE`), so a 40,000-pixel side gives 9
levels. Level ``k``'s pixel ``(i, j)`` summarizes the level-0 block ``[i * 2**k, (i + 1) * 2**k) x
[j * 2**k, (j + 1) * 2**k)`` (cut at the image border):

- labels: the mode of the block (the most frequent label; a tie goes to the smallest label);
- values (probabilities): the mean of the block, rounded to the nearest integer for uint8.

One pass over level 0: while level 0 is written, band by band of finished rows (``B`` rows, a
multiple of both the tile and the coarsest block), each band is reduced, block by block of ``B x
2048`` pixels, into every coarser level at once (per-class counts and sums are additive, so level
``k`` comes from level ``k - 1``'s partial counts, exactly). The coarser levels go to temporaries on
disk (:class:`~service.paged.PagedMemmap`, a third of level 0's bytes in all) and are written after
level 0, as SubIFDs of each level-0 page. Memory: one block's counts (for labels one class at a
time: a ``B x 2048`` mask and each level's best count and label, whatever the number of classes;
``B x 2048`` float64 per channel for values), whatever the image size.

The file: tiled (256 x 256), zlib-compressed, BigTIFF when over 4 GB, axes ``YX`` (labels, one
channel) or ``CYX`` (one page per channel); OME-XML with ``PhysicalSizeX/Y`` in µm (the input's
mpp) and the provenance as ``Description`` and a ``MapAnnotation`` (namespace ``tilewise``), and the
TIFF resolution tags of every level in pixels per centimetre (what tiffslide and OpenSlide read).
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.paged import open_paged

__all__ = ["PYRAMID_TILE", "PyramidLevels", "mpp_from_info", "output_mpp", "pyramid_shapes", "write_ome_tiff"]

logger = logging.getLogger(__name__)

#: Tile edge of an OME-TIFF output (pixels), and the largest side of its coarsest level.
PYRAMID_TILE = 256
_BLOCK_COLUMNS = 2048
_BIGTIFF_BYTES = 2**32 - 2**25


def pyramid_shapes(height: int, width: int, tile: int = PYRAMID_TILE) -> list[tuple[int, int]]:
    """``(height, width)`` of every level: level 0, then halved (rounded up) until both fit ``tile``.

    >>> pyramid_shapes(1000, 700)
    [(1000, 700), (500, 350), (250, 175)]
    """
    shapes = [(int(height), int(width))]
    k = 1
    while max(shapes[-1]) > tile:
        shapes.append((-(-height // 2**k), -(-width // 2**k)))
        k += 1
    return shapes


def mpp_from_info(info: dict[str, Any]) -> tuple[float, float] | None:
    """Microns per pixel ``(y, x)`` of an input from its metadata: ``mpp`` (a number or ``(y, x)``),
    else ``dpi`` (Pillow's ``(x, y)`` dots per inch); ``None`` when neither is there or plausible."""
    mpp = info.get("mpp")
    if mpp is not None:
        values = [mpp, mpp] if isinstance(mpp, (int, float, np.number)) else list(mpp)
        pair = tuple(float(v) for v in values)[-2:]
        if all(math.isfinite(v) and v > 0 for v in pair):
            return (pair[0], pair[1])
    dpi = info.get("dpi")
    if dpi is not None and len(dpi) >= 2 and all(float(v) > 0 for v in dpi[:2]):
        return (25400.0 / float(dpi[1]), 25400.0 / float(dpi[0]))
    return None


def output_mpp(
    info: dict[str, Any], in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> tuple[float, float] | None:
    """Microns per pixel ``(y, x)`` of an output of ``out_shape`` made from an input of ``in_shape``
    (a model's ``scale`` changes the pixel size), or ``None`` when the input says none."""
    mpp = mpp_from_info(info)
    if mpp is None or len(in_shape) < 2 or len(out_shape) < 2:
        return mpp
    return (
        mpp[0] * int(in_shape[-2]) / int(out_shape[-2]),
        mpp[1] * int(in_shape[-1]) / int(out_shape[-1]),
    )


def _block_sum(values: np.ndarray) -> np.ndarray:
    """Sums over 2 x 2 blocks of the last two axes (the last block of an odd axis is 1 wide)."""
    *lead, rows, cols = values.shape
    if rows % 2 or cols % 2:  # pad with zeros to even sides: a ragged block sums what it holds
        padded = np.zeros((*lead, rows + rows % 2, cols + cols % 2), values.dtype)
        padded[..., :rows, :cols] = values
        values = padded
    rows = values[..., 0::2, :] + values[..., 1::2, :]  # strided adds: faster than a reshaped sum
    summed: np.ndarray = rows[..., 0::2] + rows[..., 1::2]
    return summed


class PyramidLevels:
    """Levels 1.. of ``level0`` ``(C, H, W)`` on disk (temporaries in ``workdir``), filled band by
    band (:meth:`add_band`) from level 0 (see the module docstring).

    Attributes:
        arrays: level ``k`` at ``arrays[k - 1]``, ``(C, *shapes[k])``.
        factor: the coarsest block's side in level-0 pixels; bands start at its multiples.
    """

    def __init__(
        self, level0: np.ndarray, shapes: list[tuple[int, int]], labels: bool, workdir: Path
    ) -> None:
        self.level0 = level0
        self.labels = labels
        self.channels = int(level0.shape[0])
        self.dtype = level0.dtype
        self.arrays = [
            open_paged(workdir / f"level-{k}.raw", level0.dtype, (self.channels, *shape), mode="w+")
            for k, shape in enumerate(shapes[1:], start=1)
        ]
        self.factor = 2 ** len(self.arrays)  # the coarsest block's side (level 0 pixels)

    def add_band(self, r0: int, r1: int) -> None:
        """Reduce level 0's rows ``[r0, r1)`` (``r0`` a multiple of :attr:`factor`) into every level."""
        width = int(self.level0.shape[-1])
        step = max(_BLOCK_COLUMNS // self.factor, 1) * self.factor
        for c0 in range(0, width, step):
            c1 = min(c0 + step, width)
            block = np.asarray(self.level0[:, r0:r1, c0:c1])
            if self.labels:
                self._mode(block[0], r0, c0)
            else:
                for c in range(self.channels):
                    self._mean(block[c], c, r0, c0)
        for array in self.arrays:  # their pages go back to the page cache: RSS stays one band
            array.drop()

    def _mode(self, block: np.ndarray, r0: int, c0: int) -> None:
        small = block.dtype.kind == "u" and block.dtype.itemsize <= 2  # counting beats sorting
        classes = (
            np.flatnonzero(np.bincount(block.ravel())).astype(block.dtype) if small else np.unique(block)
        )
        # one class at a time, keeping each level's best count and label so far: memory is the
        # block's mask and the levels' best arrays, whatever the number of classes
        best: list[tuple[np.ndarray, np.ndarray]] = []
        for n, value in enumerate(classes):
            counts = _block_sum((block == value).view(np.uint8)).astype(np.int32)  # level 1: <= 4
            for k in range(len(self.arrays)):
                if k:
                    counts = _block_sum(counts)
                if n == 0:
                    best.append((counts, np.full(counts.shape, value, block.dtype)))
                    continue
                # strictly more only: the smallest label keeps a tie (classes are sorted)
                top, label = best[k]
                more = counts > top
                np.copyto(top, counts, where=more)
                label[more] = value
        for k, (array, (_, mode)) in enumerate(zip(self.arrays, best, strict=True), start=1):
            f = 2**k
            array[0, r0 // f : r0 // f + mode.shape[0], c0 // f : c0 // f + mode.shape[1]] = mode

    def _mean(self, block: np.ndarray, channel: int, r0: int, c0: int) -> None:
        sums = block.astype(np.float64)
        rows, cols = np.ones(block.shape[0]), np.ones(block.shape[1])  # pixels per block, per axis
        for k, array in enumerate(self.arrays, start=1):
            sums = _block_sum(sums)
            rows = np.add.reduceat(rows, np.arange(0, rows.size, 2))
            cols = np.add.reduceat(cols, np.arange(0, cols.size, 2))
            mean = sums / np.outer(rows, cols)
            if self.dtype.kind in "ui":
                mean = np.rint(mean)
            f = 2**k
            array[channel, r0 // f : r0 // f + mean.shape[0], c0 // f : c0 // f + mean.shape[1]] = (
                mean.astype(self.dtype)
            )


def _tiles(array: np.ndarray, tile: int, on_band: Any = None, band: int = 0) -> Iterator[np.ndarray]:
    """``array`` ``(C, H, W)`` as ``tile x tile`` blocks, page by page, row by row (zero-padded at
    the border); ``on_band(r0, r1)`` is called before the first page's rows ``[r0, r1)`` (``band``
    rows at a time) are read."""
    channels, height, width = (int(n) for n in array.shape)
    for c in range(channels):
        for y in range(0, height, tile):
            if on_band is not None and c == 0 and y % band == 0:
                on_band(y, min(y + band, height))
            for x in range(0, width, tile):
                block = np.asarray(array[c, y : y + tile, x : x + tile])
                if block.shape != (tile, tile):
                    block = np.pad(block, ((0, tile - block.shape[0]), (0, tile - block.shape[1])))
                yield block
            drop = getattr(array, "drop", None)  # a PagedMemmap: hand its read pages back
            if callable(drop):
                drop()


def _ome_metadata(
    axes: str, mpp: tuple[float, float] | None, provenance: Any, channels: int, labels: bool
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"axes": axes}
    if mpp is not None:
        metadata.update(
            PhysicalSizeY=mpp[0], PhysicalSizeYUnit="µm", PhysicalSizeX=mpp[1], PhysicalSizeXUnit="µm"
        )
    if channels > 1:
        metadata["Channel"] = {"Name": [f"channel {c}" for c in range(channels)]}
    elif labels:
        metadata["Channel"] = {"Name": ["labels"]}
    if provenance is not None:
        metadata["Name"] = f"tilewise {provenance.model} {provenance.output}"
        metadata["Description"] = provenance.json()
        metadata["MapAnnotation"] = {
            "Namespace": "tilewise",
            **{k: str(v) for k, v in provenance.as_dict().items()},
        }
    return metadata


def write_ome_tiff(
    array: np.ndarray,
    path: str | Path,
    *,
    labels: bool,
    mpp: tuple[float, float] | None = None,
    provenance: Any = None,
    workdir: str | Path | None = None,
) -> list[tuple[int, int]]:
    """Write ``array`` as a tiled, compressed, pyramidal OME-TIFF (see the module docstring).

    Args:
        array: ``(H, W)`` labels (any unsigned integer dtype) or ``(C, H, W)`` values (float32,
            float16, or uint8 probabilities scaled to 0-255); a numpy array or a memmap, read tile
            by tile.
        path: the output file.
        labels: reduce by mode (labels) or by mean (values).
        mpp: microns per pixel ``(y, x)`` of level 0, or ``None`` (not recorded).
        provenance: a :class:`service.provenance.Provenance` or ``None``.
        workdir: folder of the coarser levels' temporaries (default: beside ``path``).

    Returns:
        The ``(height, width)`` of every level written.

    Notes:
        Disk: the coarser levels' temporaries, at most a third of level 0's bytes. Memory: see the
        module docstring (tens of MiB at most, whatever ``H x W``).
    """
    import tifffile

    path = Path(path)
    planes = array[None] if array.ndim == 2 else array
    channels, height, width = (int(n) for n in planes.shape)
    shapes = pyramid_shapes(height, width)
    tile = PYRAMID_TILE
    axes = "YX" if channels == 1 else "CYX"
    nbytes = int(planes.dtype.itemsize) * channels * height * width
    bigtiff = nbytes * 4 // 3 >= _BIGTIFF_BYTES
    common: dict[str, Any] = {
        "tile": (tile, tile),
        "compression": "zlib",
        "photometric": "minisblack",
        "dtype": planes.dtype,
    }
    if mpp is not None:  # else no resolution at all (tifffile's default 1 pixel per unit "none")
        common["resolutionunit"] = "CENTIMETER"

    def resolution(k: int) -> tuple[float, float] | None:
        if mpp is None:
            return None
        return (1e4 / (mpp[1] * 2**k), 1e4 / (mpp[0] * 2**k))  # pixels per cm, (x, y)

    with tempfile.TemporaryDirectory(prefix=".tilewise-pyramid-", dir=workdir or path.parent) as tmp:
        levels = PyramidLevels(planes, shapes, labels, Path(tmp))
        band = max(tile, levels.factor)
        with tifffile.TiffWriter(path, bigtiff=bigtiff, ome=True) as tif:
            tif.write(
                _tiles(planes, tile, levels.add_band, band),
                shape=planes.shape if channels > 1 else (height, width),
                subifds=len(shapes) - 1,
                resolution=resolution(0),
                metadata=_ome_metadata(axes, mpp, provenance, channels, labels),
                **common,
            )
            for k, level in enumerate(levels.arrays, start=1):
                level.flush()
                tif.write(
                    _tiles(level, tile),
                    shape=level.shape if channels > 1 else level.shape[1:],
                    subfiletype=1,
                    resolution=resolution(k),
                    **common,
                )
        for level in levels.arrays:
            level._mmap.close()  # type: ignore[attr-defined]
    logger.info("wrote a pyramidal OME-TIFF %s %s, %d levels", planes.shape, planes.dtype, len(shapes))
    return shapes

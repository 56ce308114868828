"""Multiscale OME-Zarr outputs (``format=ome.zarr``): a zip of an OME-NGFF 0.4 image group.

The same levels as :mod:`service.pyramid` (labels by mode, values by mean, reduced from level 0's
bands while level 0 is written), stored as zarr v2 arrays ``0``, ``1``, ... of shape ``(C, h, w)``,
chunks ``(1, 256, 256)``, zlib-compressed, in a zip file (``ZipStore``: each chunk written once).
The group's ``multiscales`` metadata gives the axes ``c, y, x`` (``y``, ``x`` in micrometres
when the input's mpp is known) and each level's ``scale`` transform; a label output adds
``image-label``; the provenance is the attribute ``tilewise``. Memory: a band of ``256 x 2048``
pixel blocks, whatever the image size.

Source: OME-NGFF 0.4, https://ngff.openmicroscopy.org/0.4/ (multiscales, image-label).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from service.pyramid import PYRAMID_TILE, PyramidLevels, pyramid_shapes

__all__ = ["write_ome_zarr"]

logger = logging.getLogger(__name__)

_COLUMNS = 2048


def _copy(source: Any, target: Any, r0: int, r1: int) -> None:
    """``target[:, r0:r1] = source[:, r0:r1]``, ``_COLUMNS`` columns at a time (whole chunks)."""
    width = int(source.shape[-1])
    for c0 in range(0, width, _COLUMNS):
        target[:, r0:r1, c0 : c0 + _COLUMNS] = np.asarray(source[:, r0:r1, c0 : c0 + _COLUMNS])


def _multiscales(shapes: list[tuple[int, int]], mpp: tuple[float, float] | None) -> list[dict[str, Any]]:
    unit = {"unit": "micrometer"} if mpp is not None else {}
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", **unit},
            {"name": "x", "type": "space", **unit}]  # fmt: skip
    size = mpp or (1.0, 1.0)
    datasets = [
        {"path": str(k), "coordinateTransformations": [
            {"type": "scale", "scale": [1.0, size[0] * 2**k, size[1] * 2**k]}]}
        for k in range(len(shapes))
    ]  # fmt: skip
    return [{"version": "0.4", "name": "tilewise", "axes": axes, "datasets": datasets}]


def write_ome_zarr(
    array: np.ndarray,
    path: str | Path,
    *,
    labels: bool,
    mpp: tuple[float, float] | None = None,
    provenance: Any = None,
    workdir: str | Path | None = None,
) -> list[tuple[int, int]]:
    """Write ``array`` as a zip of a multiscale OME-Zarr group (see the module docstring).

    Args:
        array: ``(H, W)`` labels or ``(C, H, W)`` values (any dtype zarr stores: float16 too).
        path: the output file (a zip).
        labels: reduce by mode (labels) or by mean (values).
        mpp: microns per pixel ``(y, x)`` of level 0, or ``None``.
        provenance: a :class:`service.provenance.Provenance` or ``None``.
        workdir: folder of the coarser levels' temporaries (default: beside ``path``).

    Returns:
        The ``(height, width)`` of every level written.
    """
    import numcodecs
    import zarr
    from zarr.storage import ZipStore

    path = Path(path)
    planes = array[None] if array.ndim == 2 else array
    channels, height, width = (int(n) for n in planes.shape)
    shapes = pyramid_shapes(height, width)
    with tempfile.TemporaryDirectory(prefix=".tilewise-pyramid-", dir=workdir or path.parent) as tmp:
        levels = PyramidLevels(planes, shapes, labels, Path(tmp))
        band = max(PYRAMID_TILE, levels.factor)
        store = ZipStore(path, mode="w")
        try:
            attrs: dict[str, Any] = {"multiscales": _multiscales(shapes, mpp)}
            if labels:
                attrs["image-label"] = {"version": "0.4"}
            if provenance is not None:
                attrs["tilewise"] = provenance.as_dict()
            # attributes given at creation: a zip entry is written once (no duplicate names)
            root = zarr.create_group(store, zarr_format=2, attributes=attrs)
            arrays = [
                root.create_array(str(k), shape=(channels, h, w), chunks=(1, PYRAMID_TILE, PYRAMID_TILE),
                                  dtype=planes.dtype, compressors=numcodecs.Zlib(level=6), fill_value=0)
                for k, (h, w) in enumerate(shapes)
            ]  # fmt: skip
            for r0 in range(0, height, band):
                r1 = min(r0 + band, height)
                levels.add_band(r0, r1)
                _copy(planes, arrays[0], r0, r1)
            for level, target in zip(levels.arrays, arrays[1:], strict=True):
                level.flush()
                for r0 in range(0, int(level.shape[1]), PYRAMID_TILE):
                    _copy(level, target, r0, r0 + PYRAMID_TILE)
        finally:
            store.close()
        for level in levels.arrays:
            level._mmap.close()  # type: ignore[attr-defined]
    logger.info("wrote a multiscale OME-Zarr %s %s, %d levels", planes.shape, planes.dtype, len(shapes))
    return shapes

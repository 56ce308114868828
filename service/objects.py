"""Objects out (``format=geojson``): one GeoJSON Feature per connected object of a label image
(issue 21 item 5).

An object is a connected set of pixels of one non-zero label, 8-connected (as
``skimage.measure.label``'s default, ``connectivity=2``, in 2D). Its geometry is the exact outline
of its pixels in level-0 pixel coordinates: pixel ``(row, col)`` is the square ``[col, col + 1] x
[row, row + 1]`` (GeoJSON ``[x, y]`` = ``[col, row]``, QuPath's convention), holes kept; a
``Polygon``, or a ``MultiPolygon`` when parts touch only at a corner. Properties:
``objectType`` (``annotation``), ``classification`` (``{"name", "color": [r, g, b]}``, as QuPath
reads it: the spec's label name, the label PNG's colour), ``label`` (the id) and ``area`` (pixels).

Streamed in slabs of :data:`SLAB_ROWS` rows (fewer for images wider than 32,768 pixels), so
objects are joined wherever they are cut::

    slab s-1  ...  a a . b b      each slab: skimage.measure.label (8-connected, same value),
    --------------------------    its components' outlines (:mod:`service.outlines`);
    slab s    ...  . a a . b      the seam: previous last row x this first row (dx = -1, 0, 1),
                                  equal labels -> union-find joins the components;

a component whose joined object reaches no further (nothing of it on the slab's last row) is
closed: its pieces are united (shapely) and the Feature written. Memory: one slab's temporaries
(at most :data:`SLAB_PIXELS` pixels, some 30 bytes each), plus the outlines of the objects still
open.

The FeatureCollection carries the provenance as a foreign member ``tilewise``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_OBJECTS", "SLAB_PIXELS", "SLAB_ROWS", "write_geojson"]

logger = logging.getLogger(__name__)

#: Rows of the label image read and labelled at a time, at most ...
SLAB_ROWS = 128
#: ... and pixels per slab at most (a slab's temporaries are some 30 bytes a pixel).
SLAB_PIXELS = 1 << 21
#: Objects one GeoJSON output may hold (a label image of more is refused: ``format=ome.tiff``
#: keeps the labels themselves).
MAX_OBJECTS = 1_000_000


class _Objects:
    """Components of the objects still open, joined by a union-find (see the module docstring).

    ``members`` lists each root's components, so :meth:`pop` forgets all of them: what is kept is
    the open objects' components, never every object seen.
    """

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.value: dict[int, int] = {}
        self.area: dict[int, int] = {}
        self.pieces: dict[int, list[Any]] = {}
        self.members: dict[int, list[int]] = {}

    def find(self, g: int) -> int:
        root = g
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[g] != root:  # path compression
            self.parent[g], g = root, self.parent[g]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if ra > rb:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.area[ra] += self.area.pop(rb)
        self.pieces[ra].extend(self.pieces.pop(rb))
        self.members[ra].extend(self.members.pop(rb))

    def add(self, g: int, value: int, area: int, piece: Any) -> None:
        self.parent[g] = g
        self.value[g] = value
        self.area[g] = area
        self.pieces[g] = [piece]
        self.members[g] = [g]

    def pop(self, root: int) -> tuple[int, int, list[Any]]:
        """The closed object of ``root`` (value, area, pieces); its components are forgotten."""
        value = self.value[root]
        for g in self.members.pop(root):
            del self.parent[g]
            del self.value[g]
        return value, self.area.pop(root), self.pieces.pop(root)


def _integers(value: Any) -> Any:
    """GeoJSON coordinates as integers (pixel corners are whole numbers)."""
    if isinstance(value, (list, tuple)):
        return [_integers(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _feature(
    geometry: Any, value: int, area: int, names: dict[int, str], colours: Any, scale: tuple[float, float]
) -> dict[str, Any]:
    import shapely

    if scale != (1.0, 1.0):  # output pixels to level-0 (input) pixels: x by scale[1], y by scale[0]
        geometry = shapely.transform(geometry, lambda xy: xy * np.array([scale[1], scale[0]]))
    if hasattr(shapely, "orient_polygons"):  # RFC 7946: exteriors counter-clockwise
        geometry = shapely.orient_polygons(geometry)
    return {
        "type": "Feature",
        "geometry": _integers(shapely.geometry.mapping(geometry)),
        "properties": {
            "objectType": "annotation",
            "classification": {
                "name": names.get(value, f"label {value}"),
                "color": list(colours[value % len(colours)]),
            },
            "label": int(value),
            "area": _integers(float(area * scale[0] * scale[1])),
        },
    }


def write_geojson(
    labels: np.ndarray,
    path: str | Path,
    *,
    names: dict[int, str] | None = None,
    provenance: Any = None,
    slab_rows: int | None = None,
    scale: tuple[float, float] = (1.0, 1.0),
    max_objects: int | None = None,
) -> int:
    """Write the objects of ``labels`` as a GeoJSON FeatureCollection (see the module docstring).

    Args:
        labels: ``(H, W)`` non-negative integer labels (0 = background); numpy or a memmap, read
            ``slab_rows`` rows at a time.
        path: the output file.
        names: label id -> name (the spec's ``labels``); other ids are named ``label N``.
        provenance: a :class:`service.provenance.Provenance` or ``None``.
        slab_rows: rows per slab (any value gives the same objects); default
            ``min(SLAB_ROWS, SLAB_PIXELS // W)``, at least 8.
        scale: level-0 pixels per pixel of ``labels`` ``(y, x)``, when the labels are coarser than
            the input (a slide read at a level or an mpp): coordinates and ``area`` are multiplied
            so that they stay in level-0 pixels.
        max_objects: objects at most (default :data:`MAX_OBJECTS`).

    Returns:
        The number of objects (Features) written.

    Raises:
        ValueError: ``labels`` is not 2D.
        OverBudgetError: more than ``max_objects`` objects (HTTP 422 ``over_budget``); the
            partial file is removed.
    """
    import shapely
    from skimage.measure import label as connected

    from service.codecs.image_encode import LABEL_PALETTE
    from service.errors import OverBudgetError
    from service.outlines import component_outlines

    if labels.ndim != 2:
        raise ValueError(f"objects need a 2D label image; got shape {labels.shape}")
    names = {int(k): str(v) for k, v in (names or {}).items()}
    height, width = (int(n) for n in labels.shape)
    if slab_rows is None:
        slab_rows = max(8, min(SLAB_ROWS, SLAB_PIXELS // max(width, 1)))
    cap = MAX_OBJECTS if max_objects is None else int(max_objects)
    objects = _Objects()
    active: set[int] = set()
    last_ids = np.zeros(width, np.int64)
    last_values = np.zeros(width, np.int64)
    offset = 0
    written = 0
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write('{"type": "FeatureCollection"')
            if provenance is not None:
                fh.write(', "tilewise": ' + json.dumps(provenance.as_dict(), sort_keys=True))
            fh.write(', "features": [')

            def emit(root: int) -> None:
                nonlocal written
                if written >= cap:
                    raise OverBudgetError(
                        f"the label image has more than {cap} objects; GeoJSON output holds at most {cap} "
                        "(ask format=ome.tiff for the labels themselves)"
                    )
                value, area, pieces = objects.pop(root)
                if len(pieces) > 1:  # joined across seams: drop the seams' collinear vertices (lossless)
                    geometry = shapely.simplify(shapely.union_all(pieces), 0.0)
                else:
                    geometry = pieces[0]
                fh.write(
                    ("\n" if written == 0 else ",\n")
                    + json.dumps(_feature(geometry, value, area, names, LABEL_PALETTE, scale))
                )
                written += 1

            for r0 in range(0, height, slab_rows):
                slab = np.asarray(labels[r0 : r0 + slab_rows])
                ids, n = connected(slab, background=0, connectivity=2, return_num=True)  # type: ignore[no-untyped-call]
                if n:
                    areas = np.bincount(ids.ravel(), minlength=n + 1)
                    values = np.zeros(n + 1, np.int64)
                    values[ids.ravel()] = slab.ravel()
                    for i, piece in enumerate(component_outlines(ids, n, areas, r0), start=1):
                        objects.add(offset + i, int(values[i]), int(areas[i]), piece)
                        active.add(offset + i)
                    first = np.where(ids[0] > 0, ids[0] + offset, 0)
                    for dx in (-1, 0, 1):  # the seam, 8-connected: (r0 - 1, x) with (r0, x + dx)
                        lo, hi = max(0, -dx), width - max(0, dx)
                        a, b = last_ids[lo:hi], first[lo + dx : hi + dx]
                        joined = (a > 0) & (b > 0) & (last_values[lo:hi] == slab[0, lo + dx : hi + dx])
                        for pair in np.unique(np.stack([a[joined], b[joined]], 1), axis=0):
                            objects.union(int(pair[0]), int(pair[1]))
                last_ids = np.where(ids[-1] > 0, ids[-1] + offset, 0)
                last_values = slab[-1].astype(np.int64)
                offset += n
                still_open = {objects.find(int(g)) for g in np.unique(last_ids) if g}
                for root in sorted({objects.find(g) for g in active} - still_open):
                    emit(root)
                active = still_open
            for root in sorted(active):
                emit(root)
            fh.write("\n]}\n")
    except BaseException:
        Path(path).unlink(missing_ok=True)  # no half-written output
        raise
    logger.info("wrote %d objects of a %s label image as GeoJSON", written, labels.shape)
    return written

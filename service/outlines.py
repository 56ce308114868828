"""Exact pixel outlines of labelled components as polygons, by tracing pixel edges.

Pixel ``(row, col)`` is the square ``[col, col + 1] x [row, row + 1]`` (``x = col``, ``y = row``,
y down). Every edge between a pixel of component ``k`` and a pixel not of ``k`` is directed with
``k`` on its right::

    (c, r) --E--> (c+1, r)        top edge (the pixel below is k)
      ^               |
      N               S           left / right edges
      |               v
    (c, r+1) <--W-- (c+1, r+1)    bottom edge

so each component's edges close into rings: its outer boundaries turn clockwise on screen (positive
shoelace area in these coordinates), its holes counter-clockwise. Where two pixels of a component
touch only at a corner, the vertex has two ways out; the ring takes the right turn (around the pixel
it came along), and a ring that still passes a vertex twice is split there, so every ring is simple
and rings meet at points only (valid for OGC / shapely: holes may touch their shell, parts of a
MultiPolygon may touch each other, at points). Holes go to the smallest outer ring that covers
them. Collinear vertices are dropped. A component whose polygon is not valid or whose area differs
from its pixel count (not expected) is made the slow way instead: the union of its pixel runs.

Cost: a few numpy passes over the slab plus a Python step per boundary edge.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["component_outlines"]

_E, _S, _W, _N = 0, 1, 2, 3


def _edges(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Directed boundary edges of every component: ``(component, start vertex, end vertex,
    direction)``; vertex ``y * (W + 1) + x``."""
    rows, width = ids.shape
    padded = np.zeros((rows + 2, width + 2), ids.dtype)
    padded[1:-1, 1:-1] = ids
    stride = width + 1
    comps, starts, ends, dirs = [], [], [], []
    # (neighbour, start offset (dx, dy), end offset, direction) of each side of pixel (r, c)
    sides = (
        (padded[:-2, 1:-1], (0, 0), (1, 0), _E),
        (padded[1:-1, 2:], (1, 0), (1, 1), _S),
        (padded[2:, 1:-1], (1, 1), (0, 1), _W),
        (padded[1:-1, :-2], (0, 1), (0, 0), _N),
    )
    for neighbour, (sx, sy), (ex, ey), direction in sides:
        r, c = np.nonzero((ids != 0) & (ids != neighbour))
        comps.append(ids[r, c])
        starts.append((r + sy) * stride + c + sx)
        ends.append((r + ey) * stride + c + ex)
        dirs.append(np.full(r.size, direction, np.int8))
    return (
        np.concatenate(comps).astype(np.int64),
        np.concatenate(starts).astype(np.int64),
        np.concatenate(ends).astype(np.int64),
        np.concatenate(dirs),
    )


def _successors(
    comp: np.ndarray, start: np.ndarray, end: np.ndarray, dirs: np.ndarray, n_vertices: int
) -> list[int]:
    """The edge that follows each edge: the one of the same component leaving its end vertex (the
    right turn where there are two)."""
    key = comp * n_vertices + start
    order = np.lexsort((dirs, key))
    sorted_key = key[order]
    target = comp * n_vertices + end
    lo = np.searchsorted(sorted_key, target, "left")
    hi = np.searchsorted(sorted_key, target, "right")
    nxt = order[lo]
    two = np.nonzero(hi - lo == 2)[0]
    if two.size:
        second = order[lo[two] + 1]
        right = (dirs[two] + 1) % 4
        nxt[two] = np.where(dirs[second] == right, second, nxt[two])
    successors: list[int] = nxt.tolist()
    return successors


def _split(vertices: list[int]) -> list[list[int]]:
    """A closed vertex sequence split into simple rings at every repeated vertex."""
    rings: list[list[int]] = []
    path: list[int] = []
    where: dict[int, int] = {}
    for v in vertices:
        if v in where:
            i = where[v]
            rings.append(path[i:])
            for u in path[i + 1 :]:
                del where[u]
            del path[i + 1 :]
        else:
            where[v] = len(path)
            path.append(v)
    rings.append(path)
    return [ring for ring in rings if len(ring) >= 4]


def _area2(xy: np.ndarray) -> int:
    """Twice the signed (shoelace) area of a closed ring given without its closing vertex."""
    x, y = xy[:, 0], xy[:, 1]
    return int(np.dot(x[:-1], y[1:]) - np.dot(x[1:], y[:-1]) + x[-1] * y[0] - x[0] * y[-1])


def _polygon(rings: list[np.ndarray]) -> Any:
    """Polygon or MultiPolygon from simple rings (outer ones positive, holes negative)."""
    import shapely

    signs = [_area2(r) for r in rings]
    shells = [r for r, a in zip(rings, signs, strict=True) if a > 0]
    holes = [r for r, a in zip(rings, signs, strict=True) if a < 0]
    if len(shells) == 1:
        return shapely.Polygon(shells[0], holes)
    polygons = [shapely.Polygon(s) for s in shells]
    areas = [p.area for p in polygons]
    owned: list[list[np.ndarray]] = [[] for _ in shells]
    for hole in holes:
        ring = shapely.LinearRing(hole)
        inside = [i for i, p in enumerate(polygons) if p.covers(ring)]
        owned[min(inside, key=lambda i: areas[i])].append(hole)
    return shapely.MultiPolygon([shapely.Polygon(s, h) for s, h in zip(shells, owned, strict=True)])


def _runs_union(ids: np.ndarray, k: int, r0: int) -> Any:
    """The union of component ``k``'s pixel runs as boxes (the slow, sure way)."""
    import shapely

    r, c = np.nonzero(ids == k)
    return shapely.union_all(shapely.box(c, r0 + r, c + 1, r0 + r + 1))


def component_outlines(ids: np.ndarray, n: int, areas: np.ndarray, r0: int = 0) -> list[Any]:
    """The outline of each component ``1..n`` of ``ids`` as a shapely (Multi)Polygon.

    Args:
        ids: ``(R, W)`` component ids (0 = none), e.g. ``skimage.measure.label``'s, of the rows
            ``[r0, r0 + R)`` of an image.
        n: the number of components.
        areas: ``(n + 1,)`` pixel count of each id (checked against each polygon's area).
        r0: the first row's index in the image (added to ``y``).

    Returns:
        ``n`` geometries in image pixel coordinates (see the module docstring).
    """
    import shapely

    rows, width = ids.shape
    comp, start, end, dirs = _edges(ids)
    n_vertices = (rows + 1) * (width + 1)
    order = np.argsort(comp, kind="stable")  # rings found component by component
    nxt = _successors(comp, start, end, dirs, n_vertices)
    turn = (dirs != dirs[nxt]).tolist()  # the edge's end vertex is a corner
    end_list = end.tolist()
    comp_list = comp.tolist()
    seen = [False] * len(nxt)
    rings: list[list[np.ndarray]] = [[] for _ in range(n + 1)]
    stride = width + 1
    for e0 in order.tolist():
        if seen[e0]:
            continue
        corners = []
        e = e0
        while not seen[e]:
            seen[e] = True
            if turn[e]:
                corners.append(end_list[e])
            e = nxt[e]
        for ring in _split(corners):
            v = np.asarray(ring, np.int64)
            rings[comp_list[e0]].append(np.stack([v % stride, v // stride + r0], axis=1))
    outlines = []
    for k in range(1, n + 1):
        geometry = _polygon(rings[k])
        if geometry.area != areas[k] or not shapely.is_valid(geometry):  # pragma: no cover - a safety net
            geometry = _runs_union(ids, k, r0)
        outlines.append(geometry)
    return outlines

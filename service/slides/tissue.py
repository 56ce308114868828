"""The tissue mask of a slide and the tiles it leaves unrun (issue 21 item 3).

Shapes: the thumbnail is ``(h, w, 3)`` uint8, the mask ``(h, w)`` bool, both at a low level;
regions are asked in ``(H, W)`` pixels of the resolution read.

The tissue mask (:class:`TissueMask`, ``mask=auto``) and the glass colour come from a low level
(:func:`thumbnail`); regions wholly outside the (dilated) mask are answered as blank glass without
being read (:class:`service.slides.SlideRegions`), and the engine's constant-tile reuse
(:mod:`tiling.reuse`) runs the network on that blank once: :func:`expected_skipped` counts the
tiles this leaves unrun.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from service.slides.readers import _Slide

__all__ = ["GLASS_TOLERANCE", "MASK_SIDE", "TissueMask", "background_tiles", "expected_skipped", "thumbnail"]

#: A mask pixel further than this from the glass's colour (any channel, 0-255) is tissue.
GLASS_TOLERANCE = 10.0
#: The tissue mask is made on at most this many pixels per side.
MASK_SIDE = 2048


class TissueMask:
    """Tissue on a low level: saturation (HSV) above Otsu's threshold (clamped to 0.02-0.08, so a
    slide that is all tissue is never split in two), dark (mean optical density above 0.25) or
    further than :data:`GLASS_TOLERANCE` from the glass's colour (the median of the rest), dilated
    by 2 mask pixels, holes filled; and the glass colour, read at the background pixel farthest
    from tissue.

    Args:
        thumb: ``(h, w, 3)`` uint8, the whole slide at a low resolution.
        out_shape: ``(H, W)`` of the image the regions are asked in.

    Notes:
        Memory: the thumbnail (at most :data:`MASK_SIDE` squared times 3 bytes, 12 MiB) and an
        int32 integral image of the mask (16 MiB at most).

    Source:
        Otsu on saturation: CLAM (Lu et al., Nature BME 2021) ``segmentTissue``; scikit-image's
        ``threshold_otsu`` and ``rgb2hsv``.
    """

    def __init__(self, thumb: np.ndarray, out_shape: tuple[int, int]) -> None:
        from scipy import ndimage
        from skimage.color import rgb2hsv
        from skimage.filters import threshold_otsu

        sat = rgb2hsv(thumb)[..., 1]
        threshold = float(threshold_otsu(sat)) if float(np.ptp(sat)) > 0 else 1.0  # type: ignore[no-untyped-call]
        threshold = min(max(threshold, 0.02), 0.08)
        density = -np.log10(np.maximum(thumb.astype(np.float32), 1.0) / 255.0).mean(axis=-1)
        tissue = (sat > threshold) | (density > 0.25)
        if not tissue.all():  # and any colour away from the glass's (unstained but not empty)
            glass = np.median(thumb[~tissue], axis=0)
            tissue |= np.abs(thumb.astype(np.float32) - glass).max(axis=-1) > GLASS_TOLERANCE
        # holes (a lumen, a fat cell) are tissue: only glass open to the slide's edge is skipped
        self.tissue = ndimage.binary_fill_holes(ndimage.binary_dilation(tissue, iterations=2))
        self.thumb_shape = tuple(int(n) for n in tissue.shape)
        self.out_shape = out_shape
        self._sum = np.pad(self.tissue.astype(np.int32).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
        self.fraction = float(self.tissue.mean())
        background = ~self.tissue
        self.far: tuple[float, float] | None = None
        if background.any():  # the glass pixel farthest from tissue, as a fraction of the image
            dist = ndimage.distance_transform_edt(np.pad(background, 1))[1:-1, 1:-1]
            ty, tx = np.unravel_index(int(np.argmax(dist)), dist.shape)
            self.far = ((ty + 0.5) / self.thumb_shape[0], (tx + 0.5) / self.thumb_shape[1])

    def background_grid(self, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """:meth:`background` of every box ``ys[i] x xs[j]`` (``ys``: ``(n, 2)`` rows ``[y0, y1)``,
        ``xs``: ``(m, 2)``) at once: ``(n, m)`` bool."""
        (H, W), (h, w) = self.out_shape, self.thumb_shape

        def thumb_span(spans: np.ndarray, n_out: int, n_thumb: int) -> tuple[np.ndarray, np.ndarray]:
            a = np.clip(spans[:, 0], 0, None) * n_thumb // n_out  # floor, integer exact
            b = -(-np.minimum(spans[:, 1], n_out) * n_thumb // n_out)  # ceil
            return a, np.maximum(b, a + 1)

        ty0, ty1 = thumb_span(np.asarray(ys, np.int64).reshape(-1, 2), H, h)
        tx0, tx1 = thumb_span(np.asarray(xs, np.int64).reshape(-1, 2), W, w)
        s = self._sum
        total = s[ty1[:, None], tx1[None]] - s[ty0[:, None], tx1[None]] - s[ty1[:, None], tx0[None]]
        empty: np.ndarray = (total + s[ty0[:, None], tx0[None]]) == 0  # numpy types == as Any
        return empty

    def background(self, y0: int, y1: int, x0: int, x1: int) -> bool:
        """Whether the region ``[y0, y1) x [x0, x1)`` (out pixels, clipped to the image) has no tissue."""
        H, W = self.out_shape
        h, w = self.thumb_shape
        ty0, ty1 = math.floor(max(y0, 0) * h / H), math.ceil(min(y1, H) * h / H)
        tx0, tx1 = math.floor(max(x0, 0) * w / W), math.ceil(min(x1, W) * w / W)
        ty1, tx1 = max(ty1, ty0 + 1), max(tx1, tx0 + 1)
        s = self._sum
        return int(s[ty1, tx1] - s[ty0, tx1] - s[ty1, tx0] + s[ty0, tx0]) == 0


def thumbnail(slide: _Slide, max_side: int = MASK_SIDE) -> np.ndarray:
    """The whole slide as ``(h, w, 3)`` uint8 with ``max(h, w) <= max_side``: the coarsest level,
    read in row strips and block-averaged by an integer factor ``k`` when it is still larger
    (``h = ceil(H / k)``: the last block of each axis is ragged, averaged over what it holds, so a
    level thinner than ``k`` still gives one row)."""
    level = len(slide.info.levels) - 1
    H, W = slide.level_shape(level)
    k = max(1, math.ceil(max(H, W) / max_side))
    h, w = -(-H // k), -(-W // k)
    out = np.zeros((h, w, 3), np.uint8)
    rows = max(k, (16 << 20) // max(W * 3, 1) // k * k)
    cols = np.arange(0, W, k)
    col_n = np.diff(np.append(cols, W)).astype(np.float32)
    for y in range(0, H, rows):
        block = slide.read(level, y, min(y + rows, H), 0, W).astype(np.float32)
        starts = np.arange(0, block.shape[0], k)
        if k > 1:
            row_n = np.diff(np.append(starts, block.shape[0])).astype(np.float32)
            sums = np.add.reduceat(np.add.reduceat(block, starts, axis=0), cols, axis=1)
            block = sums / (row_n[:, None, None] * col_n[None, :, None])
        out[y // k : y // k + len(starts)] = np.round(block).astype(np.uint8)
    return out


def background_tiles(grid: Any, mask: TissueMask) -> list[bool]:
    """Per tile of ``grid`` (C order): whether its whole read region (halo and padding included,
    as :func:`tiling.reuse.read_box` gives it) lies outside the tissue; ``grid`` is 2D ``(H, W)``.
    One integral-image look-up per tile, vectorized: a million tiles cost milliseconds."""
    spans = [np.array([(s - a.pad_lo, s - a.pad_lo + a.tile) for s in a.starts], np.int64) for a in grid.axes]
    return mask.background_grid(spans[0], spans[1]).ravel().tolist()


def expected_skipped(plan: Any, regions: Any, spec: Any = None) -> Any:
    """``plan`` with :attr:`~models.RunPlan.skipped` set to the tiles a slide's tissue mask leaves
    unrun (its background tiles but those of the first batch that holds any), when ``regions`` has a mask, and
    the warning of a slide whose mpp is missing or implausible. Counted once per pass: once for a
    ``spec`` that flips inside each tile (:func:`models.execution.execute.flips_in_tiles`)."""
    import dataclasses

    resolution = getattr(regions, "resolution", None)
    note = None if resolution is None else resolution.note
    if note is not None:  # the X-Tilewise-Warning of a slide without a usable mpp
        said = f"{note}; read at level 0 as it is"
        plan = dataclasses.replace(plan, warning=f"{plan.warning}; {said}" if plan.warning else said)
    mask = getattr(regions, "mask", None)
    if mask is None or getattr(regions, "glass", None) is None:
        return plan
    flags = background_tiles(plan.grid, mask)
    batch = int(plan.batch_size)
    # the engine runs a batch whole but for values an earlier batch ran: the first batch holding
    # background tiles runs them all (tiling.reuse), every later one is a copy
    first = next((flags[i : i + batch] for i in range(0, len(flags), batch) if any(flags[i : i + batch])), [])
    skipped = sum(flags) - sum(first)
    from models.execution.execute import flips_in_tiles

    passes = 1 if spec is not None and flips_in_tiles(spec) else len(plan.flips)
    return dataclasses.replace(plan, skipped=skipped * passes)

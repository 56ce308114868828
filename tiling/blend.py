"""Blend windows, per-tile weights and per-axis coverage (the floating-point side of a plan).

A Cartesian tile grid with separable windows has a separable coverage: the sum over all tiles of
the product of per-axis weights is the product over axes of per-axis sums. So coverage is held as
one 1-D vector per axis and never as a full-size map. :func:`axis_weights` turns the integer plan
of one axis (:class:`~tiling.grid.AxisPlan`) into those vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tiling.errors import CoverageError
from tiling.geometry import BlendMode, Placement
from tiling.grid import AxisPlan, TileGrid

__all__ = ["AxisWeights", "GAUSSIAN_SIGMA_SCALE", "axis_weights", "blend_window", "grid_weights"]

#: Gaussian sigma as a fraction of the window length, as nnU-Net's importance map (``sigma_scale=1/8``).
GAUSSIAN_SIGMA_SCALE = 1.0 / 8.0

Vector = npt.NDArray[np.float32]


def blend_window(
    length: int,
    mode: BlendMode,
    *,
    flat_lo: bool = False,
    flat_hi: bool = False,
    sigma: float | None = None,
    centre: float | None = None,
) -> Vector:
    """Return a 1-D blend window of ``length`` strictly positive float32 weights, peak 1.

    Args:
        length: window length in voxels (> 0).
        mode: the window shape. ``hann`` and ``triangular`` are computed two samples longer and
            trimmed (as torchio does), so their ends are > 0; ``gaussian`` is floored at 1e-6.
        flat_lo: set the half below the peak to 1 (the side that lies on the image border, where
            no other tile contributes).
        flat_hi: set the half above the peak to 1.
        sigma: standard deviation of the ``gaussian`` window (voxels); default ``length / 8``.
            The engine passes ``tile / 8``, relative to the tile size as nnU-Net's importance map.
        centre: index of the ``gaussian``'s peak; default ``(length - 1) / 2`` (MONAI's
            ``compute_importance_map``); nnU-Net's ``compute_gaussian`` puts it at ``length // 2``.

    Returns:
        ``(length,)`` float32 array with ``0 < w <= 1``.

    >>> blend_window(4, BlendMode.TRIANGULAR).tolist()
    [0.5, 1.0, 1.0, 0.5]
    """
    if mode is BlendMode.CONSTANT:
        w = np.ones(length, dtype=np.float64)
    elif mode is BlendMode.GAUSSIAN:
        x = np.arange(length, dtype=np.float64) - ((length - 1) / 2.0 if centre is None else centre)
        std = max(length * GAUSSIAN_SIGMA_SCALE if sigma is None else sigma, 1e-3)
        w = np.exp(-0.5 * (x / std) ** 2)
    elif mode is BlendMode.HANN:
        w = np.hanning(length + 2)[1:-1]
    else:  # BlendMode.TRIANGULAR
        w = np.bartlett(length + 2)[1:-1]
    w = np.maximum(w / w.max(), 1e-6)
    mid_lo = (length - 1) // 2
    mid_hi = length // 2
    if flat_lo:
        w[: mid_lo + 1] = 1.0
    if flat_hi:
        w[mid_hi:] = 1.0
    out: Vector = w.astype(np.float32)
    return out


@dataclass(frozen=True, eq=False)
class AxisWeights:
    """The blend weights of one axis.

    Attributes:
        weights: per tile, ``(write_hi - write_lo,)`` float32 weights of its written part.
        coverage: ``(out_length,)`` float32 sum of the weights at each output voxel (all > 0).
    """

    weights: tuple[Vector, ...]
    coverage: Vector


def axis_weights(axis: AxisPlan, mode: BlendMode) -> AxisWeights | None:
    """Weights and coverage of one axis; ``None`` when its writes partition the output (all ones).

    Each tile's window lies over its :attr:`~tiling.grid.AxisPlan.windows` span, flat on the sides
    that lie on the extent edge; written voxels outside the span get weight 1. The gaussian's sigma
    is ``out_tile / 8``, relative to the tile as nnU-Net's importance map, its peak at the span's
    centre (at ``out_tile // 2`` for the ``centred-nnunet`` placement, as nnU-Net's).

    >>> grid = TileGrid.plan((10,), 6, overlap=2, blend="triangular")
    >>> w = axis_weights(grid.axes[0], grid.blend)
    >>> [round(v, 3) for v in w.weights[0].tolist()], [round(v, 3) for v in w.weights[1].tolist()]
    ([1.0, 1.0, 1.0, 1.0, 0.667, 0.333], [0.333, 0.667, 1.0, 1.0, 1.0, 1.0])
    >>> w.coverage.tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]

    Raises:
        CoverageError: an output voxel has zero coverage (an engine bug).
    """
    if not axis.blended:
        return None
    coverage = np.zeros(axis.out_length, dtype=np.float32)
    weights = []
    for (lo, hi), (win_lo, win_hi), (flat_lo, flat_hi) in zip(
        axis.writes, axis.windows, axis.flat, strict=True
    ):
        centre = axis.out_tile // 2 if axis.placement is Placement.CENTRED_NNUNET else None
        window = blend_window(win_hi - win_lo, mode, flat_lo=flat_lo, flat_hi=flat_hi,
                              sigma=axis.out_tile * GAUSSIAN_SIGMA_SCALE, centre=centre)  # fmt: skip
        full_lo, full_hi = min(lo, win_lo), max(hi, win_hi)
        full = np.ones(full_hi - full_lo, dtype=np.float32)
        full[win_lo - full_lo : win_hi - full_lo] = window
        w = full[lo - full_lo : hi - full_lo]
        weights.append(w)
        coverage[lo:hi] += w
    if not bool((coverage > 0).all()):  # pragma: no cover - the plan covers every voxel
        raise CoverageError(f"zero coverage at output voxels {np.flatnonzero(coverage <= 0)[:8].tolist()}")
    return AxisWeights(tuple(weights), coverage)


def grid_weights(grid: TileGrid) -> tuple[AxisWeights | None, ...]:
    """:func:`axis_weights` of every axis of ``grid`` (``None`` for axes whose writes partition)."""
    return tuple(axis_weights(a, grid.blend) for a in grid.axes)

"""1-D blend windows and per-axis coverage.

A Cartesian tile grid with separable windows has a separable coverage: the sum over all tiles of
the product of per-axis weights is the product over axes of per-axis sums. So coverage is held as
one 1-D vector per axis and never as a full-size map.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tiling.geometry import BlendMode

__all__ = ["GAUSSIAN_SIGMA_SCALE", "blend_window"]

#: Gaussian sigma as a fraction of the window length, as nnU-Net's importance map (``sigma_scale=1/8``).
GAUSSIAN_SIGMA_SCALE = 1.0 / 8.0


def blend_window(
    length: int,
    mode: BlendMode,
    *,
    flat_lo: bool = False,
    flat_hi: bool = False,
    sigma: float | None = None,
) -> npt.NDArray[np.float32]:
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

    Returns:
        ``(length,)`` float32 array with ``0 < w <= 1``.

    >>> blend_window(4, BlendMode.TRIANGULAR).tolist()
    [0.5, 1.0, 1.0, 0.5]
    """
    if mode is BlendMode.CONSTANT:
        w = np.ones(length, dtype=np.float64)
    elif mode is BlendMode.GAUSSIAN:
        x = np.arange(length, dtype=np.float64) - (length - 1) / 2.0
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
    out: npt.NDArray[np.float32] = w.astype(np.float32)
    return out

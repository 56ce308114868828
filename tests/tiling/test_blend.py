"""Blend windows: strictly positive, peak 1, symmetric, float32, flat on the image-border side."""

from __future__ import annotations

import numpy as np
import pytest

from tiling import BlendMode
from tiling.blend import blend_window

MODES = [pytest.param(m, id=m.value) for m in BlendMode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [pytest.param(n, id=f"len{n}") for n in (1, 2, 3, 8, 33, 300)])
def test_window_positive_peak_one_symmetric(mode, length):
    w = blend_window(length, mode)
    assert w.dtype == np.float32 and w.shape == (length,)
    assert (w > 0).all(), "zero weights give NaN after normalization"
    assert w.max() == np.float32(1.0)
    np.testing.assert_array_equal(w, w[::-1])


@pytest.mark.parametrize("mode", MODES)
def test_window_flat_sides(mode):
    n = 9
    w = blend_window(n, mode)
    lo = blend_window(n, mode, flat_lo=True)
    hi = blend_window(n, mode, flat_hi=True)
    both = blend_window(n, mode, flat_lo=True, flat_hi=True)
    np.testing.assert_array_equal(lo[: n // 2 + 1], 1.0)
    np.testing.assert_array_equal(lo[n // 2 :], w[n // 2 :])
    np.testing.assert_array_equal(hi[n // 2 :], 1.0)
    np.testing.assert_array_equal(hi[: n // 2 + 1], w[: n // 2 + 1])
    np.testing.assert_array_equal(both, 1.0)


def test_known_windows():
    # Trimmed windows two samples longer than asked (so the ends are not zero), normalized to peak 1.
    np.testing.assert_allclose(blend_window(4, BlendMode.TRIANGULAR), [0.5, 1.0, 1.0, 0.5])
    hann = np.hanning(7)[1:-1]
    np.testing.assert_allclose(blend_window(5, BlendMode.HANN), hann / hann.max(), rtol=1e-6)
    x = np.arange(16) - 7.5
    gauss = np.exp(-0.5 * (x / 2.0) ** 2)  # sigma = 16 / 8 (nnU-Net's 1/8 of the tile)
    np.testing.assert_allclose(blend_window(16, BlendMode.GAUSSIAN), gauss / gauss.max(), rtol=1e-6)
    np.testing.assert_array_equal(blend_window(5, BlendMode.CONSTANT), np.ones(5, np.float32))


def test_gaussian_floor_keeps_long_windows_positive():
    w = blend_window(2000, BlendMode.GAUSSIAN)
    assert w.min() >= np.float32(1e-6)

"""Strided networks and scaled outputs reassemble exactly.

- A small U-Net with two 2x max-poolings (total stride, hence alignment, 4) and its *measured*
  receptive-field radius as the halo: tiled == whole-image forward pass. For image sizes that are not
  multiples of 4 the reference is the whole image zero-padded at its end to a multiple of 4 (what a
  whole-image pass of this network needs), cropped back.
- Predictors that upsample by 2 (nearest, ``repeat_interleave``) or downsample by 2 (stride-2 average
  pooling, alignment 2) reassemble to the scaled shape, equal to the whole-image pass.

Tolerance: 1e-5 max abs difference (acceptance bound); outputs are O(1) and differ from the reference
only by fp32 rounding of convolutions over differently sized inputs (measured ~1e-7).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _tiling_nets import ConvStack, TinyUNet, measure_radius, pad_end, upsample_nearest, whole

from tiling import tiled_inference

ATOL = 1e-5  # acceptance bound; see the module docstring


def _crop(y: np.ndarray, shape) -> np.ndarray:
    return y[(slice(None), *(slice(0, s) for s in shape))]


@pytest.fixture(scope="module")
def unet_2d() -> tuple[TinyUNet, int]:
    torch.set_num_threads(1)
    net = TinyUNet(2)
    return net, measure_radius(net, 2, 1, alignment=4, size=64, all_phases=True)


@pytest.fixture(scope="module")
def unet_3d() -> tuple[TinyUNet, int]:
    torch.set_num_threads(1)
    net = TinyUNet(3)
    return net, measure_radius(net, 3, 1, alignment=4, size=36, all_phases=False)


def test_unet_radius_is_the_theoretical_one(unet_2d, unet_3d):
    # Layer arithmetic for this architecture: an output at phase 1 of the stride-4 grid reaches
    # 13 input voxels up (dec0 +1, dec1 +1 at stride 2, bottom +1 at stride 4, then back down through
    # the pooling windows and enc1/enc0). The probe must find exactly that, in 2-D and 3-D.
    assert unet_2d[1] == 13
    assert unet_3d[1] == 13


@pytest.mark.parametrize(
    ("shape", "tile", "extra_halo", "overlap", "blend"),
    [
        pytest.param((64, 76), (32, 36), 0, 0, "constant", id="mult4-h=r"),
        pytest.param((36, 44), (36, 40), 3, 0, "constant", id="mult4-h=r+3"),
        pytest.param((60, 52), (40, 36), 0, (4, 2), "hann", id="mult4-h=r-overlap-hann"),
        pytest.param((37, 42), (32, 36), 0, 0, "constant", id="non-mult4"),
        pytest.param((63, 50), (36, 40), 1, (2, 6), "gaussian", id="non-mult4-overlap-gaussian"),
        pytest.param((9, 70), (32, 32), 0, 0, "constant", id="smaller-than-tile-on-axis0"),
    ],
)
@pytest.mark.parametrize("fixed", [pytest.param(False, id="sized"), pytest.param(True, id="fixed")])
def test_unet_2d_exact(unet_2d, rng, record_diff, shape, tile, extra_halo, overlap, blend, fixed):
    net, radius = unet_2d
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=radius + extra_halo, overlap=overlap, blend=blend, alignment=4,
                        batch_size=2, fixed_tile_shape=fixed)  # fmt: skip
    want = _crop(whole(net, pad_end(x, 4)), shape)
    diff = record_diff("unet-2d-align4", y, want)
    assert diff <= ATOL, f"max abs diff {diff:.3e} > {ATOL}"


@pytest.mark.parametrize(
    ("shape", "tile", "overlap"),
    [
        pytest.param((40, 36, 44), (32, 36, 36), 0, id="mult4"),
        pytest.param((36, 38, 33), (32, 32, 36), (2, 0, 4), id="non-mult4-overlap"),
    ],
)
def test_unet_3d_exact(unet_3d, rng, record_diff, shape, tile, overlap):
    net, radius = unet_3d
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=radius, overlap=overlap, blend="triangular", alignment=4)
    want = _crop(whole(net, pad_end(x, 4)), shape)
    diff = record_diff("unet-3d-align4", y, want)
    assert diff <= ATOL, f"max abs diff {diff:.3e} > {ATOL}"


def test_unet_halo_below_radius_is_detected(unet_2d, rng):
    # Negative control: half the measured radius shows at the seams. (radius - 1 may still be exact:
    # the full reach occurs only at one phase of the stride-4 grid, which may not sit at a core edge.)
    net, radius = unet_2d
    x = rng.standard_normal((1, 64, 64), dtype=np.float32)
    y = tiled_inference(x, net, 32, halo=radius // 2, alignment=4)
    assert np.abs(y - whole(net, x)).max() > 1e-4


class Upsample2(torch.nn.Module):
    """Conv stack (r = 3) followed by nearest 2x upsampling: output voxel 2i, 2i+1 <- input voxel i."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.net = ConvStack(ndim, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return upsample_nearest(self.net(x), 2)


class Downsample2(torch.nn.Module):
    """Conv stack (r = 3) followed by 2x2(x2) average pooling with stride 2 (alignment 2)."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.net = ConvStack(ndim, 1, 2)
        self.pool = {2: F.avg_pool2d, 3: F.avg_pool3d}[ndim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.net(x), 2)


@pytest.mark.parametrize(
    ("shape", "tile", "overlap", "blend"),
    [
        pytest.param((23, 30), (12, 10), 0, "constant", id="2d-ov0"),
        pytest.param((23, 30), (12, 10), 2, "hann", id="2d-ov2-hann"),
        pytest.param((5, 6), (12, 12), 0, "constant", id="2d-smaller-than-tile"),
        pytest.param((9, 11, 10), (8, 9, 8), 1, "gaussian", id="3d-ov1-gaussian"),
    ],
)
def test_upsample_by_2(rng, record_diff, shape, tile, overlap, blend):
    net = Upsample2(len(shape))
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=3, overlap=overlap, blend=blend, scale=2)
    assert y.shape == (2, *(2 * s for s in shape))
    diff = record_diff("scale-up-x2", y, whole(net, x))
    assert diff <= ATOL, f"max abs diff {diff:.3e} > {ATOL}"


@pytest.mark.parametrize(
    ("shape", "tile", "overlap", "blend"),
    [
        pytest.param((22, 30), (12, 16), 0, "constant", id="2d-even-ov0"),
        pytest.param((23, 29), (12, 16), 2, "triangular", id="2d-odd-ov2-triangular"),
        pytest.param((13, 10, 15), (12, 10, 14), (2, 0, 2), "hann", id="3d-odd-ov2-hann"),
    ],
)
def test_downsample_by_2(rng, record_diff, shape, tile, overlap, blend):
    # Halo 4 (even, so the core edges fall on the output grid): an output voxel reads the conv at
    # 2j, 2j+1, i.e. the input at 2j - 3 .. 2j + 4, all inside the tile once 4 voxels are discarded.
    net = Downsample2(len(shape))
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    y = tiled_inference(x, net, tile, halo=4, overlap=overlap, blend=blend, alignment=2, scale=Fraction(1, 2))
    out_shape = tuple(-(-s // 2) for s in shape)
    assert y.shape == (2, *out_shape)
    want = _crop(whole(net, pad_end(x, 2)), out_shape)
    diff = record_diff("scale-down-x2", y, want)
    assert diff <= ATOL, f"max abs diff {diff:.3e} > {ATOL}"


def test_scale_float_and_fraction_agree(rng):
    net = Downsample2(2)
    x = rng.standard_normal((1, 20, 24), dtype=np.float32)
    a = tiled_inference(x, net, 12, halo=4, alignment=2, scale=0.5)
    b = tiled_inference(x, net, 12, halo=4, alignment=2, scale=Fraction(1, 2))
    np.testing.assert_array_equal(a, b)

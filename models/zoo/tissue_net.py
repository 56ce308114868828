"""The ``tissue-3d`` network: a small 3-D U-Net with batch norm for brain tissue classes.

Input ``(B, 1, X, Y, Z)`` (a T1 volume scaled by the spec's ``percentile`` step), output
``(B, 3, X, Y, Z)`` logits for labels 0 background, 1 grey matter, 2 white matter. Spatial sizes
must be multiples of :data:`ALIGNMENT` (two 2x max-pools).

Why it tiles exactly: in eval mode batch norm is a fixed per-channel affine map, every other
layer is a convolution, a max-pool on the stride-4 grid or a ReLU, so the output at a voxel
depends only on the input within :data:`RECEPTIVE_FIELD` voxels of it (on the same stride grid).
A tile with a halo of at least that radius, at an origin that is a multiple of the alignment,
reproduces the whole-volume pass to float rounding.

Layout (widths ``(8, 16, 32)`` by default; ``c`` = conv 3x3x3 + batch norm + ReLU)::

    level 0 (1 mm):   c c ─────────────────────────── cat → c c → conv 1x1x1 → 3 logits
    level 1 (2 mm):      └ pool → c c ───── cat → c c ┘
    level 2 (4 mm):                └ pool → c c ┘ (transposed conv 2x2x2, stride 2, going up)

With the default widths: 85,195 parameters (333 KiB as float32 safetensors); about 12 k
multiply-adds per voxel, so a 128^3 tile costs about 25 GMAC.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ALIGNMENT", "RECEPTIVE_FIELD", "TissueUNet", "build_tissue_unet"]

#: Total stride of the network: tile origins and sizes are multiples of it.
ALIGNMENT = 4
#: Receptive-field radius per axis in voxels (measured by an impulse probe, see the tests).
RECEPTIVE_FIELD = 23


def _block(c_in: int, c_out: int) -> nn.Sequential:
    """Two conv 3x3x3 (no bias: batch norm follows) + batch norm + ReLU."""
    return nn.Sequential(
        nn.Conv3d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm3d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv3d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm3d(c_out),
        nn.ReLU(inplace=True),
    )


class TissueUNet(nn.Module):
    """Two-level 3-D U-Net with batch norm, max-pool down and transposed-conv up.

    Args:
        in_channels: input channels (1 for a T1 volume).
        out_channels: output logits (3: background, grey matter, white matter).
        widths: feature channels at levels 0, 1 and 2.
    """

    alignment = ALIGNMENT
    radius = RECEPTIVE_FIELD

    def __init__(
        self, in_channels: int = 1, out_channels: int = 3, widths: Sequence[int] = (8, 16, 32)
    ) -> None:
        super().__init__()
        if len(widths) != 3 or not all(isinstance(w, int) and w > 0 for w in widths):
            raise TypeError(f"widths must be three positive ints, got {widths!r}")
        w0, w1, w2 = widths
        self.enc0 = _block(in_channels, w0)
        self.enc1 = _block(w0, w1)
        self.enc2 = _block(w1, w2)
        self.up1 = nn.ConvTranspose3d(w2, w1, 2, stride=2)
        self.dec1 = _block(2 * w1, w1)
        self.up0 = nn.ConvTranspose3d(w1, w0, 2, stride=2)
        self.dec0 = _block(2 * w0, w0)
        self.head = nn.Conv3d(w0, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, X, Y, Z)`` -> ``(B, out_channels, X, Y, Z)`` logits (sizes multiples of 4)."""
        s0 = self.enc0(x)
        s1 = self.enc1(F.max_pool3d(s0, 2))
        bottom = self.enc2(F.max_pool3d(s1, 2))
        y = self.dec1(torch.cat([self.up1(bottom), s1], dim=1))
        y = self.dec0(torch.cat([self.up0(y), s0], dim=1))
        out: torch.Tensor = self.head(y)
        return out


def build_tissue_unet(
    spatial_dims: int, in_channels: int, out_channels: int, *, widths: Sequence[int] = (8, 16, 32)
) -> TissueUNet:
    """Builder for the eager backend (``architecture: models.zoo.tissue_net:build_tissue_unet``).

    Raises:
        TypeError: ``spatial_dims`` is not 3, or ``widths`` is not three positive ints (the
            backend reports it as a spec error).
    """
    if spatial_dims != 3:
        raise TypeError(f"the tissue U-Net is 3-D only, got spatial_dims={spatial_dims}")
    return TissueUNet(in_channels, out_channels, tuple(widths))

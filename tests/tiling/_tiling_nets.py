"""Oracles for the tiling tests: small random networks whose whole-image forward pass is the reference.

Nothing here imports :mod:`tiling`: the references are plain PyTorch forward passes, ``numpy.pad``
and explicit loops, written independently of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


class ConvStack(nn.Module):
    """Stride-1 ``3**ndim`` convolutions with zero "same" padding and tanh in between.

    The receptive-field radius is exactly ``sum(dilations)`` voxels per axis.
    """

    def __init__(
        self, ndim: int, c_in: int, c_out: int, dilations: Sequence[int] = (1, 1, 1), *, hidden: int = 4,
        seed: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        chans = [c_in] + [hidden] * (len(dilations) - 1) + [c_out]
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.convs = nn.ModuleList(
                _CONV[ndim](chans[i], chans[i + 1], 3, padding=d, dilation=d) for i, d in enumerate(dilations)
            )
        self.radius = sum(dilations)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i < len(self.convs) - 1:
                x = torch.tanh(x)
        return x


def upsample_nearest(x: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """Nearest-neighbour upsampling of every spatial axis by ``factor`` (``repeat_interleave``)."""
    for axis in range(2, x.dim()):
        x = x.repeat_interleave(factor, dim=axis)
    return x


class TinyUNet(nn.Module):
    """A two-level U-Net (two 2x max-poolings, total stride / alignment 4), random weights."""

    alignment = 4

    def __init__(self, ndim: int, c_in: int = 1, c_out: int = 2, *, width: int = 4, seed: int = 0) -> None:
        super().__init__()
        conv = _CONV[ndim]
        self.ndim = ndim
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.enc0 = conv(c_in, width, 3, padding=1)
            self.enc1 = conv(width, width, 3, padding=1)
            self.bottom = conv(width, width, 3, padding=1)
            self.dec1 = conv(2 * width, width, 3, padding=1)
            self.dec0 = conv(2 * width, c_out, 3, padding=1)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = _MAXPOOL[self.ndim]
        e0 = torch.tanh(self.enc0(x))
        e1 = torch.tanh(self.enc1(pool(e0, 2)))
        b = torch.tanh(self.bottom(pool(e1, 2)))
        d1 = torch.tanh(self.dec1(torch.cat([upsample_nearest(b), e1], dim=1)))
        return self.dec0(torch.cat([upsample_nearest(d1), e0], dim=1))


def whole(net: nn.Module, x: np.ndarray) -> np.ndarray:
    """Whole-image forward pass of a ``(C, *spatial)`` array: the reference output."""
    with torch.inference_mode():
        return net(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None])[0].numpy()


def pad_end(x: np.ndarray, multiple: int) -> np.ndarray:
    """Zero-pad the spatial axes of ``(C, *spatial)`` at their end up to a multiple of ``multiple``."""
    pads = [(0, 0)] + [(0, -s % multiple) for s in x.shape[1:]]
    return np.pad(x, pads)


def measure_radius(
    net: nn.Module, ndim: int, c_in: int, *, alignment: int, size: int, all_phases: bool = True
) -> int:
    """Largest per-axis distance from a perturbed input voxel to an output voxel that changes.

    Impulses are placed at every phase of the stride grid (``alignment ** ndim`` positions near the
    centre of a random image of ``size ** ndim`` voxels), each with a small and a large positive and
    negative amplitude (a large one always wins a max-pooling window); the radius is the maximum over
    all of them, so it is the measured receptive-field radius, not the theoretical one.

    ``all_phases=False`` probes only the diagonal phases ``(p, p, ..., p)``: enough for networks built
    from separable-support layers (box convolutions, box poolings, nearest upsampling), whose reach
    along one axis depends only on the phase along that axis; it keeps the 3-D probe cheap.
    """
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((1, c_in, *([size] * ndim)), generator=gen)
    centre = size // 2 - size // 2 % alignment
    radius = 0
    with torch.inference_mode():
        base = net(x)
        phases = np.ndindex(*([alignment] * ndim)) if all_phases else [(p,) * ndim for p in range(alignment)]
        for phase in phases:
            q = tuple(centre + p for p in phase)
            for amp in (1.0, -1.0, 100.0, -100.0):
                xp = x.clone()
                xp[(0, slice(None), *q)] += amp
                changed = (net(xp) != base).any(dim=(0, 1)).nonzero()
                if changed.numel():
                    dist = (changed - torch.tensor(q)).abs().max()
                    radius = max(radius, int(dist))
    if radius >= size // 2 - alignment:
        raise AssertionError(f"probe image of size {size} too small for radius {radius}")
    return radius

"""Analytic networks: Gaussian, Sobel and Laplacian-of-Gaussian filters as exact conv nets.

Each is a stack of separable 1-D convolutions with zero padding, so it is translation-equivariant
with a known receptive field, and it equals its ``scipy.ndimage`` oracle with ``mode="constant"``
(up to float32 rounding):

- ``gaussian``: ``gaussian_filter(x, sigma, truncate=truncate, mode="constant")``;
- ``sobel``: ``sqrt(sum_a sobel(x, axis=a, mode="constant") ** 2)`` (unnormalized);
- ``log``: ``gaussian_laplace(x, sigma, truncate=truncate, mode="constant")``.

The 1-D kernels follow scipy's ``_gaussian_kernel1d``: radius ``int(truncate * sigma + 0.5)``
(8 for the default ``sigma=2.0, truncate=4.0``), weights normalized to sum 1 before the
derivative polynomial is applied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ANALYTIC_KINDS", "AnalyticNet", "analytic_radius", "gaussian_kernel1d"]

ANALYTIC_KINDS = ("gaussian", "sobel", "log")
#: Default parameters, documented in ``/v1/models`` under ``params``.
DEFAULT_SIGMA = 2.0
DEFAULT_TRUNCATE = 4.0


def gaussian_kernel1d(sigma: float, order: int, radius: int) -> npt.NDArray[np.float64]:
    """Sampled Gaussian (``order=0``) or its ``order``-th derivative, as scipy builds it.

    Returns:
        ``(2 * radius + 1,)`` float64 correlation weights (symmetric for even orders).
    """
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    sigma2 = sigma * sigma
    phi = np.exp(-0.5 / sigma2 * x**2)
    phi /= phi.sum()
    if order == 0:
        return phi
    exponents = np.arange(order + 1)
    q = np.zeros(order + 1)
    q[0] = 1.0
    d = np.diag(exponents[1:], 1)  # d @ q is q'(x)
    p = np.diag(np.ones(order) / -sigma2, -1)  # p @ q is q(x) * (-x / sigma2)
    for _ in range(order):
        q = (d + p) @ q
    weights: npt.NDArray[np.float64] = (x[:, None] ** exponents) @ q * phi
    # scipy correlates with the reversed kernel (a convolution); odd orders flip sign.
    return weights[::-1].copy()


def analytic_radius(kind: str, sigma: float = DEFAULT_SIGMA, truncate: float = DEFAULT_TRUNCATE) -> int:
    """Receptive-field radius (voxels, every axis) of an analytic network."""
    if kind == "sobel":
        return 1
    return int(truncate * float(sigma) + 0.5)


class AnalyticNet(nn.Module):
    """An analytic filter over ``spatial_dims`` axes; input and output ``(B, 1, *spatial)`` float32.

    Args:
        kind: ``gaussian``, ``sobel`` or ``log``.
        spatial_dims: 1, 2 or 3.
        sigma: Gaussian standard deviation in voxels (``gaussian``, ``log``).
        truncate: kernel radius in standard deviations (``gaussian``, ``log``).
    """

    smooth: torch.Tensor
    deriv: torch.Tensor

    def __init__(
        self,
        kind: str,
        spatial_dims: int,
        *,
        sigma: float = DEFAULT_SIGMA,
        truncate: float = DEFAULT_TRUNCATE,
    ) -> None:
        super().__init__()
        if kind not in ANALYTIC_KINDS:
            raise ValueError(f"kind must be one of {list(ANALYTIC_KINDS)}, got {kind!r}")
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"spatial_dims must be 1, 2 or 3, got {spatial_dims}")
        if sigma <= 0 or truncate <= 0:
            raise ValueError(f"sigma and truncate must be > 0, got sigma={sigma}, truncate={truncate}")
        self.kind = kind
        self.spatial_dims = spatial_dims
        self.radius = analytic_radius(kind, sigma, truncate)
        if kind == "sobel":
            smooth = np.array([1.0, 2.0, 1.0])
            deriv = np.array([-1.0, 0.0, 1.0])
        else:
            smooth = gaussian_kernel1d(sigma, 0, self.radius)
            deriv = gaussian_kernel1d(sigma, 2, self.radius)
        self.register_buffer("smooth", torch.tensor(smooth, dtype=torch.float32))
        self.register_buffer("deriv", torch.tensor(deriv, dtype=torch.float32))

    def _conv1d(self, x: torch.Tensor, weights: torch.Tensor, axis: int) -> torch.Tensor:
        shape = [1, 1] + [1] * self.spatial_dims
        shape[2 + axis] = weights.numel()
        padding = [0] * self.spatial_dims
        padding[axis] = weights.numel() // 2
        conv: Any = (F.conv1d, F.conv2d, F.conv3d)[self.spatial_dims - 1]
        out: torch.Tensor = conv(x, weights.reshape(shape), padding=tuple(padding))
        return out

    def _separable(self, x: torch.Tensor, special_axis: int | None) -> torch.Tensor:
        for axis in range(self.spatial_dims):
            weights = self.deriv if axis == special_axis else self.smooth
            x = self._conv1d(x, weights, axis)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Filter a batch ``(B, 1, *spatial)``; returns ``(B, 1, *spatial)`` float32."""
        if x.ndim != self.spatial_dims + 2 or x.shape[1] != 1:
            raise ValueError(f"expected (B, 1, *spatial) with {self.spatial_dims} axes, got {tuple(x.shape)}")
        x = x.float()
        if self.kind == "gaussian":
            return self._separable(x, None)
        parts = [self._separable(x, axis) for axis in range(self.spatial_dims)]
        if self.kind == "log":
            return torch.stack(parts).sum(0)
        return torch.sqrt(torch.stack([p * p for p in parts]).sum(0))

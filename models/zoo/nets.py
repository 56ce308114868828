"""Architectures in code for the eager backend, looked up by name (or ``package.module:callable``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.errors import SpecError

__all__ = ["ARCHITECTURES", "UNet", "build_architecture"]

_CONV: dict[int, Any] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONVT: dict[int, Any] = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_BATCH: dict[int, Any] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_INSTANCE: dict[int, Any] = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


def _norm(kind: str, spatial_dims: int, channels: int) -> nn.Module:
    if kind == "batch":
        return _BATCH[spatial_dims](channels)  # type: ignore[no-any-return]
    if kind == "instance":
        return _INSTANCE[spatial_dims](channels, affine=True)  # type: ignore[no-any-return]
    if kind == "group":
        return nn.GroupNorm(min(4, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be batch, instance, group or none, got {kind!r}")


class UNet(nn.Module):
    """A small U-Net for 1-D, 2-D or 3-D inputs ``(B, in_channels, *spatial)``.

    Each level has two conv-norm-ReLU blocks (kernel 3, zero padding); downsampling is a stride-2
    convolution and upsampling a stride-2 transposed convolution, so spatial sizes must be
    multiples of ``2 ** levels`` (the model's alignment). With ``norm="batch"`` (eval mode) or
    ``"none"`` it is translation-equivariant on its stride grid; ``instance`` and ``group`` norms
    make it tile-dependent.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        *,
        features: int = 8,
        levels: int = 2,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        conv, convt = _CONV[spatial_dims], _CONVT[spatial_dims]

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                conv(c_in, c_out, 3, padding=1),
                _norm(norm, spatial_dims, c_out),
                nn.ReLU(inplace=True),
                conv(c_out, c_out, 3, padding=1),
                _norm(norm, spatial_dims, c_out),
                nn.ReLU(inplace=True),
            )

        widths = [features * 2**i for i in range(levels + 1)]
        self.enc = nn.ModuleList([block(in_channels, widths[0])])
        self.down = nn.ModuleList()
        for i in range(levels):
            self.down.append(conv(widths[i], widths[i], 3, stride=2, padding=1))
            self.enc.append(block(widths[i], widths[i + 1]))
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in reversed(range(levels)):
            self.up.append(convt(widths[i + 1], widths[i], 2, stride=2))
            self.dec.append(block(2 * widths[i], widths[i]))
        self.head = conv(widths[0], out_channels, 1)
        self.alignment = 2**levels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, *spatial)`` -> ``(B, out_channels, *spatial)`` logits."""
        skips = []
        x = self.enc[0](x)
        for down, enc in zip(self.down, self.enc[1:], strict=True):
            skips.append(x)
            x = enc(down(x))
        for up, dec in zip(self.up, self.dec, strict=True):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        out: torch.Tensor = self.head(x)
        return out


#: Named architectures: builder(spatial_dims, in_channels, out_channels, **params) -> nn.Module.
ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {"unet": UNet}


def build_architecture(
    name: str, spatial_dims: int, in_channels: int, out_channels: int, params: dict[str, Any], where: str
) -> nn.Module:
    """Build an architecture from its name or ``package.module:callable`` path.

    Raises:
        SpecError: unknown name, unimportable path, or parameters the builder rejects.
    """
    if name in ARCHITECTURES:
        builder = ARCHITECTURES[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            builder = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise SpecError(f"{where}: field 'architecture' {name!r} cannot be imported: {exc}") from exc
    else:
        raise SpecError(
            f"{where}: field 'architecture' {name!r} is unknown "
            f"(known: {', '.join(ARCHITECTURES)}, or 'package.module:callable')"
        )
    try:
        return builder(spatial_dims, in_channels, out_channels, **params)
    except TypeError as exc:
        raise SpecError(f"{where}: field 'params' does not fit architecture {name!r}: {exc}") from exc

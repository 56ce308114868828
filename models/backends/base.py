"""The :class:`Predictor` protocol and the device handling shared by every backend."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from models.errors import InputError
from models.spec import ModelSpec

__all__ = ["BasePredictor", "PoolingContext", "Predictor", "resolve_device"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Predictor(Protocol):
    """A callable mapping ``(B, C_in, *tile)`` float32 to ``(B, C_out, *(tile * scale))`` float32.

    Metadata: ``spatial_dims``, ``in_channels``, ``out_channels``, ``alignment`` (total stride),
    ``scale``, ``receptive_field`` (radius per axis in voxels, or ``None`` when unknown),
    ``tile_shape`` (preferred), ``dtype`` and ``device``.
    """

    spatial_dims: int
    in_channels: int
    out_channels: int
    alignment: int
    scale: int
    receptive_field: tuple[int, ...] | None
    tile_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """Run one batch ``(B, C_in, *tile)``; returns ``(B, C_out, *(tile * scale))``."""
        ...


@runtime_checkable
class PoolingContext(Protocol):
    """A predictor whose global pools can read whole-image statistics instead of the tile's own.

    :meth:`prepare_context` computes the statistics of a preprocessed ``(C_in, *spatial)`` image
    (tile by tile with ``tile`` and ``halo``, or in one pass when ``tile`` is ``None``); every call
    of the predictor then uses them until :meth:`clear_context`. :meth:`frozen_context` does both
    around a block; :meth:`logit_view` is a predictor of the pre-activation output (for probes).
    """

    def prepare_context(
        self, x: Any, *, tile: Sequence[int] | None, halo: Sequence[int] | None, batch_size: int = 1
    ) -> Mapping[str, Any]:
        """Compute and hold the whole-image statistics of ``x``."""
        ...

    def clear_context(self) -> None:
        """Forget them (tiles pool over themselves again)."""
        ...

    def frozen_context(self, x: Any) -> AbstractContextManager[None]:
        """Hold the statistics of ``x`` (one whole pass) within a ``with`` block."""
        ...

    def logit_view(self) -> Any:
        """A predictor returning the pre-activation output (same metadata)."""
        ...


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` or ``"auto"`` picks CUDA when available, else CPU; anything else is parsed as is."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class BasePredictor:
    """Metadata from a spec, input checks and host/device transfers for every backend.

    A batch may arrive on any device. On CUDA, a CPU batch is copied through pinned memory with
    ``non_blocking=True``; the output returns to the batch's device (through pinned memory too).
    Subclasses implement :meth:`_forward` on a batch already on :attr:`device`.
    """

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.name = spec.name
        self.spatial_dims = spec.spatial_dims
        self.in_channels = spec.in_channels
        self.out_channels = spec.out_channels
        self.alignment = spec.alignment_lcm  # a size divisor of every axis (probes)
        self.scale = spec.scale
        self.receptive_field = spec.receptive_field
        self.tile_shape = spec.defaults.tile
        self.dtype = torch.float32
        self.device = device
        self.backend = spec.backend.value

    def describe(self) -> dict[str, Any]:
        """Backend and device facts for logs and ``/readyz``."""
        return {"backend": self.backend, "device": str(self.device)}

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(dtype=torch.float32)
        if batch.device == self.device:
            return batch.contiguous()
        if self.device.type == "cuda" and batch.device.type == "cpu":
            return batch.contiguous().pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

    def _from_device(self, out: torch.Tensor, target: torch.device) -> torch.Tensor:
        out = out.float()
        if out.device == target:
            return out
        if out.device.type == "cuda" and target.type == "cpu":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            torch.cuda.current_stream(out.device).synchronize()
            return host
        return out.to(target)

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """Run one batch ``(B, C_in, *tile)``; returns ``(B, C_out, *(tile * scale))`` float32.

        Raises:
            InputError: the batch has the wrong number of axes or channels.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
        """
        if not isinstance(batch, torch.Tensor):
            batch = torch.as_tensor(batch)
        if batch.ndim != self.spatial_dims + 2 or batch.shape[1] != self.in_channels:
            raise InputError(
                f"model {self.name!r} takes batches (B, {self.in_channels}, *tile) with "
                f"{self.spatial_dims} spatial axes, got {tuple(batch.shape)}"
            )
        out = self._forward(self._to_device(batch))
        return self._from_device(out, batch.device)

    def close(self) -> None:
        """Release the session or module (a no-op for most backends)."""

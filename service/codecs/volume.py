"""The decoded form of an input file: voxels in ``(C, *spatial)`` plus what encoding needs back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.params import OutputFormat

__all__ = ["OUTPUT_FORMATS", "DecodedVolume"]

#: Every output format :func:`service.codecs.encode` writes, with its file suffix.
OUTPUT_FORMATS: dict[str, str] = {f.value: f.suffix for f in OutputFormat}


@dataclass(frozen=True, slots=True)
class DecodedVolume:
    """An input image or volume, ready for a model, with the geometry its output must keep.

    Attributes:
        data: voxels as ``(C, *spatial)``, native byte order. A grey 2D image is ``(1, H, W)``,
            RGB ``(3, H, W)``; a NIfTI ``(X, Y, Z)`` is ``(1, X, Y, Z)``, and a 4D NIfTI
            ``(X, Y, Z, T)`` is ``(T, X, Y, Z)``. A NIfTI always has three spatial axes here
            (``Z`` may be 1: see :attr:`single_slice`). NIfTI intensity scaling is applied
            (float32 then); otherwise the stored dtype is kept.
        kind: ``"nifti"``, ``"png"``, ``"jpeg"`` or ``"tiff"``.
        header: the NIfTI header (a copy) for ``kind == "nifti"``, else ``None``.
        affine: the NIfTI best affine (4x4) for ``kind == "nifti"``, else ``None``.
        nifti_ndim: number of dimensions the NIfTI stored (2, 3 or 4), else 0.
        info: image metadata kept for the output (``dpi``; ``mode`` and ``source`` for logs).
    """

    data: np.ndarray
    kind: str
    header: Any = None
    affine: np.ndarray | None = None
    nifti_ndim: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def spatial_shape(self) -> tuple[int, ...]:
        """The spatial shape (everything after the channel axis)."""
        return tuple(int(n) for n in self.data.shape[1:])

    @property
    def spatial_dims(self) -> int:
        """Number of spatial axes of :attr:`data` (2 for pictures, 3 for NIfTI and TIFF stacks)."""
        return self.data.ndim - 1

    @property
    def channels(self) -> int:
        """Number of channels of :attr:`data`."""
        return int(self.data.shape[0])

    @property
    def single_slice(self) -> bool:
        """A NIfTI of one slice ``(X, Y, 1)``: an image for 2D models, a thin volume for 3D ones."""
        return self.kind == "nifti" and self.data.shape[-1] == 1

    @property
    def is_volume(self) -> bool:
        """Whether the default output format is NIfTI (the input was a NIfTI)."""
        return self.kind == "nifti"

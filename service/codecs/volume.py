"""What an input file is: :class:`Probe` from its header alone, :class:`DecodedVolume` once read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.planning.params import OutputFormat
from service.errors import PayloadTooLargeError, UnusableInputError

__all__ = ["OUTPUT_FORMATS", "DecodedVolume", "Probe"]

#: Every output format :func:`service.codecs.encode` writes, with its file suffix.
OUTPUT_FORMATS: dict[str, str] = {f.value: f.suffix for f in OutputFormat}
#: Kinds decoded with a NIfTI geometry (affine and header).
_VOLUME_KINDS = ("nifti", "dicom")


@dataclass(frozen=True, slots=True)
class DecodedVolume:
    """An input image or volume, ready for a model, with the geometry its output must keep.

    Attributes:
        data: voxels as ``(C, *spatial)``, native byte order. A grey 2D image is ``(1, H, W)``,
            RGB ``(3, H, W)``; a NIfTI ``(X, Y, Z)`` is ``(1, X, Y, Z)``, and a 4D NIfTI
            ``(X, Y, Z, T)`` is ``(T, X, Y, Z)``. A NIfTI volume has three spatial axes (``Z`` may
            be 1: see :attr:`single_slice`); a true 2D NIfTI ``(X, Y)`` has two, ``(1, X, Y)``.
            NIfTI intensity scaling is applied (float32 then); otherwise the stored dtype is kept.
        kind: ``"nifti"``, ``"png"``, ``"jpeg"``, ``"tiff"`` or ``"dicom"`` (a series, decoded as a
            NIfTI volume ``(1, X, Y, Z)`` would be: :mod:`service.codecs.dicom`).
        header: the NIfTI header (a copy) for ``kind == "nifti"``, one made from the series'
            RAS affine for ``"dicom"``, else ``None``.
        affine: the NIfTI best affine (4x4) for ``kind == "nifti"``, the series' RAS affine for
            ``"dicom"``, else ``None``.
        nifti_ndim: number of dimensions the NIfTI stored (``dim[0]``: 2 to 7), else 0.
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
        return self.kind in _VOLUME_KINDS and self.spatial_dims == 3 and self.data.shape[-1] == 1

    @property
    def is_volume(self) -> bool:
        """Whether the default output format is NIfTI (the input was a NIfTI or a DICOM series)."""
        return self.kind in _VOLUME_KINDS


@dataclass(frozen=True, slots=True)
class Probe:
    """What a file declares in its header, read without decoding a voxel (:func:`service.codecs.probe`).

    Attributes:
        kind: ``"nifti"``, ``"png"``, ``"jpeg"`` or ``"tiff"``.
        spatial_shape: the spatial shape :meth:`service.codecs.decode` will return: ``(H, W)`` for
            a picture (display orientation, EXIF applied), ``(pages, H, W)`` for a TIFF stack,
            ``(X, Y, Z)`` for a NIfTI volume (``Z`` may be 1) and ``(X, Y)`` for a true 2D NIfTI.
        channels: channels the decoded array will have (alpha dropped, palette as RGB).
        dtype: the decoded dtype (NIfTI with scaling, and float64, give float32).
        nbytes: bytes the decoder inflates or reads: the samples as stored (alpha included), plus
            the header for NIfTI; for a ``.nii.gz``, its size once decompressed.
        info: format details (``nifti_version``, ``shape``, ``bit_depth``, ``reader`` ...).
    """

    kind: str
    spatial_shape: tuple[int, ...]
    channels: int
    dtype: np.dtype
    nbytes: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def format_name(self) -> str:
        """The format as people write it: ``NIfTI``, ``PNG``, ``JPEG``, ``TIFF``."""
        return {"nifti": "NIfTI", "dicom": "DICOM series"}.get(self.kind, self.kind.upper())

    @property
    def spatial_dims(self) -> int:
        """2 for pictures and 2D NIfTI, 3 for NIfTI volumes and TIFF stacks."""
        return len(self.spatial_shape)

    @property
    def is_3d(self) -> bool:
        """Whether the input is a volume (a one-slice NIfTI ``(X, Y, 1)`` included)."""
        return self.spatial_dims == 3

    @property
    def single_slice(self) -> bool:
        """A NIfTI volume of one slice ``(X, Y, 1)``: also an image for 2D models."""
        return self.kind in _VOLUME_KINDS and self.is_3d and self.spatial_shape[-1] == 1

    @property
    def voxels(self) -> int:
        """Voxels (pixels for pictures) times channels: what ``max_voxels`` bounds."""
        return math.prod(self.spatial_shape) * self.channels

    def check_limits(
        self,
        *,
        max_voxels: int | None = None,
        max_image_pixels: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Refuse what the header declares beyond the limits, before anything is decoded.

        Args:
            max_voxels: voxels times channels (``TILEWISE_MAX_VOXELS``).
            max_image_pixels: pixels of one plane of a picture or TIFF page, ``H * W``
                (``TILEWISE_MAX_IMAGE_PIXELS``, the decompression-bomb limit); not for NIfTI.
            max_bytes: :attr:`nbytes`, the bytes once decompressed (the server passes its upload
                limit, so that compression is no way around it).

        Raises:
            PayloadTooLargeError: naming the limit and the declared figure.
        """
        shape, kind = "x".join(str(n) for n in self.spatial_shape), self.format_name
        if max_image_pixels is not None and self.kind not in _VOLUME_KINDS:
            pixels = self.spatial_shape[-1] * self.spatial_shape[-2]
            if pixels > max_image_pixels:
                raise PayloadTooLargeError(
                    f"{kind} of {shape} pixels: {pixels} pixels per plane exceeds "
                    f"max_image_pixels={max_image_pixels}"
                )
        if max_voxels is not None and self.voxels > max_voxels:
            raise PayloadTooLargeError(
                f"{kind} of shape {shape} with {self.channels} channel(s) declares "
                f"{self.voxels} voxels; the limit is max_voxels={max_voxels}"
            )
        if max_bytes is not None and self.nbytes > max_bytes:
            raise PayloadTooLargeError(
                f"{kind} of shape {shape} declares {self.nbytes} bytes once decompressed; "
                f"the limit is max_bytes={max_bytes}"
            )

    def check_model(
        self, spatial_dims: int, model: str | None = None, in_channels: int | None = None
    ) -> None:
        """Refuse an input whose dimensionality the model cannot take (DESIGN "Interfaces in detail").

        A 2D model takes pictures, 2D NIfTI and one-slice NIfTI volumes ``(X, Y, 1)``; a 3D model
        takes volumes (one-slice ones included) and refuses every 2D array. A NIfTI with several
        volumes ``(X, Y, Z, T)`` needs a model of ``T`` input channels.

        Args:
            spatial_dims: the model's spatial axes (its spec's ``spatial_dims``).
            model: the model's name, for the message.
            in_channels: the model's input channels; checked for multi-volume NIfTI when given.

        Raises:
            UnusableInputError: the 422 the pipeline would give after decoding, given from the header.
        """
        shape = tuple(self.spatial_shape)
        model = f"model {model!r}" if model else "the model"
        if spatial_dims == 3 and not self.is_3d:
            raise UnusableInputError(
                f"{model} is 3D; the input is a 2D {self.format_name} image of shape {shape} "
                "(send a volume, or a NIfTI (X, Y, 1) for a one-slice volume)"
            )
        if spatial_dims == 2 and self.is_3d and not self.single_slice:
            raise UnusableInputError(
                f"{model} is 2D; the input is a 3D volume of spatial shape {shape} "
                "(a NIfTI with one slice, (X, Y, 1), would be an image)"
            )
        if spatial_dims not in (2, 3):
            raise UnusableInputError(
                f"{model} has {spatial_dims} spatial axes; the input has {self.spatial_dims}"
            )
        if (
            self.kind == "nifti"
            and self.channels > 1
            and in_channels is not None
            and self.channels != in_channels
        ):
            raise UnusableInputError(
                f"NIfTI with {self.channels} volumes (shape {self.info.get('shape')}); {model} takes "
                f"{in_channels} channel(s)"
            )

"""Input decoding and output encoding, shared by the server and ``tilewise infer``.

Formats are detected by content (:mod:`service.sniff`), never by file name:
NIfTI-1 / NIfTI-2 (``.nii``, ``.nii.gz``), PNG, JPEG and TIFF. Outputs are written as ``nii.gz``,
``nii``, ``png``, ``tiff`` or ``npy``, keeping the input's grid (and NIfTI geometry).

Imports numpy, nibabel, Pillow and tifffile; never torch or FastAPI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.codecs.images import configure_pillow, decode_image, encode_npy, encode_png, encode_tiff
from service.codecs.nifti import decode_nifti, encode_nifti
from service.codecs.volume import OUTPUT_FORMATS, DecodedVolume
from service.errors import BadParameterError, EmptyBodyError, UnsupportedMediaTypeError
from service.sniff import KINDS, Sniffed, sniff

__all__ = [
    "KINDS",
    "OUTPUT_FORMATS",
    "DecodedVolume",
    "Sniffed",
    "check_format",
    "configure_pillow",
    "decode",
    "default_format",
    "encode",
    "sniff",
]

logger = logging.getLogger(__name__)

_ENCODERS: dict[str, Callable[[DecodedVolume, np.ndarray, Path], None]] = {
    "nii.gz": encode_nifti,
    "nii": encode_nifti,
    "png": encode_png,
    "tiff": encode_tiff,
    "npy": encode_npy,
}


def decode(
    path: str | Path, *, max_voxels: int | None = None, max_image_pixels: int | None = None
) -> DecodedVolume:
    """Read an image or volume, detecting its format by content.

    Args:
        path: the file (its name and suffix are ignored).
        max_voxels: refuse images with more voxels (checked from the header, before decoding).
        max_image_pixels: refuse 2D images with more pixels (decompression-bomb limit).

    Raises:
        EmptyBodyError: the file is empty.
        UnsupportedMediaTypeError: the content is no supported format.
        PayloadTooLargeError: beyond ``max_voxels`` / ``max_image_pixels``.
        DecodeError: a recognized but corrupt or truncated file.
        UnusableInputError: a readable file tilewise cannot represent (e.g. complex NIfTI).
    """
    path = Path(path)
    if path.stat().st_size == 0:
        raise EmptyBodyError("the input is empty (0 bytes)")
    sniffed = sniff(path)
    if sniffed is None:
        raise UnsupportedMediaTypeError(
            "unrecognized content: expected NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG or TIFF"
        )
    if sniffed.kind == "nifti":
        return decode_nifti(path, sniffed, max_voxels=max_voxels)
    return decode_image(path, sniffed, max_voxels=max_voxels, max_image_pixels=max_image_pixels)


def default_format(volume: DecodedVolume, output: str) -> str:
    """The output format when none is asked for: NIfTI in, ``nii.gz`` out; otherwise ``png``
    for ``output="labels"`` and ``tiff`` (float32) for ``"probabilities"``."""
    if volume.kind == "nifti":
        return "nii.gz"
    return "png" if output == "labels" else "tiff"


def check_format(fmt: str) -> str:
    """Validate an output format name.

    Raises:
        BadParameterError: ``fmt`` is not one of :data:`OUTPUT_FORMATS`.
    """
    if fmt not in OUTPUT_FORMATS:
        raise BadParameterError(f"format={fmt!r} is not one of {list(OUTPUT_FORMATS)}")
    return fmt


def encode(volume: DecodedVolume, array: np.ndarray, fmt: str, path: str | Path) -> Path:
    """Write a model output on ``volume``'s grid to ``path`` in format ``fmt``.

    Args:
        volume: the decoded input (its geometry and metadata are kept).
        array: ``(*spatial)`` uint8 labels or ``(C, *spatial)`` float32 values, where
            ``spatial == volume.spatial_shape``.
        fmt: one of :data:`OUTPUT_FORMATS`.
        path: where to write; used as given (the caller picks the suffix, ``OUTPUT_FORMATS[fmt]``
            for nibabel's gzip detection).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        BadParameterError: an unknown format, or one that cannot hold this output.
    """
    check_format(fmt)
    spatial = tuple(array.shape[-volume.spatial_dims :])
    if spatial != volume.spatial_shape or array.ndim not in (volume.spatial_dims, volume.spatial_dims + 1):
        raise ValueError(f"output shape {array.shape} does not fit the input grid {volume.spatial_shape}")
    path = Path(path)
    if fmt.startswith("nii") and not path.name.endswith(OUTPUT_FORMATS[fmt]):
        raise ValueError(f"format={fmt} needs a path ending in {OUTPUT_FORMATS[fmt]}, got {path.name}")
    _ENCODERS[fmt](volume, array, path)
    logger.info("encoded %s shape=%s dtype=%s", fmt, array.shape, array.dtype)
    return path

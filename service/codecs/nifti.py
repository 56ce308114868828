"""NIfTI-1 / NIfTI-2 (``.nii``, ``.nii.gz``) reading and writing with nibabel.

Reading checks the voxel count from the header before any voxel is read, applies
``scl_slope`` / ``scl_inter``, and returns native-byte-order data. Writing copies the input header,
so the affine, qform and sform with their codes, zooms, units and orientation are bit-identical;
only the data type, shape and scaling (reset) change.
"""

from __future__ import annotations

import gzip
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError

from service.codecs.volume import DecodedVolume
from service.errors import DecodeError, PayloadTooLargeError, UnusableInputError
from service.sniff import Sniffed

__all__ = ["decode_nifti", "encode_nifti"]

logger = logging.getLogger(__name__)

# Errors nibabel, gzip and numpy raise on corrupt or truncated files.
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, ImageFileError)


def _image_class(version: int) -> Any:
    return nib.Nifti2Image if version == 2 else nib.Nifti1Image


def _layout(shape: tuple[int, ...]) -> tuple[tuple[int, int, int], int]:
    """Spatial shape ``(X, Y, Z)`` and channel count of a NIfTI of ``shape``.

    Raises:
        UnusableInputError: beyond 3 spatial axes plus one non-singleton channel axis.
    """
    dims = list(shape)
    while len(dims) > 3 and dims[-1] == 1:  # (X, Y, Z, 1) is a plain volume
        dims.pop()
    if len(dims) == 5 and dims[3] == 1:  # (X, Y, Z, 1, C): NIfTI's vector-valued layout
        dims.pop(3)
    if len(dims) < 2 or len(dims) > 4:
        raise UnusableInputError(f"NIfTI of shape {tuple(shape)} is not an image or volume (2 to 4 axes)")
    spatial = (dims + [1, 1])[:3]
    channels = dims[3] if len(dims) == 4 else 1
    return (spatial[0], spatial[1], spatial[2]), channels


def decode_nifti(path: Path, sniffed: Sniffed, *, max_voxels: int | None = None) -> DecodedVolume:
    """Read a single-file NIfTI into a :class:`DecodedVolume` of shape ``(C, X, Y, Z)``.

    Raises:
        PayloadTooLargeError: the header declares more than ``max_voxels`` voxels.
        UnusableInputError: a shape or data type tilewise cannot run (complex, RGB24, 5D ...).
        DecodeError: a corrupt or truncated file.
    """
    if sniffed.nifti_version not in (1, 2):
        raise DecodeError("truncated or corrupt gzip stream: no NIfTI header can be read from it")
    opener = gzip.open if sniffed.gzipped else open
    try:
        with opener(path, "rb") as fh:
            img = _image_class(sniffed.nifti_version).from_stream(fh)
            shape = tuple(int(n) for n in img.shape)
            n_voxels = math.prod(shape)
            if max_voxels is not None and n_voxels > max_voxels:
                raise PayloadTooLargeError(
                    f"NIfTI of shape {shape} has {n_voxels} voxels; the limit is max_voxels={max_voxels}"
                )
            spatial, channels = _layout(shape)
            stored = img.header.get_data_dtype()
            if stored.fields is not None or stored.kind not in "biuf":
                raise UnusableInputError(f"NIfTI data type {stored} is not a real-valued type")
            data = np.asanyarray(img.dataobj)
    except (PayloadTooLargeError, UnusableInputError):
        raise
    except _READ_ERRORS as exc:
        raise DecodeError(f"corrupt or truncated NIfTI-{sniffed.nifti_version} file: {exc}") from exc
    if data.dtype.kind == "f" and data.dtype != np.float32:
        data = data.astype(np.float32)
    if not data.dtype.isnative:
        data = data.astype(data.dtype.newbyteorder("="))
    data = data.reshape(*spatial, channels)
    data = data[..., 0][None] if channels == 1 else np.ascontiguousarray(np.moveaxis(data, -1, 0))
    header = img.header.copy()
    logger.info(
        "decoded NIfTI-%d shape=%s dtype=%s->%s qform_code=%d sform_code=%d",
        sniffed.nifti_version,
        shape,
        stored,
        data.dtype,
        int(header["qform_code"]),
        int(header["sform_code"]),
    )
    return DecodedVolume(
        data=data,
        kind="nifti",
        header=header,
        affine=np.asarray(img.affine),
        nifti_ndim=len(shape),
        info={"nifti_version": sniffed.nifti_version, "shape": shape},
    )


def _to_nifti_layout(array: np.ndarray, spatial_dims: int) -> np.ndarray:
    """``(*spatial)`` labels or ``(C, *spatial)`` values to NIfTI's ``(*spatial[, C])``."""
    if array.ndim == spatial_dims:
        return array
    if array.shape[0] == 1:
        return np.asarray(array[0])
    return np.moveaxis(array, 0, -1)


def encode_nifti(volume: DecodedVolume, array: np.ndarray, path: Path) -> None:
    """Write ``array`` (the model output on ``volume``'s grid) as NIfTI; the suffix picks gzip.

    A NIfTI input's header is copied (geometry bit-identical; data type from ``array``, scaling
    reset, display range cleared). Other inputs get an identity affine with both codes 0.
    """
    spatial_dims = volume.spatial_dims
    out = _to_nifti_layout(array, spatial_dims)
    if volume.kind != "nifti" or volume.header is None:
        nib.save(nib.Nifti1Image(out, np.eye(4)), str(path))  # type: ignore[no-untyped-call]
        return
    if volume.nifti_ndim == 2 and out.ndim == 3 and out.shape[2] == 1:
        out = out[:, :, 0]  # give a 2D NIfTI back as 2D
    header = volume.header.copy()
    header.set_data_dtype(out.dtype)
    header.set_slope_inter(1.0, 0.0)  # written as "no scaling" (NaN) for float and uint8 output
    header["cal_min"] = 0.0
    header["cal_max"] = 0.0
    image = _image_class(int(volume.info.get("nifti_version", 1)))(out, None, header=header)
    nib.save(image, str(path))

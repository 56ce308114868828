"""Input decoding and output encoding, shared by the server and ``tilewise infer``.

Formats are detected by content (:mod:`service.sniff`), never by file name:
NIfTI-1 / NIfTI-2 (``.nii``, ``.nii.gz``), PNG, JPEG and TIFF; a DICOM series (a folder, a
``.zip``, one file or one enhanced multi-frame object: :mod:`service.codecs.dicom`, the ``dicom``
extra). Outputs are written as ``nii.gz``, ``nii``, ``png``, ``tiff``, ``npy``, ``ome.tiff``,
``ome.zarr`` and ``geojson`` (2D) or ``dicom-seg`` (DICOM input only), keeping the input's grid
(and NIfTI geometry).

Two steps, so that nothing large is decoded to find out that it should not have been:

- :func:`probe` reads the header only (NIfTI header, PNG ``IHDR``, Pillow's lazy open, tifffile's
  page shapes) and returns a :class:`Probe`: spatial shape, channels, dtype, whether it is 3D,
  bytes once decompressed. :meth:`Probe.check_limits` and :meth:`Probe.check_model` refuse a file
  that is too large or of the wrong dimensionality for a model from that header alone.
- :func:`decode` probes, checks the limits, then reads the voxels.

Error details name the input as "the input", never by its path on the server.

Imports numpy, nibabel, Pillow and tifffile (imagecodecs for 16-bit colour PNG); never torch or
FastAPI.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.codecs.dicom_seg import encode_dicom_seg
from service.codecs.image_encode import encode_geojson, encode_ome_tiff, encode_ome_zarr
from service.codecs.images import (
    configure_pillow,
    decode_image,
    encode_npy,
    encode_png,
    encode_tiff,
    probe_image,
)
from service.codecs.nifti import decode_nifti, encode_nifti, probe_nifti
from service.codecs.volume import OUTPUT_FORMATS, DecodedVolume, Probe
from service.errors import BadParameterError, EmptyBodyError, ServiceError, UnsupportedMediaTypeError
from service.sniff import DICOM_ADVICE, KINDS, Sniffed, sniff

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "KINDS",
    "OUTPUT_FORMATS",
    "DecodedVolume",
    "Probe",
    "Sniffed",
    "check_format",
    "configure_pillow",
    "decode",
    "default_format",
    "encode",
    "probe",
    "sniff",
]

logger = logging.getLogger(__name__)

_ENCODERS: dict[str, Callable[..., None]] = {
    "nii.gz": encode_nifti,
    "nii": encode_nifti,
    "png": encode_png,
    "tiff": encode_tiff,
    "npy": encode_npy,
    "dicom-seg": encode_dicom_seg,
    "ome.tiff": encode_ome_tiff,
    "geojson": encode_geojson,
    "ome.zarr": encode_ome_zarr,
}
# Absolute paths (two components or more) that a foreign library put into its message.
_PATH_RE = re.compile(r"(?<![\w.])/(?:[^\s/'\"<>:]+/)+[^\s/'\"<>:,)]*")


def _scrub(message: str, path: Path) -> str:
    """``message`` without the server's file paths (the input's, or any other absolute one)."""
    for known in sorted({str(path), str(path.resolve()), str(path.parent)}, key=len, reverse=True):
        message = message.replace(known, "the input")
    return _PATH_RE.sub("<path>", message)


def _dicom_options(dicom: Mapping[str, Any] | None) -> dict[str, Any]:
    """``series`` and ``tilt`` for the DICOM reader (enum values as strings)."""
    dicom = dicom or {}
    tilt = dicom.get("tilt")
    return {"series": dicom.get("series"), "tilt": None if tilt is None else str(tilt)}


def _is_dicom(path: Path) -> bool:
    """A folder, a zip or a DICOM file: read as a DICOM series (when the ``dicom`` extra is
    installed; else a DICOM file is refused with advice, 415)."""
    if not path.is_dir() and path.stat().st_size == 0:
        return False
    try:
        import pydicom  # noqa: F401

        from service.codecs.dicom_files import is_dicom_source
    except ImportError:
        if path.is_dir():
            raise UnsupportedMediaTypeError(f"a folder is a DICOM series. {DICOM_ADVICE}") from None
        return False
    return is_dicom_source(path)


def _sniffed(path: Path) -> Sniffed:
    """The detected format of a readable input.

    Raises:
        EmptyBodyError: the file is empty.
        UnsupportedMediaTypeError: not a format tilewise reads (DICOM: with what to do instead).
    """
    if path.stat().st_size == 0:
        raise EmptyBodyError("the input is empty (0 bytes)")
    sniffed = sniff(path)
    if sniffed is None:
        raise UnsupportedMediaTypeError(
            "unrecognized content: expected NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG or TIFF"
        )
    if sniffed.kind == "dicom":
        raise UnsupportedMediaTypeError(f"the input is a DICOM file. {DICOM_ADVICE}")
    return sniffed


def probe(path: str | Path, *, dicom: Mapping[str, Any] | None = None, max_bytes: int | None = None) -> Probe:
    """What the file at ``path`` declares, from its header alone: no voxel is decoded.

    Costs a few hundred bytes of reading for NIfTI (inflated from the start of a ``.nii.gz``) and
    PNG, Pillow's lazy open for JPEG, and tifffile's page index for TIFF.

    Returns:
        a :class:`Probe` (``spatial_shape``, ``channels``, ``dtype``, ``is_3d``, ``nbytes`` ...); call
        its ``check_limits(max_voxels=..., max_image_pixels=..., max_bytes=...)`` and
        ``check_model(spatial_dims, model_name)`` to refuse the request before decoding.

    Raises:
        EmptyBodyError: the file is empty.
        UnsupportedMediaTypeError: not a supported format (DICOM included).
        DecodeError: a corrupt or truncated header, or an axis of length 0.
        UnusableInputError: a readable header tilewise cannot run (complex NIfTI, 5D TIFF ...).
    """
    path = Path(path)
    try:
        if _is_dicom(path):
            from service.codecs.dicom import probe_dicom
            from service.slides import probe_dicom_wsi

            wsi = probe_dicom_wsi(path)  # a whole-slide image: read by level and region (OpenSlide)
            if wsi is not None:
                return wsi

            return probe_dicom(path, max_bytes=max_bytes, **_dicom_options(dicom))
        sniffed = _sniffed(path)
        if sniffed.kind == "nifti":
            return probe_nifti(path, sniffed)
        return probe_image(path, sniffed)
    except ServiceError as exc:
        exc.args = tuple(_scrub(str(a), path) if isinstance(a, str) else a for a in exc.args)
        raise


def decode(
    path: str | Path,
    *,
    max_voxels: int | None = None,
    max_image_pixels: int | None = None,
    max_bytes: int | None = None,
    dicom: Mapping[str, Any] | None = None,
) -> DecodedVolume:
    """Read an image or volume, detecting its format by content.

    Every limit is checked from the header (:func:`probe`) before anything is decoded.

    Args:
        path: the file (its name and suffix are ignored).
        max_voxels: refuse images with more voxels (times channels).
        max_image_pixels: refuse 2D images (or TIFF pages) with more pixels per plane
            (decompression-bomb limit).
        max_bytes: refuse inputs whose samples take more bytes once decompressed (the server
            passes its upload limit, so that a ``.nii.gz`` cannot inflate past it).
        dicom: ``series`` (SeriesInstanceUID) and ``tilt`` for a DICOM upload (a folder, a zip
            or a DICOM file; :func:`service.codecs.dicom.decode_dicom`).

    Raises:
        EmptyBodyError: the file is empty.
        UnsupportedMediaTypeError: the content is no supported format (DICOM included).
        PayloadTooLargeError: beyond ``max_voxels`` / ``max_image_pixels`` / ``max_bytes``.
        DecodeError: a recognized but corrupt or truncated file (malformed header included).
        UnusableInputError: a readable file tilewise cannot represent (e.g. complex NIfTI).
        DicomSeriesError: a DICOM upload that is no one usable series (422 ``dicom_series_invalid``).
    """
    path = Path(path)
    try:
        if _is_dicom(path):
            from service.codecs.dicom import decode_dicom

            return decode_dicom(path, max_voxels=max_voxels, max_bytes=max_bytes, **_dicom_options(dicom))
        sniffed = _sniffed(path)
        if sniffed.kind == "nifti":
            return decode_nifti(path, sniffed, max_voxels=max_voxels, max_bytes=max_bytes)
        return decode_image(
            path, sniffed, max_voxels=max_voxels, max_image_pixels=max_image_pixels, max_bytes=max_bytes
        )
    except ServiceError as exc:
        exc.args = tuple(_scrub(str(a), path) if isinstance(a, str) else a for a in exc.args)
        raise


def default_format(volume: DecodedVolume, output: str) -> str:
    """The output format when none is asked for: NIfTI in, ``nii.gz`` out; otherwise ``png``
    for ``output="labels"`` and ``tiff`` (float32) for ``"probabilities"``."""
    if volume.kind in ("nifti", "dicom"):
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


def encode(
    volume: DecodedVolume,
    array: np.ndarray,
    fmt: str,
    path: str | Path,
    *,
    provenance: Any = None,
    seg_type: str | None = None,
) -> Path:
    """Write a model output on ``volume``'s grid to ``path`` in format ``fmt``.

    Args:
        volume: the decoded input (its geometry and metadata are kept).
        array: ``(*spatial)`` uint8 labels or ``(C, *spatial)`` float32 values, where
            ``spatial == volume.spatial_shape``.
        fmt: one of :data:`OUTPUT_FORMATS`.
        path: where to write; used as given (the caller picks the suffix, ``OUTPUT_FORMATS[fmt]``
            for nibabel's gzip detection).
        provenance: a :class:`service.provenance.Provenance` written into the file (NIfTI
            ``descrip`` and extension, PNG ``tEXt``, TIFF description, SEG attributes).
        seg_type: ``binary``, ``labelmap`` or ``fractional`` for ``dicom-seg``.

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
    if fmt == "dicom-seg":
        encode_dicom_seg(volume, array, path, provenance, seg_type)
    else:
        _ENCODERS[fmt](volume, array, path, provenance)
    logger.info("encoded %s shape=%s dtype=%s", fmt, array.shape, array.dtype)
    return path

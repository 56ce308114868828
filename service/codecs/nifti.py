"""NIfTI-1 / NIfTI-2 (``.nii``, ``.nii.gz``) reading and writing with nibabel.

Reading starts with the header alone (:func:`probe_nifti`, at most 540 bytes plus the extensions,
inflated from the start of the stream for ``.nii.gz``): it is validated field by field (``dim[0]``
in 1..7, every axis at least 1 long, a known real data type, a finite ``vox_offset``), so a malformed
header is a 422 about the file, never a 500. What it declares (voxels, and bytes once decompressed)
is checked against the limits before any voxel is read; an uncompressed file shorter than what
its header declares is refused before anything is allocated, and a compressed one is read into an
array that the operating system commits page by page as data really arrives (``np.empty``, then
``readinto``), so a tiny file declaring a huge volume costs what it holds, not what it claims.

Decoding applies ``scl_slope`` / ``scl_inter`` and returns native-byte-order data. Writing copies
the input header, so the affine, qform and sform with their codes, zooms (``pixdim``, the 4th
included), units and orientation are bit-identical; only the data type, shape and scaling (reset)
change. A true 2D NIfTI (``dim[0] == 2``) decodes to two spatial axes, so a 3D model refuses it
(422) while a one-slice volume ``(X, Y, 1)`` is a volume; ``(X, Y, Z, 1)`` comes back 4D.

Memory: the voxels once (``voxels * itemsize`` bytes), plus a float32 copy when scaling applies.
"""

from __future__ import annotations

import gzip
import io
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from service.codecs.volume import DecodedVolume, Probe
from service.errors import DecodeError, UnusableInputError
from service.sniff import Sniffed

__all__ = ["decode_nifti", "encode_nifti", "probe_nifti", "stamp_provenance"]

logger = logging.getLogger(__name__)

# Errors nibabel, gzip and numpy raise on corrupt or truncated files.
#: Bytes read past the voxels of a ``.nii.gz`` to reach its trailer (CRC-32 and length) and check it.
_MAX_TRAILING_BYTES = 64 << 20

#: Voxel sizes (mm) outside this range are refused as implausible (a 1e-6 mm voxel is a broken header).
PLAUSIBLE_VOXEL_MM = (1e-4, 1e5)

_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, nib.spatialimages.HeaderDataError)

#: NIfTI ``datatype`` codes of the real-valued sample types tilewise reads.
_REAL_CODES = {
    2: np.uint8,
    4: np.int16,
    8: np.int32,
    16: np.float32,
    64: np.float64,
    256: np.int8,
    512: np.uint16,
    768: np.uint32,
    1024: np.int64,
    1280: np.uint64,
}
#: Codes the standard defines for types tilewise cannot run (a readable file, the wrong kind).
_OTHER_CODES = {
    1: "binary (1 bit)",
    32: "complex64",
    128: "RGB24",
    1536: "float128",
    1792: "complex128",
    2048: "complex256",
    2304: "RGBA32",
}
_MAX_EXTENSION_BYTES = 16 << 20  # header extensions kept for the output; more is not a header
_READ_CHUNK = 16 << 20


def _image_class(version: int) -> Any:
    return nib.Nifti2Image if version == 2 else nib.Nifti1Image


def _layout(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Spatial shape and channel count of a NIfTI of ``shape`` (``dim[1:dim[0]+1]``).

    ``(X, Y)`` is a 2D image; ``(X, Y, Z)`` a volume (``Z`` may be 1: a one-slice volume);
    ``(X, Y, Z, T)`` ``T`` channels; trailing singleton axes and NIfTI's vector layout
    ``(X, Y, Z, 1, C)`` are understood.

    Raises:
        UnusableInputError: a 1D array, or beyond 3 spatial axes plus one non-singleton channel axis.
    """
    dims = list(shape)
    while len(dims) > 3 and dims[-1] == 1:  # (X, Y, Z, 1) is a plain volume
        dims.pop()
    if len(dims) == 5 and dims[3] == 1:  # (X, Y, Z, 1, C): NIfTI's vector-valued layout
        dims.pop(3)
    if len(dims) < 2 or len(dims) > 4:
        raise UnusableInputError(f"NIfTI of shape {tuple(shape)} is not an image or volume (2 to 4 axes)")
    if len(dims) == 2:
        return (dims[0], dims[1]), 1
    channels = dims[3] if len(dims) == 4 else 1
    return (dims[0], dims[1], dims[2]), channels


def _open(path: Path, sniffed: Sniffed) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if sniffed.gzipped else open(path, "rb")  # noqa: SIM115


def _read_header(fh: io.BufferedIOBase, sniffed: Sniffed) -> tuple[Any, tuple[int, ...], np.dtype, int]:
    """Read and validate the header (and its extensions) at the start of ``fh``.

    Returns:
        ``(header, shape, stored dtype, data offset)``; ``fh`` is left at the end of the
        extensions.

    Raises:
        DecodeError: a header that is cut short or inconsistent (``dim[0]`` outside 1..7, an axis
            below 1, an unknown data type code, a non-finite ``vox_offset``).
        UnusableInputError: a valid header of a type tilewise cannot run (complex, RGB, float128).
    """
    klass = _image_class(sniffed.nifti_version).header_class
    size = klass.template_dtype.itemsize  # 348 or 540
    raw = fh.read(size)
    version = f"NIfTI-{sniffed.nifti_version}"
    if len(raw) < size:
        raise DecodeError(f"truncated {version} header: {len(raw)} of {size} bytes")
    header = klass(raw, endianness=sniffed.byteorder or None, check=False)
    dim = [int(n) for n in header["dim"]]
    if not 1 <= dim[0] <= 7:
        raise DecodeError(f"corrupt {version} header: dim[0] = {dim[0]} is not a number of axes in 1..7")
    shape = tuple(dim[1 : dim[0] + 1])
    for axis, length in enumerate(shape, start=1):
        if length < 1:
            raise DecodeError(
                f"corrupt {version} header: axis {axis} of dim {list(shape)} has length {length} "
                "(every axis needs at least one voxel)"
            )
    code = int(header["datatype"])
    if code in _OTHER_CODES:
        raise UnusableInputError(
            f"{version} data type {_OTHER_CODES[code]} (code {code}) is not a real-valued type "
            "tilewise can run; convert it to integers or float32"
        )
    if code not in _REAL_CODES:
        raise DecodeError(f"corrupt {version} header: unknown datatype code {code}")
    stored = np.dtype(_REAL_CODES[code]).newbyteorder(header.endianness)
    vox_offset = float(header["vox_offset"])
    if not math.isfinite(vox_offset):
        raise DecodeError(f"corrupt {version} header: vox_offset = {vox_offset}")
    offset = max(int(vox_offset), size + 4)  # nibabel's rule: never inside the header
    extension_flag = fh.read(4)
    ext_bytes = offset - size - 4
    if len(extension_flag) == 4 and extension_flag[0] != 0 and 0 < ext_bytes <= _MAX_EXTENSION_BYTES:
        block = fh.read(ext_bytes)
        try:
            header.extensions = klass.exts_klass.from_fileobj(
                io.BytesIO(block), len(block), header.endianness != nib.volumeutils.native_code
            )
        except Exception as exc:  # noqa: BLE001 - foreign parser on untrusted bytes; extensions are optional
            logger.info("ignoring unreadable NIfTI header extensions: %s", exc)
    return header, shape, stored, offset


def probe_nifti(path: Path, sniffed: Sniffed) -> Probe:
    """What a NIfTI declares, from its header alone (no voxel is read).

    Raises:
        DecodeError: a corrupt or truncated header.
        UnusableInputError: a data type or layout tilewise cannot run.
    """
    return _probe(path, sniffed)[0]


def _probe(path: Path, sniffed: Sniffed) -> tuple[Probe, Any, int]:
    if sniffed.nifti_version not in (1, 2):
        raise DecodeError("truncated or corrupt gzip stream: no NIfTI header can be read from it")
    try:
        with _open(path, sniffed) as fh:
            header, shape, stored, offset = _read_header(fh, sniffed)
    except (DecodeError, UnusableInputError):
        raise
    except _READ_ERRORS as exc:
        raise DecodeError(f"corrupt or truncated NIfTI-{sniffed.nifti_version} header: {exc}") from exc
    spatial, channels = _layout(shape)
    affine = _best_affine(header)
    _check_spacing(affine, len(spatial))
    slope, inter = _slope_inter(header)
    scaled = (slope, inter) != (1.0, 0.0)
    dtype = np.dtype(np.float32) if scaled or stored.kind == "f" else stored.newbyteorder("=")
    probe = Probe(
        kind="nifti",
        spatial_shape=spatial,
        channels=channels,
        dtype=dtype,
        nbytes=offset + math.prod(shape) * stored.itemsize,
        info={
            "nifti_version": sniffed.nifti_version,
            "shape": shape,
            "stored_dtype": str(stored),
            "affine": affine,
        },
    )
    return probe, header, offset


def _check_spacing(affine: np.ndarray | None, spatial_dims: int) -> None:
    """Refuse voxel sizes (the affine's column lengths, mm) outside :data:`PLAUSIBLE_VOXEL_MM`.

    Raises:
        UnusableInputError: a non-zero size outside the range, or a non-finite one (422).
    """
    if affine is None:
        return
    zooms = np.sqrt((np.asarray(affine, dtype=np.float64)[:3, :spatial_dims] ** 2).sum(axis=0))
    lo, hi = PLAUSIBLE_VOXEL_MM
    known = zooms[zooms != 0]  # 0: no size given (geometry says so where a model needs one)
    if not (np.isfinite(known).all() and ((known >= lo) & (known <= hi)).all()):
        shown = ", ".join(f"{z:g}" for z in zooms)
        raise UnusableInputError(
            f"implausible voxel size ({shown}) mm: expected {lo:g} to {hi:g} mm per axis "
            "(check pixdim and the sform/qform of the header)"
        )


def _best_affine(header: Any) -> np.ndarray | None:
    """The header's best affine (sform, qform, else from the zooms), or ``None`` when it has none."""
    try:
        return np.asarray(header.get_best_affine(), dtype=np.float64)
    except Exception:  # noqa: BLE001 - foreign code on an untrusted header: no affine, no geometry plan
        return None


def _slope_inter(header: Any) -> tuple[float, float]:
    """``(slope, inter)``; ``(1, 0)`` when the header says "no scaling".

    Raises:
        DecodeError: a valid slope with a non-finite intercept.
    """
    try:
        slope, inter = header.get_slope_inter()
    except nib.spatialimages.HeaderDataError as exc:
        raise DecodeError(f"corrupt NIfTI header: {exc}") from exc
    return (1.0, 0.0) if slope is None else (float(slope), float(inter or 0.0))


def _read_voxels(fh: io.BufferedIOBase, n_bytes: int) -> np.ndarray:
    """``n_bytes`` from ``fh`` into a fresh buffer, chunk by chunk.

    ``np.empty`` reserves address space only: pages are committed as ``readinto`` fills them, so
    a stream that ends early has cost what it held.

    Raises:
        DecodeError: the stream ends before ``n_bytes``.
    """
    buffer = np.empty(n_bytes, np.uint8)
    view = buffer.data  # memoryview(buffer): numpy declares the buffer protocol from Python 3.12 only
    done = 0
    while done < n_bytes:
        got = fh.readinto(view[done : min(n_bytes, done + _READ_CHUNK)])
        if not got:
            raise DecodeError(f"truncated NIfTI: the header declares {n_bytes} bytes of voxels, got {done}")
        done += got
    return buffer


def decode_nifti(
    path: Path, sniffed: Sniffed, *, max_voxels: int | None = None, max_bytes: int | None = None
) -> DecodedVolume:
    """Read a single-file NIfTI into a :class:`DecodedVolume` of shape ``(C, X, Y, Z)``
    (``(C, X, Y)`` for a true 2D NIfTI).

    Args:
        max_voxels: refuse more voxels (times channels) than this, from the header.
        max_bytes: refuse more bytes of voxels once decompressed than this, from the header.

    Raises:
        PayloadTooLargeError: beyond ``max_voxels`` or ``max_bytes``.
        UnusableInputError: a shape or data type tilewise cannot run (complex, RGB24, 5D ...).
        DecodeError: a corrupt or truncated file.
    """
    probe, header, offset = _probe(path, sniffed)
    probe.check_limits(max_voxels=max_voxels, max_bytes=max_bytes)
    shape: tuple[int, ...] = probe.info["shape"]
    stored = np.dtype(probe.info["stored_dtype"])
    voxel_bytes = probe.nbytes - offset
    if not sniffed.gzipped and path.stat().st_size < probe.nbytes:
        raise DecodeError(
            f"truncated NIfTI: the header declares {voxel_bytes} bytes of voxels from byte {offset}, "
            f"the file has {path.stat().st_size} bytes"
        )
    try:
        with _open(path, sniffed) as fh:
            skip = offset
            while skip > 0:  # gzip streams cannot seek cheaply: read past the header
                chunk = fh.read(min(skip, _READ_CHUNK))
                if not chunk:
                    raise DecodeError("truncated NIfTI: the file ends before its voxels start")
                skip -= len(chunk)
            raw = _read_voxels(fh, voxel_bytes)
            if sniffed.gzipped:  # read to the end: gzip checks the CRC and length of its trailer there
                trailing = 0
                while trailing <= _MAX_TRAILING_BYTES and (chunk := fh.read(_READ_CHUNK)):
                    trailing += len(chunk)
    except DecodeError:
        raise
    except _READ_ERRORS as exc:
        raise DecodeError(f"corrupt or truncated NIfTI-{sniffed.nifti_version} file: {exc}") from exc
    data = raw.view(stored).reshape(shape, order="F")
    if not data.dtype.isnative:
        data = data.astype(data.dtype.newbyteorder("="))
    slope, inter = _slope_inter(header)
    with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, not a warning
        data = nib.volumeutils.apply_read_scaling(data, slope, inter)
        if data.dtype.kind == "f" and data.dtype != np.float32:
            data = data.astype(np.float32)
    spatial, channels = probe.spatial_shape, probe.channels
    data = data.reshape(*spatial, channels, order="F")
    if channels == 1:
        data = data[..., 0][None]  # a view: no copy of a one-channel volume
    else:
        data = np.ascontiguousarray(np.moveaxis(data, -1, 0))
    header = header.copy()
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
        affine=np.asarray(header.get_best_affine()),
        nifti_ndim=len(shape),
        info={"nifti_version": sniffed.nifti_version, "shape": shape},
    )


def _channels_last(array: np.ndarray, spatial_dims: int) -> np.ndarray:
    """``(*spatial)`` labels or ``(C, *spatial)`` values to ``(*spatial)`` / ``(*spatial, C)``."""
    if array.ndim == spatial_dims:
        return array
    if array.shape[0] == 1:
        return np.asarray(array[0])
    return np.moveaxis(array, 0, -1)


def _to_nifti_layout(volume: DecodedVolume, array: np.ndarray) -> np.ndarray:
    """The output in the input NIfTI's layout.

    One channel keeps the input's shape (``(X, Y)``, ``(X, Y, Z)``, ``(X, Y, Z, 1)`` with its
    trailing singleton axes); ``C`` channels go last, after a singleton ``Z`` for a 2D input
    (NIfTI's ``(X, Y, 1, C)``).
    """
    out = _channels_last(array, volume.spatial_dims)
    if out.ndim == volume.spatial_dims:
        shape = tuple(volume.info.get("shape") or out.shape)
        if len(shape) > out.ndim and math.prod(shape) == out.size:
            return out.reshape(shape, order="F")  # (X, Y, Z, 1) stays 4D
        return out
    return out[:, :, None, :] if volume.spatial_dims == 2 else out


def stamp_provenance(header: Any, provenance: Any) -> None:
    """``descrip`` and the provenance extension (code 6, replacing an earlier tilewise one)."""
    from service.provenance import NIFTI_EXTENSION_CODE

    header["descrip"] = provenance.descrip().encode()
    kept = [e for e in header.extensions if not _is_ours(e)]
    header.extensions.clear()
    header.extensions.extend(kept)
    header.extensions.append(nib.nifti1.Nifti1Extension(NIFTI_EXTENSION_CODE, provenance.json().encode()))


def _is_ours(extension: Any) -> bool:
    try:
        return bool(extension.get_code() == 6 and extension.get_content().startswith(b'{"tilewise"'))
    except Exception:  # noqa: BLE001 - a foreign extension that cannot be read is kept
        return False


def encode_nifti(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write ``array`` (the model output on ``volume``'s grid) as NIfTI; the suffix picks gzip.

    A NIfTI input's header is copied (geometry bit-identical, ``pixdim`` included; data type from
    ``array``, scaling reset, display range cleared, ``vox_offset`` recomputed); so is a DICOM
    series' (its RAS affine as qform and sform). Other inputs get an identity affine with both codes 0.
    """
    if volume.header is None:
        out = _channels_last(array, volume.spatial_dims)
        image = nib.Nifti1Image(out, np.eye(4))  # type: ignore[no-untyped-call]
        if provenance is not None:
            stamp_provenance(image.header, provenance)
        nib.save(image, str(path))
        return
    out = _to_nifti_layout(volume, array)
    header = volume.header.copy()
    header.set_data_dtype(out.dtype)
    header.set_slope_inter(1.0, 0.0)  # written as "no scaling" (NaN) for float and uint8 output
    header["vox_offset"] = 0  # not the input's (100 is inside the header): 0 lets nibabel place the data
    header["cal_min"] = 0.0
    header["cal_max"] = 0.0
    if provenance is not None:
        stamp_provenance(header, provenance)
    image = _image_class(int(volume.info.get("nifti_version", 1)))(out, None, header=header)
    nib.save(image, str(path))

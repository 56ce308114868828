"""DICOM series in: one volume from a folder, a zip, a multipart upload of its files, or one
(enhanced multi-frame) object.

Steps (the first three from the headers alone, :func:`probe_dicom`):

1. The objects with pixel data are grouped by ``SeriesInstanceUID``. Several series are refused,
   listed (``series=UID`` chooses one); a series of localizers only (``ImageType`` ``LOCALIZER``)
   is dropped, and so are localizers inside the chosen series; both are said in the notes.
2. Frames (one per single-frame object, one per frame of an enhanced multi-frame object, its
   geometry from the per-frame or shared functional groups) must share ``Rows``/``Columns``,
   ``ImageOrientationPatient`` and ``PixelSpacing``; they are sorted by the projection of
   ``ImagePositionPatient`` on the slice normal (row cosine x column cosine).
3. The slice steps must be even: a missing slice, uneven spacing, two frames at one position, a
   gantry tilt (the step not along the normal; refused unless ``tilt=resample``) are refused with
   :class:`~service.errors.DicomSeriesError` (422 ``dicom_series_invalid``) naming the fault.
4. Pixels (pydicom, with ``pylibjpeg`` for JPEG, JPEG-LS, JPEG 2000 and RLE transfer syntaxes) are
   read and ``RescaleSlope``/``RescaleIntercept`` applied (float32 then).

Layout and geometry, as ``dcm2niix`` (and every NIfTI reader) expects: the volume is
``(X, Y, Z) = (column, row, slice)``, ``data[i, j, k] = frame_k[j, i]``. In DICOM's patient space
(LPS: +x to the patient's left, +y posterior, +z head) voxel ``(i, j, k)`` sits at
``IPP_0 + i * dc * F_row + j * dr * F_col + k * S``, where ``F_row``/``F_col`` are the first and
last three values of ``ImageOrientationPatient``, ``(dr, dc) = PixelSpacing`` (between rows,
between columns) and ``S = (IPP_last - IPP_0) / (n - 1)`` (for one frame: the normal times
``SpacingBetweenSlices``, else ``SliceThickness``, else 1 mm). NIfTI's world is RAS, so the affine
is ``diag(-1, -1, 1, 1) @ LPS``. With ``tilt=resample`` each slice is shifted in plane (linear
interpolation, as ``dcm2niix`` does) onto the orthogonal grid ``S' = (S . n) n``.

Imports numpy, nibabel and pydicom (the ``dicom`` extra); never torch or FastAPI.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.codecs.dicom_files import DicomFile, list_dicom_files
from service.codecs.volume import DecodedVolume, Probe
from service.errors import BadParameterError, DicomSeriesError, PayloadTooLargeError

__all__ = ["DicomSeries", "Frame", "LPS_TO_RAS", "decode_dicom", "probe_dicom", "read_series"]

logger = logging.getLogger(__name__)

#: NIfTI's RAS world from DICOM's LPS patient space.
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
_ORIENTATION_TOL = 1e-4  # direction cosines
_SPACING_TOL = 1e-4  # mm, pixel spacing
_TILT_TOL_DEG = 0.05
TILT_CHOICES = ("refuse", "resample")


@dataclass(frozen=True, slots=True)
class Frame:
    """One 2D frame of the series: where it is read from, and where it lies.

    Attributes:
        file: the object holding it.
        index: its frame index in a multi-frame object, ``None`` for a single-frame one.
        position: ``ImagePositionPatient`` (LPS, mm).
        orientation: ``ImageOrientationPatient`` (6 direction cosines).
        spacing: ``PixelSpacing`` ``(between rows, between columns)`` in mm.
        slope, intercept: the rescale to apply to its stored values.
    """

    file: DicomFile
    index: int | None
    position: np.ndarray
    orientation: np.ndarray
    spacing: tuple[float, float]
    slope: float = 1.0
    intercept: float = 0.0


@dataclass(frozen=True, slots=True)
class DicomSeries:
    """A checked series: frames sorted along the slice normal, with the geometry they define.

    Attributes:
        frames: sorted by position along the normal (ascending).
        shape: ``(columns, rows, frames)``: the decoded volume's spatial shape.
        affine: the 4x4 voxel-to-RAS affine (mm) of the decoded volume.
        affine_lps: the same in DICOM's LPS.
        tilt_degrees: the gantry tilt (angle between the slice step and the normal), 0 if none.
        resampled: whether the tilt was resampled away (``tilt=resample``).
        notes: what was dropped or handled (localizers, skipped files), for the log and headers.
        series_uid, study_uid, frame_of_reference_uid: the series' identifiers.
        stored_dtype: the dtype of the stored samples.
        scaled: whether a rescale other than ``(1, 0)`` applies (the volume is then float32).
    """

    frames: tuple[Frame, ...]
    shape: tuple[int, int, int]
    affine: np.ndarray
    affine_lps: np.ndarray
    tilt_degrees: float
    resampled: bool
    series_uid: str
    study_uid: str
    frame_of_reference_uid: str
    stored_dtype: np.dtype
    scaled: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def headers(self) -> list[Any]:
        """The source objects' headers, each once, in frame order (highdicom's ``source_images``)."""
        seen: dict[int, Any] = {}
        for frame in self.frames:
            seen.setdefault(id(frame.file.header), frame.file.header)
        return list(seen.values())

    @property
    def multiframe(self) -> bool:
        """Whether the frames come from one enhanced multi-frame object."""
        return self.frames[0].index is not None


def _floats(value: Any, n: int, what: str, name: str) -> np.ndarray:
    try:
        out = np.asarray([float(v) for v in value], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DicomSeriesError(f"{name}: {what} is missing or not numeric") from exc
    if out.shape != (n,) or not np.isfinite(out).all():
        raise DicomSeriesError(f"{name}: {what} needs {n} finite values, has {list(value)}")
    return out


def _group(ds: Any, i: int, sequence: str) -> Any | None:
    """The item of functional group ``sequence`` for frame ``i``: per-frame, else shared."""
    for groups in ("PerFrameFunctionalGroupsSequence", "SharedFunctionalGroupsSequence"):
        items = ds.get(groups)
        if not items:
            continue
        item = items[i] if groups.startswith("PerFrame") and i < len(items) else items[0]
        if sequence in item and item[sequence].value:
            return item[sequence].value[0]
    return None


def _rescale(item: Any) -> tuple[float, float]:
    if item is None or "RescaleSlope" not in item:
        return 1.0, 0.0
    return float(item.RescaleSlope), float(item.get("RescaleIntercept", 0.0) or 0.0)


def _frames_of(file: DicomFile) -> list[Frame]:
    ds, name = file.header, file.name
    if int(ds.get("SamplesPerPixel", 1) or 1) != 1:
        raise DicomSeriesError(
            f"{name}: {ds.get('PhotometricInterpretation', 'colour')} images ({ds.SamplesPerPixel} samples "
            "per pixel) are no greyscale series"
        )
    n_frames = int(ds.get("NumberOfFrames", 1) or 1)
    if "PerFrameFunctionalGroupsSequence" in ds or "SharedFunctionalGroupsSequence" in ds:
        frames = []
        for i in range(n_frames):
            position, orientation = (
                _group(ds, i, "PlanePositionSequence"),
                _group(ds, i, "PlaneOrientationSequence"),
            )
            measures = _group(ds, i, "PixelMeasuresSequence")
            if position is None or orientation is None or measures is None:
                raise DicomSeriesError(
                    f"{name}: frame {i + 1} has no plane position, orientation or pixel spacing"
                )
            frames.append(
                Frame(
                    file,
                    i,
                    _floats(position.get("ImagePositionPatient"), 3, "ImagePositionPatient", name),
                    _floats(orientation.get("ImageOrientationPatient"), 6, "ImageOrientationPatient", name),
                    tuple(_floats(measures.get("PixelSpacing"), 2, "PixelSpacing", name)),
                    *_rescale(_group(ds, i, "PixelValueTransformationSequence")),
                )
            )
        return frames
    if "ImagePositionPatient" not in ds or "ImageOrientationPatient" not in ds:
        raise DicomSeriesError(
            f"{name}: no ImagePositionPatient / ImageOrientationPatient: the image has no place in the "
            "patient (a secondary capture or projection, not a slice of a volume)"
        )
    if n_frames != 1:
        raise DicomSeriesError(f"{name}: {n_frames} frames without per-frame positions")
    spacing = ds.get("PixelSpacing") or ds.get("ImagerPixelSpacing")
    return [
        Frame(
            file,
            None,
            _floats(ds.ImagePositionPatient, 3, "ImagePositionPatient", name),
            _floats(ds.ImageOrientationPatient, 6, "ImageOrientationPatient", name),
            tuple(_floats(spacing, 2, "PixelSpacing", name)),
            *_rescale(ds),
        )
    ]


def _is_localizer(ds: Any) -> bool:
    return "LOCALIZER" in [str(v).upper() for v in (ds.get("ImageType") or [])]


def _choose_series(files: list[DicomFile], series: str | None) -> tuple[list[DicomFile], list[str]]:
    """The files of the one series to read, and notes on what was dropped."""
    groups: dict[str, list[DicomFile]] = {}
    for f in files:
        groups.setdefault(str(f.header.get("SeriesInstanceUID", "")), []).append(f)
    notes = []
    if series is not None:
        if series not in groups:
            listed = ", ".join(sorted(groups))
            raise DicomSeriesError(f"series={series} is not in the upload; it holds: {listed}")
        chosen = groups[series]
    else:
        useful = {uid: fs for uid, fs in groups.items() if not all(_is_localizer(f.header) for f in fs)}
        for uid in sorted(set(groups) - set(useful)):
            notes.append(f"localizer series {uid} dropped ({len(groups[uid])} image(s))")
        if not useful:
            raise DicomSeriesError("the upload holds localizer images only: no volume to read")
        if len(useful) > 1:
            listed = ", ".join(
                f"{uid} ({fs[0].header.get('Modality', '?')}, {len(fs)} image(s))"
                for uid, fs in sorted(useful.items())
            )
            raise DicomSeriesError(f"several series: {listed}; choose one with series=UID")
        chosen = next(iter(useful.values()))
    kept = [f for f in chosen if not _is_localizer(f.header)]
    if len(kept) < len(chosen):
        notes.append(f"{len(chosen) - len(kept)} localizer image(s) dropped from the series")
    if not kept:
        raise DicomSeriesError("the chosen series holds localizer images only: no volume to read")
    multi = [
        f
        for f in kept
        if int(f.header.get("NumberOfFrames", 1) or 1) > 1 or "PerFrameFunctionalGroupsSequence" in f.header
    ]
    if multi and len(kept) > 1:
        raise DicomSeriesError(
            f"the series mixes {len(multi)} multi-frame object(s) with {len(kept) - len(multi)} other(s); "
            "send one enhanced object or single-frame slices"
        )
    return kept, notes


def _check_alike(frames: list[Frame]) -> None:
    first = frames[0]
    shape0 = (int(first.file.header.Rows), int(first.file.header.Columns))
    for frame in frames[1:]:
        shape = (int(frame.file.header.Rows), int(frame.file.header.Columns))
        if shape != shape0:
            raise DicomSeriesError(
                f"mixed sizes: {shape0[0]}x{shape0[1]} and {shape[0]}x{shape[1]} (rows x columns)"
            )
        if np.abs(frame.orientation - first.orientation).max() > _ORIENTATION_TOL:
            raise DicomSeriesError(
                f"mixed orientations: {_fmt(first.orientation)} and {_fmt(frame.orientation)} "
                "(ImageOrientationPatient)"
            )
        if np.abs(np.subtract(frame.spacing, first.spacing)).max() > _SPACING_TOL:
            raise DicomSeriesError(
                f"mixed pixel spacings: {list(first.spacing)} and {list(frame.spacing)} mm"
            )


def _fmt(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:g}" for v in np.round(values, 5)) + "]"


def _normal(orientation: np.ndarray) -> np.ndarray:
    normal = np.cross(orientation[:3], orientation[3:])
    norm = float(np.linalg.norm(normal))
    if norm < 0.5:
        raise DicomSeriesError(
            f"ImageOrientationPatient {_fmt(orientation)} holds no two orthogonal unit vectors"
        )
    return normal / norm


def _check_steps(along: np.ndarray) -> None:
    """Refuse duplicate positions, a missing slice, or uneven spacing (positions sorted, mm)."""
    steps = np.diff(along)
    if steps.size == 0:
        return
    if steps.min() < 1e-3:
        k = int(np.argmin(steps))
        raise DicomSeriesError(
            f"two images at the same position z={along[k]:.2f} (several echoes, phases or acquisitions "
            "in one series: not one volume)"
        )
    usual = float(np.median(steps))
    tol = 0.01 * usual + 1e-3
    for k, step in enumerate(steps):
        if abs(step - usual) <= tol:
            continue
        if step > 1.5 * usual:
            raise DicomSeriesError(
                f"missing slice between z={along[k]:.2f} and z={along[k + 1]:.2f} (gap {step:.2f} mm, "
                f"slices {usual:.2f} mm apart elsewhere)"
            )
        raise DicomSeriesError(
            f"uneven slice spacing: {step:.3f} mm between z={along[k]:.2f} and z={along[k + 1]:.2f}, "
            f"{usual:.3f} mm elsewhere"
        )


def read_series(
    path: Path, *, series: str | None = None, tilt: str | None = None, max_bytes: int | None = None
) -> DicomSeries:
    """Group, choose, sort and check a DICOM upload from its headers (no pixel is decoded).

    Args:
        path: a folder, a zip or one DICOM file (see :func:`service.codecs.dicom_files.list_dicom_files`).
        series: the ``SeriesInstanceUID`` to read when the upload holds several.
        tilt: ``"refuse"`` (default) or ``"resample"`` a gantry-tilted series.
        max_bytes: the zip inflation limit.

    Raises:
        DicomSeriesError: several series, no pixel data, mixed orientations / sizes / spacings, a
            missing slice, uneven spacing, duplicate positions, or a gantry tilt (422).
        BadParameterError: an unknown ``tilt``.
    """
    tilt = tilt or "refuse"
    if tilt not in TILT_CHOICES:
        raise BadParameterError(f"tilt={tilt!r} is not one of {list(TILT_CHOICES)}")
    files, notes = list_dicom_files(path, max_bytes=max_bytes)
    chosen, dropped = _choose_series(files, series)
    frames = [frame for f in chosen for frame in _frames_of(f)]
    _check_alike(frames)
    orientation = frames[0].orientation
    normal = _normal(orientation)
    along = np.array([float(np.dot(f.position, normal)) for f in frames])
    order = np.argsort(along, kind="stable")
    frames = [frames[k] for k in order]
    along = along[order]
    _check_steps(along)
    first = frames[0]
    header = first.file.header
    if len(frames) > 1:
        step = (frames[-1].position - first.position) / (len(frames) - 1)
    else:
        thick = header.get("SpacingBetweenSlices") or header.get("SliceThickness") or 1.0
        step = normal * float(thick)
    cos = abs(float(np.dot(step, normal))) / float(np.linalg.norm(step))
    tilt_deg = math.degrees(math.acos(min(1.0, cos)))
    resampled = False
    if tilt_deg > _TILT_TOL_DEG:
        if tilt != "resample":
            raise DicomSeriesError(
                f"gantry tilt {tilt_deg:.1f} degrees (the slices are sheared, not stacked along their "
                "normal); send tilt=resample to resample them onto an orthogonal grid"
            )
        step = normal * float(np.dot(step, normal))
        resampled = True
        dropped.append(f"gantry tilt {tilt_deg:.1f} degrees resampled to an orthogonal grid")
    dr, dc = first.spacing
    lps = np.eye(4)
    lps[:3, 0] = orientation[:3] * dc
    lps[:3, 1] = orientation[3:] * dr
    lps[:3, 2] = step
    lps[:3, 3] = first.position
    bits = int(header.get("BitsAllocated", 16) or 16)
    signed = int(header.get("PixelRepresentation", 0) or 0) == 1
    stored = (
        np.dtype(f"{'i' if signed else 'u'}{max(1, bits // 8)}")
        if bits in (8, 16, 32)
        else np.dtype(np.float32)
    )
    if "FloatPixelData" in header or "DoubleFloatPixelData" in header:
        stored = np.dtype(np.float32)
    scaled = any((f.slope, f.intercept) != (1.0, 0.0) for f in frames)
    result = DicomSeries(
        frames=tuple(frames),
        shape=(int(header.Columns), int(header.Rows), len(frames)),
        affine=LPS_TO_RAS @ lps,
        affine_lps=lps,
        tilt_degrees=tilt_deg,
        resampled=resampled,
        series_uid=str(header.get("SeriesInstanceUID", "")),
        study_uid=str(header.get("StudyInstanceUID", "")),
        frame_of_reference_uid=str(header.get("FrameOfReferenceUID", "")),
        stored_dtype=stored,
        scaled=scaled,
        notes=tuple(notes + dropped),
    )
    for note in result.notes:
        logger.info("DICOM series %s: %s", result.series_uid, note)
    return result


def probe_dicom(
    path: Path, *, series: str | None = None, tilt: str | None = None, max_bytes: int | None = None
) -> Probe:
    """What a DICOM upload declares, from its headers: the chosen series' shape and dtype.

    Raises:
        DicomSeriesError, BadParameterError: see :func:`read_series`.
    """
    found = read_series(path, series=series, tilt=tilt, max_bytes=max_bytes)
    dtype = np.dtype(np.float32) if found.scaled or found.resampled else found.stored_dtype
    return Probe(
        kind="dicom",
        spatial_shape=found.shape,
        channels=1,
        dtype=dtype,
        nbytes=math.prod(found.shape) * found.stored_dtype.itemsize,
        info={"affine": found.affine, "series": found.series_uid, "notes": list(found.notes)},
    )


def _pixels(found: DicomSeries) -> np.ndarray:
    """``(rows, columns, frames)`` stored samples, rescaled (float32) when a rescale applies."""
    rows, cols = found.shape[1], found.shape[0]
    dtype = np.float32 if found.scaled or found.resampled else found.stored_dtype
    out = np.empty((rows, cols, len(found.frames)), dtype=dtype)
    held: tuple[int, np.ndarray] | None = None  # the multi-frame object's pixels, read once
    for k, frame in enumerate(found.frames):
        if held is None or held[0] != id(frame.file):
            try:
                held = (id(frame.file), np.asarray(frame.file.read().pixel_array))
            except DicomSeriesError:
                raise
            except Exception as exc:  # noqa: BLE001 - codec errors of pydicom / pylibjpeg
                raise DicomSeriesError(f"{frame.file.name}: pixel data cannot be decoded: {exc}") from exc
        array = held[1]
        plane = array if frame.index is None else (array[frame.index] if array.ndim == 3 else array)
        if plane.shape != (rows, cols):
            raise DicomSeriesError(
                f"{frame.file.name}: pixel data of shape {plane.shape}, header says {rows}x{cols}"
            )
        if (frame.slope, frame.intercept) != (1.0, 0.0):
            out[:, :, k] = plane.astype(np.float32) * np.float32(frame.slope) + np.float32(frame.intercept)
        else:
            out[:, :, k] = plane
    return out


def _unshear(data: np.ndarray, found: DicomSeries) -> np.ndarray:
    """Shift each slice in plane onto the orthogonal grid (``tilt=resample``), linear."""
    from scipy import ndimage

    first = found.frames[0]
    normal = _normal(first.orientation)
    dr, dc = first.spacing
    step = (found.frames[-1].position - first.position) / max(1, len(found.frames) - 1)
    along = float(np.dot(step, normal))
    out = np.empty_like(data, dtype=np.float32)
    for k, frame in enumerate(found.frames):
        offset = frame.position - (first.position + k * along * normal)
        di = float(np.dot(offset, first.orientation[:3])) / dc  # along columns index (x)
        dj = float(np.dot(offset, first.orientation[3:])) / dr  # along rows index (y)
        out[:, :, k] = ndimage.shift(data[:, :, k].astype(np.float32), (dj, di), order=1, mode="nearest")
    return out


def decode_dicom(
    path: Path,
    *,
    series: str | None = None,
    tilt: str | None = None,
    max_voxels: int | None = None,
    max_bytes: int | None = None,
) -> DecodedVolume:
    """Read a DICOM series into a :class:`DecodedVolume` ``(1, X, Y, Z)`` of kind ``"dicom"``.

    Its ``affine`` is the RAS affine, ``header`` a NIfTI-1 header carrying it (qform and sform,
    code 1 "scanner"), ``info["dicom"]`` the :class:`DicomSeries` (for a SEG that references the
    source) and ``info["notes"]`` what was dropped or handled.

    Raises:
        DicomSeriesError: see :func:`read_series`; or pixel data that cannot be decoded.
        PayloadTooLargeError: beyond ``max_voxels`` or ``max_bytes`` (from the headers).
    """
    import nibabel as nib

    found = read_series(path, series=series, tilt=tilt, max_bytes=max_bytes)
    shape = found.shape
    voxels = math.prod(shape)
    if max_voxels is not None and voxels > max_voxels:
        raise PayloadTooLargeError(
            f"DICOM series of shape {'x'.join(map(str, shape))} declares {voxels} voxels; the limit is "
            f"max_voxels={max_voxels}"
        )
    pixels = _pixels(found)
    if found.resampled:
        pixels = _unshear(pixels, found)
    data = np.ascontiguousarray(pixels.transpose(1, 0, 2))[None]
    header = nib.Nifti1Header()  # type: ignore[no-untyped-call]
    header.set_data_shape(shape)  # type: ignore[no-untyped-call]
    header.set_data_dtype(data.dtype)  # type: ignore[no-untyped-call]
    header.set_qform(found.affine, code=1)  # type: ignore[no-untyped-call]
    header.set_sform(found.affine, code=1)  # type: ignore[no-untyped-call]
    header.set_xyzt_units("mm", "sec")  # type: ignore[no-untyped-call]
    logger.info(
        "decoded DICOM series %s: %d frame(s) shape=%s dtype=%s tilt=%.2f", found.series_uid,
        len(found.frames), shape, data.dtype, found.tilt_degrees,
    )  # fmt: skip
    return DecodedVolume(
        data=data,
        kind="dicom",
        header=header,
        affine=found.affine.copy(),
        nifti_ndim=3,
        info={"nifti_version": 1, "shape": shape, "dicom": found, "notes": list(found.notes)},
    )

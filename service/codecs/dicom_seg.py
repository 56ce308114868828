"""DICOM SEG out (``format=dicom-seg``), written with highdicom, for a DICOM series in.

One segment per label of the model's ``labels`` but the background (label 0): its name and a
fixed colour per label (``DisplayColorCIELab``). ``seg_type=binary`` (default for labels) or
``labelmap`` from labels; ``fractional`` (8-bit probabilities, ``MaximumFractionalValue`` 255,
the default for probabilities) from probabilities, one segment per output channel (channel 0
left out after a softmax: the background).

Geometry is never re-derived from an affine: the SEG's frames are those of the source series
(highdicom copies ``ImagePositionPatient`` / ``ImageOrientationPatient`` and ``PixelSpacing`` from
the source instances), the source instances are referenced (``ReferencedSeriesSequence``,
``SourceImageSequence`` per frame), and the ``FrameOfReferenceUID`` and study are the source's.
Frame ``k`` of the sorted series is the decoded volume's slice ``[:, :, k]`` transposed (see
:mod:`service.codecs.dicom`). A series resampled for its gantry tilt has no source frames to copy:
``dicom-seg`` is refused for it.

The algorithm is identified (:mod:`service.provenance`): model name, tilewise version, weights
sha256 and plan.
"""

from __future__ import annotations

import colorsys
import logging
from pathlib import Path
from typing import Any

import numpy as np

from service.codecs.volume import DecodedVolume
from service.errors import BadParameterError

__all__ = ["check_seg", "encode_dicom_seg", "segment_channels"]

logger = logging.getLogger(__name__)


def _series(volume: DecodedVolume) -> Any:
    return volume.info.get("dicom") if volume.kind == "dicom" else None


def check_seg(volume: DecodedVolume, spec: Any, params: Any, output_kind: str) -> None:
    """Refuse ``format=dicom-seg`` where it cannot be written, before the run.

    Raises:
        BadParameterError: the input is no DICOM series, its gantry tilt was resampled, the model
            is 2D, or ``seg_type`` does not fit the output kind (``fractional`` needs
            probabilities, ``binary``/``labelmap`` labels).
    """
    series = _series(volume)
    if series is None:
        raise BadParameterError(
            f"format=dicom-seg needs a DICOM series as input; the input is {volume.kind.upper()} (use nii.gz)"
        )
    if series.resampled:
        raise BadParameterError(
            "format=dicom-seg: the series was resampled for its gantry tilt, so its frames are not "
            "the source's; use format=nii.gz"
        )
    if int(spec.spatial_dims) != 3:
        raise BadParameterError(f"format=dicom-seg needs a 3D model; {spec.name!r} is 2D")
    seg_type = _seg_type(params, output_kind)
    if (seg_type == "fractional") != (output_kind == "probabilities"):
        need = "output=probabilities" if seg_type == "fractional" else "output=labels"
        raise BadParameterError(f"seg_type={seg_type} needs {need}; the output is {output_kind}")


def _seg_type(params: Any, output_kind: str) -> str:
    given = getattr(params, "seg_type", None)
    if given is not None:
        return str(getattr(given, "value", given))
    return "fractional" if output_kind == "probabilities" else "binary"


def _colour(index: int) -> tuple[int, int, int]:
    """A distinct RGB colour per label (golden-angle hues)."""
    r, g, b = colorsys.hsv_to_rgb((index * 0.618034) % 1.0, 0.75, 0.95)
    return int(r * 255), int(g * 255), int(b * 255)


def segment_channels(provenance: Any, channels: int) -> list[int]:
    """The output channels (or labels) written as segments: every one but 0 after a softmax
    (the background), all otherwise."""
    if channels > 1 and (
        provenance is None or provenance.activation == "softmax" or provenance.output == "labels"
    ):
        return list(range(1, channels))
    return list(range(channels))


def _frames_first(volume: DecodedVolume, plane: np.ndarray) -> np.ndarray:
    """``(X, Y, Z, ...)`` to the source's frame order ``(frames, rows, columns, ...)``."""
    series = _series(volume)
    stacked = np.moveaxis(plane, 2, 0).swapaxes(1, 2)  # (Z, Y, X, ...) = (frame, row, column)
    if not series.multiframe:
        return np.ascontiguousarray(stacked)
    out = np.empty_like(stacked)
    for k, frame in enumerate(series.frames):
        out[frame.index] = stacked[k]
    return out


def encode_dicom_seg(
    volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None, seg_type: str | None = None
) -> None:
    """Write the model output on a DICOM series' grid as a DICOM SEG instance.

    Args:
        volume: the decoded series (``info["dicom"]``, :class:`service.codecs.dicom.DicomSeries`).
        array: uint8 labels ``(X, Y, Z)`` or float32 probabilities ``(C, X, Y, Z)``.
        path: where to write (``.dcm``).
        provenance: :class:`service.provenance.Provenance` (model, labels, weights, plan).
        seg_type: ``binary``, ``labelmap`` or ``fractional`` (default by output kind).

    Raises:
        BadParameterError: the input is no DICOM series (see :func:`check_seg`).
    """
    import highdicom as hd
    from pydicom.sr.codedict import codes

    series = _series(volume)
    if series is None:
        raise BadParameterError("format=dicom-seg needs a DICOM series as input (use nii.gz)")
    labels_out = array.ndim == 3
    seg_type = seg_type or ("binary" if labels_out else "fractional")
    names = dict(getattr(provenance, "labels", None) or {})
    model = getattr(provenance, "model", "tilewise")
    version = getattr(provenance, "tilewise_version", "0")
    if labels_out:
        present = int(array.max()) if array.size else 0
        count = max(len(names), present + 1, 2)
        channels = list(range(1, count))
        pixels = _frames_first(volume, array.astype(np.uint8 if count < 256 else np.uint16, copy=False))
    else:
        channels = segment_channels(provenance, int(array.shape[0]))
        probs = np.clip(np.moveaxis(array[channels], 0, -1), 0.0, 1.0).astype(np.float32)
        pixels = _frames_first(volume, probs)
    parameters = {}
    if provenance is not None:
        parameters = {"weights_sha256": provenance.weights_sha256, "plan": provenance.plan[:64]}
    algorithm = hd.AlgorithmIdentificationSequence(
        name=model[:64], family=codes.cid7162.ArtificialIntelligence, version=version, parameters=parameters
    )
    descriptions = []
    for number, channel in enumerate(channels, start=1):
        name = names.get(channel, f"label {channel}")
        descriptions.append(
            hd.seg.SegmentDescription(
                segment_number=number,
                segment_label=name[:64],
                segmented_property_category=codes.SCT.Tissue,
                segmented_property_type=codes.SCT.Tissue,
                algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
                algorithm_identification=algorithm,
                display_color=hd.color.CIELabColor.from_rgb(*_colour(channel)),
            )
        )
    if labels_out and channels != list(range(1, len(channels) + 1)):
        raise AssertionError("segment numbers follow the labels 1..N")  # pragma: no cover
    source = series.headers
    first = source[0]
    seg = hd.seg.Segmentation(
        source_images=source,
        pixel_array=pixels,
        segmentation_type={"binary": "BINARY", "labelmap": "LABELMAP", "fractional": "FRACTIONAL"}[seg_type],
        segment_descriptions=descriptions,
        series_instance_uid=hd.UID(),
        series_number=int(first.get("SeriesNumber", 0) or 0) + 1000,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="tilewise",
        manufacturer_model_name=model[:64],
        software_versions=version,
        device_serial_number="0",
        content_description=None if provenance is None else provenance.descrip()[:64],
        content_creator_name="tilewise^",
        content_label="TILEWISE",
        series_description=f"tilewise {model} segmentation"[:64],
        omit_empty_frames=False,
    )
    seg.save_as(path)
    logger.info(
        "wrote DICOM SEG %s: %d segment(s), %d frame(s), %s, referencing series %s",
        seg_type, len(descriptions), int(seg.NumberOfFrames), seg.SOPInstanceUID, series.series_uid,
    )  # fmt: skip

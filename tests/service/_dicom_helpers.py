"""A volume written as a DICOM series with pydicom (MR Image Storage, one file per slice), and the
labels a DICOM SEG holds read back with highdicom, its frames mapped to slices by their positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

_LPS = np.diag([-1.0, -1.0, 1.0])


def write_series(
    data: np.ndarray, affine: np.ndarray, folder: Path, *, description: str = "T1"
) -> list[Path]:
    """Write ``data`` ``(X, Y, Z)`` (int16) with the RAS ``affine`` as one file per slice ``k``.

    Rows run along Y, columns along X: ``pixel_array[j, i] = data[i, j, k]``. Positions and
    orientation come from the affine (RAS to LPS), written with 16-character DS values.
    """
    folder.mkdir(parents=True, exist_ok=True)
    study, series, frame_of_reference = generate_uid(), generate_uid(), generate_uid()
    m = _LPS @ affine[:3, :3]
    spacing = np.linalg.norm(m, axis=0)
    row_cos, col_cos = m[:, 0] / spacing[0], m[:, 1] / spacing[1]
    paths = []
    for k in range(data.shape[2]):
        position = _LPS @ (affine[:3, :3] @ [0.0, 0.0, k] + affine[:3, 3])
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = MRImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = pydicom.Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = MRImageStorage, meta.MediaStorageSOPInstanceUID
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series, frame_of_reference
        ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = "MNI^152", "MNI152", "", "O"
        ds.StudyDate, ds.StudyTime, ds.AccessionNumber, ds.ReferringPhysicianName = (
            "20260101",
            "120000",
            "",
            "",
        )
        ds.StudyID, ds.SeriesNumber, ds.InstanceNumber = "1", 1, k + 1
        ds.Modality, ds.Manufacturer, ds.SeriesDescription = "MR", "tests", description
        ds.ImageType = ["ORIGINAL", "PRIMARY", "OTHER"]
        ds.ImagePositionPatient = [pydicom.valuerep.format_number_as_ds(float(v)) for v in position]
        ds.ImageOrientationPatient = [
            pydicom.valuerep.format_number_as_ds(float(v)) for v in (*row_cos, *col_cos)
        ]
        ds.PixelSpacing = [float(spacing[1]), float(spacing[0])]
        ds.SliceThickness = float(spacing[2])
        ds.Rows, ds.Columns = data.shape[1], data.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.PixelData = np.ascontiguousarray(data[:, :, k].T.astype("<i2")).tobytes()
        path = folder / f"{k:04d}.dcm"
        ds.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths


def seg_labels(
    seg_path: Path, series_positions: np.ndarray, normal: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    """The label volume ``(X, Y, Z)`` a BINARY or LABELMAP SEG holds (highdicom reads it), each
    frame placed on the slice whose position (along ``normal``) it carries."""
    import highdicom as hd

    seg = hd.seg.segread(seg_path)
    pixels = np.asarray(seg.pixel_array)
    if pixels.ndim == 2:
        pixels = pixels[None]
    along = series_positions @ normal
    labels = np.zeros(shape, np.uint16)
    labelmap = str(seg.SegmentationType) == "LABELMAP"
    for f, item in enumerate(seg.PerFrameFunctionalGroupsSequence):
        position = np.array(item.PlanePositionSequence[0].ImagePositionPatient, dtype=float)
        k = int(np.argmin(np.abs(along - float(position @ normal))))
        assert abs(along[k] - float(position @ normal)) < 1e-3
        assert np.abs(series_positions[k] - position).max() < 1e-3
        if labelmap:
            labels[:, :, k] = pixels[f].T
        else:
            number = int(item.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
            labels[:, :, k][pixels[f].T > 0] = number
    return labels

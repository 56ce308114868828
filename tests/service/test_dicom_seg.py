"""DICOM SEG out (issue 22 item 2) through the built-in ``tissue-3d``, and provenance (item 4).

A crop of nilearn's MNI152 T1 (1 mm) is written as a DICOM series with pydicom in several
orientations (axial, sagittal, a flipped coronal, and an oblique one rotated 20 degrees): the
DICOM path's labels equal the NIfTI path's for the same volume voxel for voxel, and the SEG, read
back with highdicom and its frames placed by their ImagePositionPatient, holds exactly those
labels (Dice 1.0 per segment). Crops keep each run small (about 150 k voxels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest

pytest.importorskip("highdicom")

import highdicom as hd  # noqa: E402
import pydicom  # noqa: E402
from _dicom_helpers import seg_labels, write_series  # noqa: E402

from models import ModelRepository, parse_params  # noqa: E402
from service.codecs import decode  # noqa: E402
from service.errors import BadParameterError  # noqa: E402
from service.pipeline import run_file  # noqa: E402

BOX = (slice(70, 126), slice(90, 150), slice(66, 112))  # 56 x 60 x 46 voxels of grey and white matter


@pytest.fixture(scope="module")
def tissue() -> Any:
    return ModelRepository("/nonexistent", device="cpu").get("tissue-3d")


@pytest.fixture(scope="module")
def crop(mni152_path: Path) -> tuple[np.ndarray, np.ndarray]:
    img = nib.load(mni152_path)
    data = np.rint(np.asarray(img.get_fdata())[BOX]).astype(np.int16)
    affine = img.affine.copy()
    affine[:3, 3] = img.affine[:3, :3] @ [s.start for s in BOX] + img.affine[:3, 3]
    return data, affine


def _reorient(
    data: np.ndarray, affine: np.ndarray, perm: tuple[int, ...], flip: int | None
) -> tuple[np.ndarray, np.ndarray]:
    data = np.transpose(data, perm)
    out = affine.copy()
    out[:, :3] = affine[:, list(perm)]
    if flip is not None:
        out[:3, 3] = out[:3, :3] @ np.eye(3)[flip] * (data.shape[flip] - 1) + out[:3, 3]
        out[:3, flip] *= -1
        data = np.flip(data, flip)
    return np.ascontiguousarray(data), out


def _rotated(affine: np.ndarray, degrees: float) -> np.ndarray:
    t = np.radians(degrees)
    rot = np.eye(4)
    rot[1:3, 1:3] = [[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]
    return rot @ affine


ORIENTATIONS = {
    "axial": ((0, 1, 2), None, 0.0),
    "sagittal": ((1, 2, 0), None, 0.0),
    "coronal-flipped": ((0, 2, 1), 1, 0.0),
    "oblique-20": ((0, 1, 2), None, 20.0),
}


@pytest.mark.parametrize("orientation", list(ORIENTATIONS))
def test_tissue_labels_and_seg_match_the_nifti_path(
    orientation: str, crop: tuple[np.ndarray, np.ndarray], tissue: Any, tmp_path: Path
) -> None:
    perm, flip, degrees = ORIENTATIONS[orientation]
    data, affine = _reorient(*crop, perm, flip)
    affine = _rotated(affine, degrees)
    series = tmp_path / "series"
    write_series(data, affine, series)
    volume = decode(series)
    assert np.abs(volume.affine - affine).max() < 1e-4  # DS values hold 16 characters
    np.testing.assert_array_equal(volume.data[0], data)
    nifti = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(data, volume.affine), nifti)

    by_nifti = nib.load(run_file(tissue, nifti, tmp_path / "n", parse_params({})).path)
    by_dicom = nib.load(run_file(tissue, series, tmp_path / "d", parse_params({"format": "nii.gz"})).path)
    labels = np.asarray(by_nifti.dataobj)
    np.testing.assert_array_equal(np.asarray(by_dicom.dataobj), labels)
    np.testing.assert_allclose(by_dicom.affine, by_nifti.affine, atol=1e-6)
    assert set(np.unique(labels)) == {0, 1, 2}

    result = run_file(tissue, series, tmp_path / "s", parse_params({"format": "dicom-seg"}))
    assert result.path.name == "s.dcm" and result.media_type == "application/dicom"
    found = volume.info["dicom"]
    positions = np.array([f.position for f in found.frames])
    normal = np.cross(found.frames[0].orientation[:3], found.frames[0].orientation[3:])
    from_seg = seg_labels(result.path, positions, normal, labels.shape)
    for label in (1, 2):
        a, b = from_seg == label, labels == label
        assert 2 * np.sum(a & b) / (a.sum() + b.sum()) == 1.0
    np.testing.assert_array_equal(from_seg, labels)

    seg = hd.seg.segread(result.path)
    source = pydicom.dcmread(next(series.iterdir()), stop_before_pixels=True)
    assert seg.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert seg.StudyInstanceUID == source.StudyInstanceUID
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == source.SeriesInstanceUID
    assert len(seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence) == data.shape[2]
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["grey matter", "white matter"]
    algorithm = seg.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0]
    assert algorithm.AlgorithmName == "tissue-3d"
    assert tissue.spec.sha256 in algorithm.AlgorithmParameters
    assert seg.ContentDescription == f"tilewise tissue-3d sha256:{tissue.spec.sha256[:12]}"
    assert all("RecommendedDisplayCIELabValue" in s for s in seg.SegmentSequence)


def test_labelmap_fractional_and_refusals(
    crop: tuple[np.ndarray, np.ndarray], tissue: Any, tmp_path: Path
) -> None:
    data, affine = crop
    data, affine = data[8:40, 10:42, 8:36], affine.copy()
    affine[:3, 3] = affine[:3, :3] @ [8, 10, 8] + affine[:3, 3]
    series = tmp_path / "series"
    write_series(data, affine, series)
    volume = decode(series)
    labels = np.asarray(nib.load(run_file(tissue, series, tmp_path / "n", parse_params({})).path).dataobj)
    positions = np.array([f.position for f in volume.info["dicom"].frames])
    normal = np.array([0.0, 0.0, 1.0])
    result = run_file(
        tissue, series, tmp_path / "l", parse_params({"format": "dicom-seg", "seg_type": "labelmap"})
    )
    assert str(hd.seg.segread(result.path).SegmentationType) == "LABELMAP"
    np.testing.assert_array_equal(seg_labels(result.path, positions, normal, labels.shape), labels)
    params = parse_params({"format": "dicom-seg", "output": "probabilities"})
    fractional = hd.seg.segread(run_file(tissue, series, tmp_path / "f", params).path)
    assert str(fractional.SegmentationType) == "FRACTIONAL" and fractional.number_of_segments == 2
    nifti = tmp_path / "v.nii.gz"
    nib.save(nib.Nifti1Image(data, affine), nifti)
    with pytest.raises(BadParameterError, match="needs a DICOM series"):
        run_file(tissue, nifti, tmp_path / "x", parse_params({"format": "dicom-seg"}))
    with pytest.raises(BadParameterError, match="seg_type=fractional needs output=probabilities"):
        run_file(
            tissue, series, tmp_path / "y", parse_params({"format": "dicom-seg", "seg_type": "fractional"})
        )


def test_provenance_in_nifti_png_tiff(tmp_path: Path) -> None:
    import tifffile
    from PIL import Image

    repo = ModelRepository("/nonexistent", device="cpu")
    volume = tmp_path / "v.nii.gz"
    nib.save(nib.Nifti1Image(np.arange(5 * 6 * 7, dtype=np.float32).reshape(5, 6, 7), np.eye(4)), volume)
    out = nib.load(run_file(repo.get("gaussian-3d"), volume, tmp_path / "g", parse_params({})).path)
    descrip = out.header["descrip"].tobytes().rstrip(b"\0").decode()
    assert descrip.startswith("tilewise gaussian-3d sha256:") and len(descrip.split(":")[1]) == 12
    (extension,) = [e for e in out.header.extensions if e.get_code() == 6]
    record = json.loads(extension.get_content())["tilewise"]
    assert record["model"] == "gaussian-3d" and record["weights_sha256"].startswith(descrip.split(":")[1])
    assert record["plan"].startswith("tile=") and record["tilewise_version"]
    image = tmp_path / "i.png"
    Image.fromarray(np.arange(35 * 29, dtype=np.uint8).reshape(35, 29)).save(image)
    model2d = repo.get("gaussian-2d")
    tiff = run_file(model2d, image, tmp_path / "t", parse_params({"format": "tiff"})).path
    with tifffile.TiffFile(tiff) as tf:
        assert json.loads(tf.pages[0].description)["tilewise"]["model"] == "gaussian-2d"
    png = run_file(model2d, image, tmp_path / "p", parse_params({"format": "png", "output": "labels"})).path
    assert json.loads(Image.open(png).text["tilewise"])["tilewise"]["model"] == "gaussian-2d"

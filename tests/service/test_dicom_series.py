"""DICOM series in (issue 22 item 1): real files that pydicom and pydicom-data ship, read as
``dcm2niix`` (Debian's, the oracle) reads them, and every fault of a series refused by name.

Geometry: both volumes are brought to the closest canonical (RAS) orientation with nibabel, then
the affines agree within 1e-4 mm and the voxels exactly (float32 rescale: within 1e-6 relative).
dcm2niix has no JPEG-LS codec and fails on one JPEG 2000 file: those compressed files are compared
with dcm2niix's conversion of their uncompressed twin, which pydicom-data ships beside them.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

pydicom = pytest.importorskip("pydicom")

from service.codecs import decode, probe  # noqa: E402
from service.errors import DicomSeriesError  # noqa: E402

TEST_FILES = Path(pydicom.data.__file__).parent / "test_files"
DIRTESTS = TEST_FILES / "dicomdirtests"
CT5N = DIRTESTS / "98892001" / "CT5N"  # 5 axial CT slices, 2.5 mm apart


def _store(name: str) -> Path:
    return Path(pydicom.data.get_testdata_file(name))


def _dcm2niix(source: Path, tmp: Path) -> nib.Nifti1Image:
    if shutil.which("dcm2niix") is None:
        pytest.skip("dcm2niix is not installed (apt-get install dcm2niix; .ci/run installs it)")
    folder = source
    if source.is_file():
        folder = tmp / "in"
        folder.mkdir()
        shutil.copy(source, folder / source.name)
    out = tmp / "out"
    out.mkdir()
    subprocess.run(
        ["dcm2niix", "-z", "n", "-f", "%s", "-o", str(out), str(folder)], check=True, capture_output=True
    )
    (nii,) = glob.glob(str(out / "*.nii"))
    return nib.load(nii)


def _same_geometry(mine: object, ref: nib.Nifti1Image) -> tuple[float, float]:
    ours = nib.as_closest_canonical(nib.Nifti1Image(np.asarray(mine.data[0]), mine.affine))
    theirs = nib.as_closest_canonical(ref)
    a = np.asarray(ours.dataobj, dtype=np.float64)
    b = np.asarray(theirs.get_fdata(), dtype=np.float64).reshape(a.shape)
    affine_err = float(np.abs(ours.affine - theirs.affine).max())
    value_err = float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
    return affine_err, value_err


@pytest.mark.parametrize(
    ("source", "twin"),
    [
        (CT5N, None),
        (TEST_FILES / "CT_small.dcm", None),
        (TEST_FILES / "MR_small.dcm", None),
        (TEST_FILES / "MR_small_RLE.dcm", None),  # RLE Lossless
        (TEST_FILES / "MR_small_jp2klossless.dcm", None),  # JPEG 2000 lossless
        (TEST_FILES / "MR_small_jpeg_ls_lossless.dcm", TEST_FILES / "MR_small.dcm"),  # JPEG-LS
        ("693_UNCR.dcm", None),  # CT 512x512
        ("693_J2KR.dcm", None),  # the same CT, JPEG 2000 lossless
        ("MR2_UNCR.dcm", None),  # oblique MR 1024x1024, RescaleSlope 3.77
        ("MR2_J2KR.dcm", "MR2_UNCR.dcm"),
        ("eCT_Supplemental.dcm", None),  # enhanced CT, 2 frames, per-frame positions
    ],
    ids=lambda p: getattr(p, "name", str(p)),
)
def test_decodes_like_dcm2niix(source: Path | str, twin: Path | str | None, tmp_path: Path) -> None:
    source = _store(source) if isinstance(source, str) else source
    twin = _store(twin) if isinstance(twin, str) else twin
    volume = decode(source)
    assert volume.kind == "dicom" and volume.spatial_dims == 3
    affine_err, value_err = _same_geometry(volume, _dcm2niix(twin or source, tmp_path))
    assert affine_err < 1e-4
    assert value_err < 1e-6


def test_zip_and_folder_and_ras_convention(tmp_path: Path) -> None:
    archive = tmp_path / "series.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(CT5N.iterdir()):
            zf.write(path, f"CT5N/{path.name}")
        zf.writestr("README.txt", "not DICOM")
    folder, zipped = decode(CT5N), decode(archive)
    np.testing.assert_array_equal(folder.data, zipped.data)
    np.testing.assert_array_equal(folder.affine, zipped.affine)
    first = pydicom.dcmread(
        sorted(CT5N.iterdir(), key=lambda p: float(pydicom.dcmread(p).ImagePositionPatient[2]))[0]
    )
    ipp = np.array(first.ImagePositionPatient, dtype=float)
    np.testing.assert_allclose(folder.affine[:3, 3], [-ipp[0], -ipp[1], ipp[2]])  # LPS -> RAS
    expected = first.pixel_array.T * float(first.RescaleSlope) + float(first.RescaleIntercept)
    np.testing.assert_array_equal(folder.data[0, :, :, 0], expected.astype(np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["series.zip"]  # nothing extracted


def _fault(source: Path, **options: str) -> str:
    with pytest.raises(DicomSeriesError) as info:
        probe(source, dicom=options)
    return str(info.value)


def test_several_series_are_listed_and_series_chooses() -> None:
    message = _fault(DIRTESTS)
    assert message.startswith("several series: ") and "choose one with series=UID" in message
    uid = str(pydicom.dcmread(next(CT5N.iterdir())).SeriesInstanceUID)
    assert uid in message
    assert probe(DIRTESTS, dicom={"series": uid}).spatial_shape == (16, 16, 5)
    assert "is not in the upload" in _fault(CT5N, series="1.2.3")


def test_localizers_are_dropped_and_said() -> None:
    header = probe(DIRTESTS / "98892001")  # CT2N (two localizers) and CT5N
    assert header.spatial_shape == (16, 16, 5)
    assert any("localizer series" in note for note in header.info["notes"])


def test_missing_slice_names_the_gap() -> None:
    assert "missing slice between z=-99.48 and z=103.02" in _fault(DIRTESTS / "77654033" / "CT2")


def test_mixed_orientations() -> None:
    assert _fault(DIRTESTS / "98892003" / "MR700").startswith("mixed orientations: ")


def _copy_series(tmp: Path, edit: object) -> Path:
    out = tmp / "series"
    out.mkdir(parents=True)
    for k, path in enumerate(
        sorted(CT5N.iterdir(), key=lambda p: float(pydicom.dcmread(p).ImagePositionPatient[2]))
    ):
        ds = pydicom.dcmread(path)
        edit(ds, k)
        ds.save_as(out / f"{k:03d}.dcm")
    return out


def test_gantry_tilt_refused_unless_resampled(tmp_path: Path) -> None:
    row = 0.488281  # CT5N's pixel spacing: each slice one row further in y (11.1 degrees)

    def shear(ds: object, k: int) -> None:
        ds.ImagePositionPatient = [float(ds.ImagePositionPatient[0]), -143.0 + row * k, -1.2375 + 2.5 * k]

    series = _copy_series(tmp_path, shear)
    assert "gantry tilt 11.1 degrees" in _fault(series)
    volume = decode(series, dicom={"tilt": "resample"})
    step = volume.affine[:3, 2]
    assert np.allclose(step[:2], 0.0) and abs(step[2] - 2.5) < 1e-6  # along the normal now
    plain = decode(CT5N)  # the same pixels, unsheared: slice m (ascending z) is m rows off
    for m in range(5):
        np.testing.assert_allclose(volume.data[0, :, m:, m], plain.data[0, :, : 16 - m, m], atol=1e-3)


def test_uneven_spacing_and_duplicates(tmp_path: Path) -> None:
    def uneven(ds: object, k: int) -> None:
        if k == 4:
            ds.ImagePositionPatient = [-72.2, -143.0, 8.7625 - 1.0]

    assert _fault(_copy_series(tmp_path / "a", uneven)).startswith("uneven slice spacing: 1.500 mm")

    def twice(ds: object, k: int) -> None:
        if k == 1:
            ds.ImagePositionPatient = [-72.2, -143.0, -1.2375]

    assert "two images at the same position" in _fault(_copy_series(tmp_path / "b", twice))


def test_mixed_sizes_and_no_pixel_data(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    small = pydicom.dcmread(TEST_FILES / "MR_small.dcm")  # 64x64
    other = pydicom.dcmread(TEST_FILES / "CT_small.dcm")  # 128x128
    other.SeriesInstanceUID = small.SeriesInstanceUID
    other.ImageOrientationPatient = small.ImageOrientationPatient
    small.save_as(folder / "a.dcm")
    other.save_as(folder / "b.dcm")
    assert _fault(folder).startswith("mixed sizes: 64x64 and 128x128")
    empty = tmp_path / "nopixels"
    empty.mkdir()
    shutil.copy(TEST_FILES / "rtstruct.dcm", empty)
    shutil.copy(DIRTESTS / "DICOMDIR", empty)
    assert _fault(empty).startswith("no pixel data")


def test_cli_infer_reads_a_series_folder(tmp_path: Path) -> None:
    from service.cli import main

    out = tmp_path / "out.nii.gz"
    assert main(["infer", str(CT5N), str(out), "--model", "gaussian-3d", "--tile", "16"]) == 0
    img = nib.load(out)
    assert img.shape == (16, 16, 5) and np.abs(img.affine - decode(CT5N).affine).max() < 1e-5
    several = main(["infer", str(DIRTESTS), str(tmp_path / "x.nii.gz"), "--model", "gaussian-3d"])
    chosen = main(["infer", str(DIRTESTS), str(tmp_path / "y.nii.gz"), "--model", "gaussian-3d", "--series",
                   str(pydicom.dcmread(next(CT5N.iterdir())).SeriesInstanceUID)])  # fmt: skip
    assert several != 0 and chosen == 0 and not (tmp_path / "x.nii.gz").exists()

"""Inputs from the field that answered 500 or a silent wrong answer (issue 23 items 10 and 11).

- item 10: a NIfTI whose ``vox_offset`` lies below 352 (inside the header: -1000, 0.5, 100, 351)
  decodes (nibabel's rule: the voxels start at 352 at the earliest), and its output header is
  written with the offset nibabel computes, not the copied one (it was a 500 from ``nib.save``).
- item 11: a ``.nii.gz`` whose trailer has a wrong CRC-32 and a NIfTI of 1e-6 mm voxels are
  refused (422), no longer answered; so are a TIFF whose pages differ in shape (was page 1 only)
  and a TIFF of 1x1 pages (was a 20000x1 image).
"""

from __future__ import annotations

import struct
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile

from models import ModelRepository, parse_params
from service.codecs import decode, encode, probe
from service.errors import DecodeError, UnusableInputError
from service.pipeline import run_file

VOX_OFFSET_AT = 108  # byte offset of the float32 vox_offset in a NIfTI-1 header


def _with_vox_offset(folder: Path, value: float, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    data = rng.integers(0, 1000, size=(11, 13, 7)).astype(np.int16)
    path = folder / "in.nii"
    nib.save(nib.Nifti1Image(data, np.diag([1.5, 1.5, 2.0, 1.0])), path)
    raw = bytearray(path.read_bytes())
    assert struct.unpack("<f", raw[VOX_OFFSET_AT : VOX_OFFSET_AT + 4])[0] == 352.0
    raw[VOX_OFFSET_AT : VOX_OFFSET_AT + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))
    return path, data


@pytest.mark.parametrize("value", [-1000.0, 0.5, 100.0, 351.0])
@pytest.mark.parametrize("suffix", ["nii", "nii.gz"])
def test_a_vox_offset_inside_the_header_is_not_copied(
    tmp_path: Path, rng: np.random.Generator, value: float, suffix: str
) -> None:
    path, data = _with_vox_offset(tmp_path, value, rng)
    volume = decode(path)
    np.testing.assert_array_equal(volume.data[0], data)
    out = tmp_path / f"out.{suffix}"
    encode(volume, volume.data.astype(np.float32), suffix, out)
    written = nib.load(out)
    if suffix == "nii":  # on disk (nibabel's loaded header says 0: "work it out")
        assert struct.unpack("<f", out.read_bytes()[VOX_OFFSET_AT : VOX_OFFSET_AT + 4])[0] >= 352
    np.testing.assert_array_equal(np.asarray(written.dataobj), data.astype(np.float32))
    np.testing.assert_array_equal(written.affine, np.diag([1.5, 1.5, 2.0, 1.0]))


def test_a_vox_offset_of_100_through_the_pipeline(tmp_path: Path, rng: np.random.Generator) -> None:
    path, data = _with_vox_offset(tmp_path, 100.0, rng)
    model = ModelRepository("/nonexistent", device="cpu").get("gaussian-3d")
    result = run_file(model, path, tmp_path / "out", parse_params({}))
    assert nib.load(result.path).shape == data.shape


def test_a_gzip_trailer_with_a_wrong_crc_is_refused(tmp_path: Path, rng: np.random.Generator) -> None:
    """Issue 23 item 11: the stream is read to its end, so gzip checks its CRC-32 (was a 200)."""
    data = rng.normal(size=(9, 10, 11)).astype(np.float32)
    path = tmp_path / "in.nii.gz"
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    np.testing.assert_array_equal(decode(path).data[0], data)
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0xFF  # the CRC-32 of the trailer (then the length, 4 bytes)
    path.write_bytes(bytes(raw))
    with pytest.raises(DecodeError, match="(?i)crc"):
        decode(path)


@pytest.mark.parametrize("zoom", [1e-6, 1e-9, 1e7])
def test_implausible_voxel_sizes_are_refused_at_probe(tmp_path: Path, zoom: float) -> None:
    """Issue 23 item 11: 1e-6 mm voxels ran on a 1 x 1 x 1 model grid and returned labels."""
    path = tmp_path / "tiny.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((8, 8, 8), np.float32), np.diag([zoom, zoom, zoom, 1.0])), path)
    with pytest.raises(UnusableInputError, match="implausible voxel size"):
        probe(path)
    with pytest.raises(UnusableInputError, match="implausible voxel size"):
        decode(path)
    nib.save(nib.Nifti1Image(np.ones((8, 8, 8), np.float32), np.diag([0.5, 0.5, 3.0, 1.0])), path)
    assert probe(path).spatial_shape == (8, 8, 8)


def test_tiff_pages_of_different_shapes_are_refused(tmp_path: Path) -> None:
    """Issue 23 item 11: was computed from page 1 only, with no word."""
    path = tmp_path / "mixed.tif"
    with tifffile.TiffWriter(path) as tif:
        tif.write(np.zeros((20, 30), np.uint8))
        tif.write(np.zeros((25, 31), np.uint8))
    with pytest.raises(UnusableInputError, match=r"2 images of shapes \(20, 30\), \(25, 31\)"):
        probe(path)
    with pytest.raises(UnusableInputError, match="2 images"):
        decode(path)
    same = tmp_path / "stack.tif"
    tifffile.imwrite(
        same, np.arange(4 * 20 * 30, dtype=np.uint16).reshape(4, 20, 30), photometric="minisblack"
    )
    assert decode(same).data.shape == (1, 4, 20, 30)  # one shape: a volume of 4 pages


@pytest.mark.parametrize("pages", [200, 20_000])
def test_tiff_of_one_pixel_pages_is_refused(tmp_path: Path, pages: int) -> None:
    """Issue 23 item 11: 20,000 1x1 pages became a 20000x1 image."""
    column = tmp_path / "column.tif"
    tifffile.imwrite(column, np.ones((pages, 1, 1), np.uint8))
    with pytest.raises(UnusableInputError, match="at least 2 pixels per axis"):
        decode(column)
    separate = tmp_path / "separate.tif"
    with tifffile.TiffWriter(separate) as tif:
        for _ in range(min(pages, 300)):
            tif.write(np.ones((1, 1), np.uint8), contiguous=False)
    with pytest.raises(UnusableInputError):
        decode(separate)

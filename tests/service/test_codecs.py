"""Codecs in process: detection by content, NIfTI and image decoding, encoders, limits."""

from __future__ import annotations

import gzip
import io
import struct
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile
from PIL import Image

from service.codecs import DecodedVolume, decode, default_format, encode, sniff
from service.errors import (
    BadParameterError,
    DecodeError,
    EmptyBodyError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    UnusableInputError,
)
from service.sniff import sniff_bytes, sniff_gzipped


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _png_bytes(array: np.ndarray, **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG", **save)
    return buffer.getvalue()


# -- sniffing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        pytest.param(b"\x89PNG\r\n\x1a\n" + b"\0" * 8, "png", id="png"),
        pytest.param(b"\xff\xd8\xff\xe0" + b"\0" * 8, "jpeg", id="jpeg"),
        pytest.param(b"II*\x00" + b"\0" * 8, "tiff", id="tiff-le"),
        pytest.param(b"MM\x00*" + b"\0" * 8, "tiff", id="tiff-be"),
        pytest.param(b"II+\x00" + b"\0" * 8, "tiff", id="bigtiff"),
        pytest.param(b"hello world", None, id="text"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_sniff_bytes(head: bytes, kind: str | None) -> None:
    found = sniff_bytes(head)
    assert (found.kind if found else None) == kind


def test_sniff_nifti_ignores_names(tmp_path: Path) -> None:
    img = nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4))
    plain = _write(tmp_path / "scan.png", img.to_bytes())
    zipped = _write(tmp_path / "scan.txt", gzip.compress(img.to_bytes()))
    big = nib.Nifti1Image(np.zeros((4, 4, 4), ">i2"), np.eye(4), header=nib.Nifti1Header(endianness=">"))
    two = nib.Nifti2Image(np.zeros((4, 4, 4), np.float32), np.eye(4))
    assert sniff(plain).kind == "nifti" and not sniff(plain).gzipped
    assert sniff(zipped).gzipped and sniff(zipped).nifti_version == 1
    assert sniff(_write(tmp_path / "a", big.to_bytes())).byteorder == ">"
    assert sniff(_write(tmp_path / "b", two.to_bytes())).nifti_version == 2
    assert sniff(_write(tmp_path / "c", gzip.compress(b"not an image" * 100))) is None
    pair = bytearray(img.to_bytes()[:348])
    pair[344:348] = b"ni1\x00"
    assert sniff(_write(tmp_path / "d", bytes(pair))) is None  # .hdr of a pair: no voxels here


def test_sniff_gzipped_by_content(tmp_path: Path) -> None:
    img = nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4))
    assert sniff_gzipped(_write(tmp_path / "scan.nii.gz", gzip.compress(img.to_bytes())))
    assert not sniff_gzipped(_write(tmp_path / "scan.gz", img.to_bytes()))  # the name says nothing
    assert not sniff_gzipped(_write(tmp_path / "text.gz", gzip.compress(b"not an image" * 100)))


def test_decode_refuses_empty_unknown_and_truncated(tmp_path: Path) -> None:
    with pytest.raises(EmptyBodyError):
        decode(_write(tmp_path / "empty", b""))
    with pytest.raises(UnsupportedMediaTypeError):
        decode(_write(tmp_path / "text", b"just some text\n" * 50))
    raw = gzip.compress(nib.Nifti1Image(np.ones((30, 30, 30), np.float32), np.eye(4)).to_bytes())
    for cut in (40, len(raw) // 2):
        with pytest.raises(DecodeError):
            decode(_write(tmp_path / f"cut{cut}", raw[:cut]))
    png = _png_bytes(np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8))
    with pytest.raises(DecodeError):
        decode(_write(tmp_path / "cut.png", png[: len(png) // 2]))


# -- NIfTI ----------------------------------------------------------------------------------------


def test_nifti_scaling_and_byte_order(tmp_path: Path) -> None:
    stored = np.arange(60, dtype=np.int16).reshape(3, 4, 5)
    img = nib.Nifti1Image(stored.astype(">i2"), np.eye(4), header=nib.Nifti1Header(endianness=">"))
    img.header.set_slope_inter(2.0, -1024.0)
    volume = decode(_write(tmp_path / "x.nii", img.to_bytes()))
    assert volume.data.dtype == np.float32 and volume.data.dtype.isnative
    np.testing.assert_array_equal(volume.data[0], stored * 2.0 - 1024.0)
    unscaled = decode(_write(tmp_path / "y.nii", nib.Nifti1Image(stored.astype(">i2"), np.eye(4)).to_bytes()))
    assert unscaled.data.dtype == np.int16 and unscaled.data.dtype.isnative


def test_nifti_layouts(tmp_path: Path) -> None:
    four = nib.Nifti1Image(np.zeros((5, 6, 7, 3), np.float32), np.eye(4))
    assert decode(_write(tmp_path / "4d", four.to_bytes())).data.shape == (3, 5, 6, 7)
    flat = decode(
        _write(tmp_path / "2d", nib.Nifti1Image(np.zeros((5, 6, 1), np.float32), np.eye(4)).to_bytes())
    )
    assert flat.data.shape == (1, 5, 6, 1) and flat.single_slice
    trailing = nib.Nifti1Image(np.zeros((5, 6, 7, 1), np.float32), np.eye(4))
    assert decode(_write(tmp_path / "t", trailing.to_bytes())).data.shape == (1, 5, 6, 7)
    with pytest.raises(UnusableInputError):
        decode(
            _write(
                tmp_path / "6d",
                nib.Nifti1Image(np.zeros((2, 2, 2, 2, 2, 2), np.float32), np.eye(4)).to_bytes(),
            )
        )
    complex_img = nib.Nifti1Image(np.zeros((3, 3, 3), np.complex64), np.eye(4))
    with pytest.raises(UnusableInputError):
        decode(_write(tmp_path / "c", complex_img.to_bytes()))


def test_max_voxels_is_checked_from_the_header(tmp_path: Path) -> None:
    """A header declaring 2000^3 voxels in a tiny file: refused as too large, not read."""
    header = nib.Nifti1Header()
    header.set_data_shape((2000, 2000, 2000))
    header.set_data_dtype(np.float32)
    raw = header.binaryblock + b"\0" * 4 + b"\0" * 1000  # vox_offset 352, then far too few bytes
    path = _write(tmp_path / "huge.nii.gz", gzip.compress(raw))
    with pytest.raises(PayloadTooLargeError, match="max_voxels"):
        decode(path, max_voxels=512**3)


def test_nifti_encode_keeps_geometry(tmp_path: Path) -> None:
    affine = np.array([[0.0, -0.8, 0, 10], [0.9, 0, 0, -20], [0, 0, 3.0, 5], [0, 0, 0, 1]])
    img = nib.Nifti1Image(np.zeros((6, 5, 4), np.int16), affine)
    img.header.set_qform(affine, code=1)
    img.header.set_sform(affine, code=4)
    img.header.set_xyzt_units("mm", "msec")
    img.header.set_slope_inter(3.0, 7.0)
    img.header["cal_max"] = 500
    source = _write(tmp_path / "in.nii.gz", gzip.compress(img.to_bytes()))
    volume = decode(source)
    ref = nib.load(source)
    labels = np.ones((6, 5, 4), np.uint8)
    probs = np.random.default_rng(0).random((2, 6, 5, 4), dtype=np.float32)
    for name, array, shape, dtype in (
        ("labels.nii.gz", labels, (6, 5, 4), np.uint8),
        ("probs.nii", probs, (6, 5, 4, 2), np.float32),
    ):
        encode(volume, array, "nii.gz" if name.endswith(".gz") else "nii", tmp_path / name)
        out = nib.load(tmp_path / name)
        assert out.shape == shape and out.get_data_dtype() == dtype
        assert np.array_equal(out.affine, ref.affine)
        assert np.array_equal(out.get_qform(), ref.get_qform()) and np.array_equal(
            out.get_sform(), ref.get_sform()
        )
        assert int(out.header["qform_code"]) == 1 and int(out.header["sform_code"]) == 4
        assert out.header.get_xyzt_units() == ("mm", "msec")
        assert out.header.get_slope_inter() == (None, None) and float(out.header["cal_max"]) == 0.0
    np.testing.assert_array_equal(
        np.asarray(nib.load(tmp_path / "probs.nii").dataobj), np.moveaxis(probs, 0, -1)
    )


def test_two_dimensional_nifti_comes_back_two_dimensional(tmp_path: Path) -> None:
    img = nib.Nifti1Image(np.zeros((7, 9), np.float32), np.eye(4))
    volume = decode(_write(tmp_path / "flat.nii", img.to_bytes()))
    assert volume.data.shape == (1, 7, 9)  # two spatial axes: a 3D model refuses it (422)
    encode(volume, np.zeros((1, 7, 9), np.float32), "nii", tmp_path / "out.nii")
    assert nib.load(tmp_path / "out.nii").shape == (7, 9)


# -- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "mode", "shape", "dtype"),
    [
        pytest.param(np.zeros((10, 12), np.uint8), "L", (1, 10, 12), np.uint8, id="grey8"),
        pytest.param(np.full((10, 12), 40000, np.uint16), "I;16", (1, 10, 12), np.uint16, id="grey16"),
        pytest.param(np.zeros((10, 12, 3), np.uint8), "RGB", (3, 10, 12), np.uint8, id="rgb"),
        pytest.param(np.zeros((10, 12, 4), np.uint8), "RGBA", (3, 10, 12), np.uint8, id="rgba-drops-alpha"),
    ],
)
def test_png_modes(tmp_path: Path, array: np.ndarray, mode: str, shape: tuple[int, ...], dtype: type) -> None:
    path = _write(tmp_path / "x.png", _png_bytes(array))
    with Image.open(path) as image:
        assert image.mode == mode
    volume = decode(path)
    assert volume.kind == "png" and volume.data.shape == shape and volume.data.dtype == dtype
    if dtype == np.uint16:
        assert int(volume.data.max()) == 40000


def test_palette_and_bilevel_images(tmp_path: Path) -> None:
    palette = Image.fromarray(np.arange(120, dtype=np.uint8).reshape(10, 12)).convert("P")
    palette.save(tmp_path / "p.png")
    assert decode(tmp_path / "p.png").data.shape == (3, 10, 12)
    Image.fromarray(np.eye(8, dtype=bool)).save(tmp_path / "b.png")
    bilevel = decode(tmp_path / "b.png").data
    assert bilevel.shape == (1, 8, 8) and set(np.unique(bilevel)) == {0, 255}


def test_jpeg_exif_orientation_is_applied(tmp_path: Path) -> None:
    """Orientation 6 (rotate 90 degrees clockwise for display): width and height swap."""
    pixels = np.zeros((20, 40), np.uint8)
    pixels[:, :10] = 255  # a bright band on the left of the stored image
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(tmp_path / "r.jpg", exif=exif.tobytes(), quality=95)
    volume = decode(tmp_path / "r.jpg")
    assert volume.kind == "jpeg" and volume.data.shape == (1, 40, 20)
    assert volume.data[0, :10].mean() > 200 and volume.data[0, -10:].mean() < 50  # now on top


def test_tiff_pillow_and_tifffile(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    float_grey = rng.random((16, 18), dtype=np.float32)
    tifffile.imwrite(tmp_path / "f.tif", float_grey)
    volume = decode(tmp_path / "f.tif")
    assert volume.data.dtype == np.float32
    np.testing.assert_array_equal(volume.data[0], float_grey)
    float_rgb = rng.random((16, 18, 3), dtype=np.float32)  # Pillow has no float RGB mode
    tifffile.imwrite(tmp_path / "rgb.tif", float_rgb, photometric="rgb")
    volume = decode(tmp_path / "rgb.tif")
    assert volume.info["source"] == "tifffile" and volume.data.shape == (3, 16, 18)
    np.testing.assert_array_equal(np.moveaxis(volume.data, 0, -1), float_rgb)
    stack = rng.integers(0, 4000, (5, 16, 18), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "stack.tif", stack)
    volume = decode(tmp_path / "stack.tif")
    assert volume.data.shape == (1, 5, 16, 18) and volume.spatial_dims == 3


def test_decompression_bomb_limits(tmp_path: Path) -> None:
    def header_only_png(width: int, height: int) -> bytes:
        import zlib

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")

    with pytest.raises(PayloadTooLargeError):
        decode(_write(tmp_path / "bomb.png", header_only_png(100_000, 100_000)))
    small = _write(tmp_path / "small.png", _png_bytes(np.zeros((100, 100), np.uint8)))
    with pytest.raises(PayloadTooLargeError, match="max_image_pixels"):
        decode(small, max_image_pixels=5000)
    with pytest.raises(PayloadTooLargeError, match="max_voxels"):
        decode(small, max_voxels=5000)
    assert decode(small, max_image_pixels=10_000, max_voxels=10_000).data.shape == (1, 100, 100)


def test_image_encoders(tmp_path: Path) -> None:
    path = _write(tmp_path / "in.png", _png_bytes(np.zeros((10, 12), np.uint8), dpi=(300, 300)))
    volume = decode(path)
    labels = np.zeros((10, 12), np.uint8)
    labels[2:5, 3:7] = 1
    encode(volume, labels, "png", tmp_path / "labels.png")
    with Image.open(tmp_path / "labels.png") as image:
        assert image.mode == "P" and image.size == (12, 10)  # palette: values stay the label ids
        assert round(image.info["dpi"][0]) == 300
        np.testing.assert_array_equal(np.asarray(image), labels)
    probs = np.linspace(0, 1, 120, dtype=np.float32).reshape(1, 10, 12)
    encode(volume, probs, "png", tmp_path / "probs.png")
    with Image.open(tmp_path / "probs.png") as image:
        assert image.mode == "I;16" and int(np.asarray(image).max()) == 65535
    encode(volume, probs, "tiff", tmp_path / "probs.tiff")
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "probs.tiff"), probs[0])
    two = np.stack([probs[0], 1 - probs[0]])
    encode(volume, two, "tiff", tmp_path / "two.tiff")
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "two.tiff"), two)
    encode(volume, two, "npy", tmp_path / "two.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "two.npy"), two)
    with pytest.raises(BadParameterError):
        encode(volume, np.zeros((5, 10, 12), np.float32), "png", tmp_path / "five.png")
    with pytest.raises(BadParameterError):
        encode(volume, labels, "jpeg", tmp_path / "x.jpg")


def test_default_format() -> None:
    nifti = DecodedVolume(data=np.zeros((1, 2, 2, 2)), kind="nifti")
    image = DecodedVolume(data=np.zeros((1, 2, 2)), kind="png")
    assert default_format(nifti, "labels") == "nii.gz" and default_format(nifti, "probabilities") == "nii.gz"
    assert default_format(image, "labels") == "png" and default_format(image, "probabilities") == "tiff"

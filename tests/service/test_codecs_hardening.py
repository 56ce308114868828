"""Issue 11, "Files and headers": malformed headers are 422s about the file, limits are checked from
the header before decoding, samples decode exactly (16-bit colour PNG, signed / 32-bit TIFF, NIfTI
(X, Y, Z, 1)), label PNGs are palette images, DICOM is refused with advice.

Malformed NIfTI headers are built with nibabel and byte patching (NIfTI-1 offsets: ``dim`` int16[8]
at 40, ``datatype`` int16 at 70, ``bitpix`` int16 at 72).
"""

from __future__ import annotations

import functools
import gzip
import io
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tifffile
from PIL import Image

from service.codecs import DecodedVolume, Probe, decode, encode, probe, sniff
from service.errors import (
    DecodeError,
    PayloadTooLargeError,
    ServiceError,
    UnusableInputError,
)
from service.http_errors import STATUS, classify

#: Pillow's own decompression-bomb threshold, as PIL.Image defines it.
PILLOW_MAX_IMAGE_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)


def _nifti_bytes(shape: tuple[int, ...] = (4, 5, 6), dtype: type = np.int16) -> bytearray:
    return bytearray(nib.Nifti1Image(np.ones(shape, dtype), np.eye(4)).to_bytes())


def _patched(**fields: tuple[int, ...]) -> bytes:
    """A valid NIfTI-1 ``(4, 5, 6)`` int16 file with int16 header fields overwritten."""
    offsets = {"dim": 40, "datatype": 70, "bitpix": 72}
    raw = _nifti_bytes()
    for name, values in fields.items():
        struct.pack_into(f"<{len(values)}h", raw, offsets[name], *values)
    return bytes(raw)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png16(array: np.ndarray, colour_type: int) -> bytes:
    """A 16-bit PNG written by hand (filter 0 on every row): independent of the decoders under test."""
    height, width = array.shape[:2]
    rows = array.astype(">u2").reshape(height, -1).tobytes()
    stride = len(rows) // height
    raw = b"".join(b"\0" + rows[i * stride : (i + 1) * stride] for i in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )


def _png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    chunks = _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


# -- malformed headers: 422 about the file, never 500, never a server path -------------------------

MALFORMED = [
    pytest.param({"dim": (0,)}, DecodeError, "dim[0]", id="dim0-zero"),
    pytest.param({"dim": (8,)}, DecodeError, "dim[0]", id="dim0-eight"),
    pytest.param({"dim": (-1,)}, DecodeError, "dim[0]", id="dim0-negative"),
    pytest.param({"datatype": (0,)}, DecodeError, "datatype code 0", id="datatype-0"),
    pytest.param({"datatype": (1234,)}, DecodeError, "datatype code 1234", id="datatype-1234"),
    pytest.param({"datatype": (1536,), "bitpix": (128,)}, UnusableInputError, "float128", id="float128"),
    pytest.param({"datatype": (32,), "bitpix": (64,)}, UnusableInputError, "complex64", id="complex"),
    pytest.param({"dim": (3, 4, -5, 6)}, DecodeError, "length -5", id="negative-axis"),
    pytest.param({"dim": (3, -4, -5, 6)}, DecodeError, "length -4", id="two-negative-axes"),
    pytest.param({"dim": (3, 4, 0, 6)}, DecodeError, "length 0", id="zero-length-axis"),
]


@pytest.mark.parametrize("gzipped", [False, True], ids=["nii", "nii.gz"])
@pytest.mark.parametrize(("fields", "error", "words"), MALFORMED)
def test_malformed_nifti_headers_are_422_about_the_file(
    tmp_path: Path, fields: dict, error: type, words: str, gzipped: bool
) -> None:
    raw = _patched(**fields)
    folder = tmp_path / "srv-secret-folder"
    folder.mkdir()
    path = folder / "upload"
    path.write_bytes(gzip.compress(raw) if gzipped else raw)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
        decode(path, max_voxels=2**30)
    assert classify(info.value).status == 422
    assert "srv-secret-folder" not in str(info.value)
    with pytest.raises(error):
        probe(path)  # the header alone says it


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda: _nifti_bytes()[:-50], id="nii-short-of-voxels"),
        pytest.param(lambda: gzip.compress(bytes(_nifti_bytes()))[:-30], id="nii.gz-cut"),
        pytest.param(lambda: b"\x89PNG\r\n\x1a\n" + b"\0" * 40, id="png-garbage"),
        pytest.param(lambda: b"\xff\xd8\xff\xe0" + b"\1" * 64, id="jpeg-garbage"),
        pytest.param(lambda: b"II*\x00" + b"\xff" * 64, id="tiff-garbage"),
        pytest.param(lambda: b"MM\x00*" + b"\0\0\0\x08" + b"\0\x05" + b"\1" * 30, id="tiff-bad-ifd"),
    ],
)
def test_error_details_never_show_server_paths(tmp_path: Path, content) -> None:
    folder = tmp_path / "srv-secret-folder"
    folder.mkdir()
    path = folder / "upload.bin"
    path.write_bytes(content())
    with pytest.raises(ServiceError) as info:
        decode(path)
    assert classify(info.value).status in (415, 422)
    message = str(info.value)
    assert "srv-secret-folder" not in message and str(tmp_path) not in message and "upload.bin" not in message


def _seed_files() -> dict[str, bytes]:
    def pillow(array: np.ndarray, fmt: str, **kwargs: object) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format=fmt, **kwargs)
        return buffer.getvalue()

    def tiff(array: np.ndarray, **kwargs: object) -> bytes:
        buffer = io.BytesIO()
        tifffile.imwrite(buffer, array, **kwargs)
        return buffer.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6
    return {
        "png8": pillow(np.zeros((20, 30, 3), np.uint8), "PNG"),
        "png16-grey": pillow(np.arange(600, dtype=np.uint16).reshape(20, 30), "PNG"),
        "png16-rgba": _png16(np.arange(2400, dtype=np.uint16).reshape(20, 30, 4), 6),
        "jpeg-exif": pillow(np.zeros((20, 30), np.uint8), "JPEG", exif=exif.tobytes()),
        "tiff8": tiff(np.zeros((20, 30), np.uint8)),
        "tiff-stack": tiff(np.zeros((3, 20, 30), np.int16), photometric="minisblack"),
        "nii": nib.Nifti1Image(np.zeros((6, 7, 8), np.int16), np.eye(4)).to_bytes(),
        "nii2": nib.Nifti2Image(np.zeros((6, 7, 8), np.float64), np.eye(4)).to_bytes(),
    }


@pytest.mark.filterwarnings("ignore::UserWarning:PIL")  # Pillow's metadata warnings on bad tags
def test_mutated_files_get_a_4xx_never_an_internal_error(tmp_path: Path) -> None:
    """The class behind every 500 of the fuzzing: bytes of the first 600 (the headers) changed at
    random, sometimes cut short, sometimes gzipped (NIfTI). Every outcome is a decoded volume or a
    ServiceError with a 4xx status; a ZeroDivisionError from tifffile or an overflow warning from
    numpy is a failure."""
    rng = np.random.default_rng(11)
    path = tmp_path / "upload"
    outcomes: dict[str, int] = {}
    for name, seed in _seed_files().items():
        for _ in range(60):
            data = bytearray(seed)
            start = 4 if name.startswith("nii") else 8
            for pos in rng.integers(start, min(len(data), 600), rng.integers(1, 9)):
                data[pos] = int(rng.integers(256))
            if rng.random() < 0.2:
                data = data[: int(rng.integers(1, len(data)))]
            body = (
                gzip.compress(bytes(data)) if name.startswith("nii") and rng.random() < 0.5 else bytes(data)
            )
            path.write_bytes(body)
            try:
                decode(path, max_voxels=10**8, max_image_pixels=10**8, max_bytes=10**9)
                outcome = "decoded"
            except ServiceError as exc:
                assert 400 <= classify(exc).status < 500, exc
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("DecodeError", 0) > 100 and outcomes.get("decoded", 0) > 50, outcomes


# -- limits from the header, before decoding -------------------------------------------------------


@pytest.fixture(scope="module")
def nii_gz_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, valid ~1 MB ``.nii.gz`` of 1024^3 uint8 zeros (1 GiB once inflated).

    Built without compressing 1 GiB: deflate blocks that end with a full flush refer to nothing
    before them, so one 64 MiB block repeated 16 times is a valid stream.
    """
    header = nib.Nifti1Header()
    header.set_data_shape((1024, 1024, 1024))
    header.set_data_dtype(np.uint8)
    head = header.binaryblock + b"\0" * 4  # 352 bytes, then the voxels
    zeros = bytes(64 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    last = deflate.flush(zlib.Z_FINISH)
    crc = zlib.crc32(head)
    for _ in range(16):
        crc = zlib.crc32(zeros, crc)
    size = len(head) + 16 * len(zeros)
    path = tmp_path_factory.mktemp("bomb") / "bomb.nii.gz"
    with open(path, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x00\0\0\0\0\x00\xff" + first)
        for _ in range(16):
            fh.write(block)
        fh.write(last + struct.pack("<II", crc, size & 0xFFFFFFFF))
    with gzip.open(path, "rb") as check:  # really a 1024^3 NIfTI
        assert nib.Nifti1Header.from_fileobj(check).get_data_shape() == (1024, 1024, 1024)
    return path


def _refusal(call, error: type[Exception]) -> tuple[Exception, int, float]:
    """The exception ``call()`` raises, with the peak allocation (tracemalloc, numpy included)
    and wall time it took."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            call()
    finally:
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return info.value, peak, seconds


def _inflating_seconds(nbytes: int = 64 << 20) -> float:
    """Seconds that inflating ``nbytes`` of zeros (gzip) takes here and now: the yardstick of a
    refusal's cost, measured under the machine's present load (a wall-clock bound is not)."""
    packed = gzip.compress(bytes(nbytes), compresslevel=1)
    t0 = time.perf_counter()
    gzip.decompress(packed)
    return time.perf_counter() - t0


def test_nii_gz_bomb_is_refused_from_its_header_without_inflating(nii_gz_bomb: Path) -> None:
    """1 MB on disk, 1 GiB once inflated: refused by the byte limit from the header alone."""
    assert nii_gz_bomb.stat().st_size < 2 << 20
    exc, peak, seconds = _refusal(
        lambda: decode(nii_gz_bomb, max_voxels=2**30, max_bytes=256 << 20), PayloadTooLargeError
    )
    assert "1073742176 bytes once decompressed" in str(exc) and "max_bytes=268435456" in str(exc)
    # inflating the 1 GiB would take 16 times the yardstick (and the memory)
    assert peak < 4 << 20 and seconds < _inflating_seconds(), seconds
    exc, peak, seconds = _refusal(lambda: decode(nii_gz_bomb, max_voxels=2**29), PayloadTooLargeError)
    assert "1073741824 voxels" in str(exc) and peak < 4 << 20 and seconds < _inflating_seconds(), seconds
    found = probe(nii_gz_bomb)
    assert (found.spatial_shape, found.channels, found.dtype, found.is_3d) == ((1024,) * 3, 1, np.uint8, True)
    assert found.nbytes == 352 + 2**30


def test_tiny_nii_declaring_a_huge_volume_allocates_nothing(tmp_path: Path) -> None:
    """A 1 KB .nii whose header declares 1000 x 1000 x 400 float32 (1.6 GB): a 422 before any
    allocation (the file is shorter than what it declares)."""
    header = nib.Nifti1Header()
    header.set_data_shape((1000, 1000, 400))
    header.set_data_dtype(np.float32)
    path = tmp_path / "liar.nii"
    path.write_bytes(header.binaryblock + b"\0" * 4 + b"\1" * 1000)
    exc, peak, _ = _refusal(lambda: decode(path, max_voxels=2**30), DecodeError)
    assert "truncated" in str(exc) and "1600000000 bytes" in str(exc)
    assert peak < 4 << 20


def test_tiny_nii_gz_declaring_a_huge_volume_costs_what_it_holds(tmp_path: Path) -> None:
    """The same lie inside gzip (its size unknown before inflating): the server's memory grows with
    the bytes that really arrive, not with the 1.6 GB declared. Measured as the peak RSS of a
    fresh interpreter, against the same run on an honest small file."""
    header = nib.Nifti1Header()
    header.set_data_shape((1000, 1000, 400))
    header.set_data_dtype(np.float32)
    liar = tmp_path / "liar.nii.gz"
    liar.write_bytes(gzip.compress(header.binaryblock + b"\0" * 4 + b"\1" * 100_000))
    honest = tmp_path / "honest.nii.gz"
    small = nib.Nifti1Image(np.ones((10, 10, 10), np.float32), np.eye(4))
    honest.write_bytes(gzip.compress(small.to_bytes()))
    code = (
        "import resource, sys\n"
        "from service.codecs import decode\n"
        "try:\n"
        "    decode(sys.argv[1], max_voxels=2**30)\n"
        "    print('ok')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )

    def run(path: Path) -> tuple[str, int]:
        argv = [sys.executable, "-c", code, str(path)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True)
        status, rss_kib = out.stdout.split()
        return status, int(rss_kib) * 1024

    (status, rss), (honest_status, honest_rss) = run(liar), run(honest)
    assert (status, honest_status) == ("DecodeError", "ok")
    assert rss - honest_rss < 64 << 20, (rss, honest_rss)  # not 1.6 GB


def test_image_pixels_default_follows_pillow_and_a_setting_raises_it(
    tmp_path: Path, make_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """22000^2 pixels (the issue's 470 KB PNG): above Pillow's threshold, so refused by default,
    from the header and cheaply; TILEWISE_MAX_IMAGE_PIXELS raises the limit."""
    settings = make_settings()
    assert settings.max_image_pixels == PILLOW_MAX_IMAGE_PIXELS
    path = tmp_path / "big.png"
    path.write_bytes(_png_header_only(22000, 22000))
    exc, peak, seconds = _refusal(
        lambda: decode(path, max_voxels=settings.max_voxels, max_image_pixels=settings.max_image_pixels),
        PayloadTooLargeError,
    )
    assert "484000000 pixels" in str(exc) and f"max_image_pixels={PILLOW_MAX_IMAGE_PIXELS}" in str(exc)
    assert peak < 4 << 20 and seconds < _inflating_seconds(), seconds  # 484 MB of pixels were not
    monkeypatch.setenv("TILEWISE_MAX_IMAGE_PIXELS", "500000000")
    raised = make_settings()
    assert raised.max_image_pixels == 500_000_000
    raised_probe = probe(path)
    raised_probe.check_limits(max_voxels=raised.max_voxels, max_image_pixels=raised.max_image_pixels)
    assert raised_probe.spatial_shape == (22000, 22000)


def test_tiff_page_size_is_checked_from_the_header(tmp_path: Path) -> None:
    """A TIFF whose tags declare a 30000 x 30000 page (the file holds 100 bytes of pixels)."""
    path = tmp_path / "big.tif"
    tifffile.imwrite(path, np.zeros((10, 10), np.uint16))
    raw = bytearray(path.read_bytes())
    with tifffile.TiffFile(path) as tif:
        tags = tif.pages[0].tags
        width_at, length_at = tags["ImageWidth"].valueoffset, tags["ImageLength"].valueoffset
        fmt = "<I" if tags["ImageWidth"].dtype == 4 else "<H"
    struct.pack_into(fmt, raw, width_at, 30000)
    struct.pack_into(fmt, raw, length_at, 30000)
    path.write_bytes(bytes(raw))
    assert probe(path).spatial_shape == (30000, 30000)
    exc, peak, _ = _refusal(
        lambda: decode(path, max_image_pixels=PILLOW_MAX_IMAGE_PIXELS), PayloadTooLargeError
    )
    assert "900000000 pixels" in str(exc) and peak < 4 << 20
    with pytest.raises(PayloadTooLargeError, match="max_voxels=1000000"):
        decode(path, max_voxels=10**6)


# -- the header probe ---------------------------------------------------------------------------


def _save_nifti(path: Path, shape: tuple[int, ...], dtype: type = np.float32, **header: float) -> Path:
    img = nib.Nifti1Image(np.zeros(shape, dtype), np.eye(4))
    for key, value in header.items():
        img.header[key] = value
    path.write_bytes(img.to_bytes())
    return path


def test_probe_gives_shape_channels_dtype_and_dimensionality(tmp_path: Path) -> None:
    rotated = tmp_path / "r.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate for display: width and height swap
    Image.fromarray(np.zeros((20, 40), np.uint8)).save(rotated, exif=exif.tobytes())
    cases: list[tuple[Path, tuple, int, type, bool]] = [
        (_save_nifti(tmp_path / "v.nii", (5, 6, 7)), (5, 6, 7), 1, np.float32, True),
        (_save_nifti(tmp_path / "t.nii", (5, 6, 7, 3), np.int16), (5, 6, 7), 3, np.int16, True),
        (_save_nifti(tmp_path / "s.nii", (5, 6, 1)), (5, 6, 1), 1, np.float32, True),
        (_save_nifti(tmp_path / "f.nii", (5, 6)), (5, 6), 1, np.float32, False),
        (_save_nifti(tmp_path / "d.nii", (5, 6, 7), np.float64), (5, 6, 7), 1, np.float32, True),
        (
            _save_nifti(tmp_path / "k.nii", (5, 6, 7), np.int16, scl_slope=2.0, scl_inter=0.0),
            (5, 6, 7),
            1,
            np.float32,
            True,
        ),
        (rotated, (40, 20), 1, np.uint8, False),
    ]
    png = tmp_path / "rgb16.png"
    png.write_bytes(_png16(np.zeros((3, 4, 3), np.uint16), colour_type=2))
    cases.append((png, (3, 4), 3, np.uint16, False))
    stack = tmp_path / "stack.tif"
    tifffile.imwrite(stack, np.zeros((5, 16, 18), np.int8))
    cases.append((stack, (5, 16, 18), 1, np.int8, True))
    for path, shape, channels, dtype, is_3d in cases:
        found = probe(path)
        assert isinstance(found, Probe)
        announced = (found.spatial_shape, found.channels, found.dtype, found.is_3d)
        assert announced == (shape, channels, dtype, is_3d), path
        volume = decode(path)  # what the probe announced is what decoding gives
        assert (volume.spatial_shape, volume.channels, volume.data.dtype) == (shape, channels, dtype), path


def test_probe_refuses_the_wrong_dimensionality_from_the_header(tmp_path: Path) -> None:
    flat = probe(_save_nifti(tmp_path / "flat.nii", (7, 9)))
    one_slice = probe(_save_nifti(tmp_path / "slice.nii", (7, 9, 1)))
    volume = probe(_save_nifti(tmp_path / "vol.nii", (7, 9, 4)))
    picture = tmp_path / "p.png"
    Image.fromarray(np.zeros((7, 9), np.uint8)).save(picture)
    image = probe(picture)
    for found in (flat, image):
        with pytest.raises(UnusableInputError, match="'gaussian-3d' is 3D") as info:
            found.check_model(3, "gaussian-3d")
        assert classify(info.value).status == 422
        found.check_model(2, "gaussian-2d")
    with pytest.raises(UnusableInputError, match="'gaussian-2d' is 2D"):
        volume.check_model(2, "gaussian-2d")
    volume.check_model(3, "gaussian-3d")
    one_slice.check_model(2, "gaussian-2d")  # (X, Y, 1): an image for 2D models
    one_slice.check_model(3, "gaussian-3d")  # and a one-slice volume for 3D ones
    series = probe(_save_nifti(tmp_path / "4d.nii", (7, 9, 4, 3)))
    series.check_model(3, "three-channel-3d", in_channels=3)
    with pytest.raises(UnusableInputError, match="3 volumes"):
        series.check_model(3, "gaussian-3d", in_channels=1)


# -- samples decoded exactly -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("colour_type", "samples", "channels"),
    [
        pytest.param(2, 3, 3, id="rgb16"),
        pytest.param(6, 4, 3, id="rgba16"),
        pytest.param(4, 2, 1, id="grey-alpha16"),
    ],
)
def test_16_bit_colour_and_alpha_pngs_keep_16_bits(
    tmp_path: Path, colour_type: int, samples: int, channels: int
) -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 65536, (9, 11, samples), dtype=np.uint16)
    pixels[0, 0, :] = 65535
    pixels[0, 1, :] = 1  # the low byte matters
    path = tmp_path / "x.png"
    path.write_bytes(_png16(pixels, colour_type))
    volume = decode(path)
    assert volume.data.dtype == np.uint16 and volume.data.shape == (channels, 9, 11)
    np.testing.assert_array_equal(volume.data, np.moveaxis(pixels[..., :channels], -1, 0))


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.array([[-128, -1, 0], [1, 64, 127]], np.int8), id="int8"),
        pytest.param(np.array([[2**31 + 5, 2**32 - 1, 0], [1, 2**31, 7]], np.uint32), id="uint32-high"),
        pytest.param(np.array([[-(2**31), -1, 0], [1, 5, 2**31 - 1]], np.int32), id="int32"),
        pytest.param(np.array([[-32768, -1, 0], [1, 5, 32767]], np.int16), id="int16"),
        pytest.param(np.array([[0, 1, 2**63], [2**64 - 1, 5, 6]], np.uint64), id="uint64"),
    ],
)
def test_tiff_sample_formats_keep_their_sign(tmp_path: Path, array: np.ndarray) -> None:
    path = tmp_path / "x.tif"
    tifffile.imwrite(path, array)
    volume = decode(path)
    assert volume.data.dtype == array.dtype
    np.testing.assert_array_equal(volume.data[0], array)


def test_nifti_with_a_trailing_singleton_axis_comes_back_the_same(tmp_path: Path) -> None:
    """(X, Y, Z, 1) with pixdim[4] = 2.5 s: the output is (X, Y, Z, 1) with the same pixdim."""
    img = nib.Nifti1Image(np.arange(120, dtype=np.float32).reshape(4, 5, 6, 1), np.diag([0.8, 0.9, 3.0, 1]))
    img.header["pixdim"][4] = 2.5
    img.header.set_xyzt_units("mm", "sec")
    path = tmp_path / "x.nii.gz"
    path.write_bytes(gzip.compress(img.to_bytes()))
    volume = decode(path)
    assert volume.data.shape == (1, 4, 5, 6)
    ref = nib.load(path)
    labels = (volume.data[0] > 60).astype(np.uint8)
    probs = volume.data / 120.0
    for name, array, dtype in (("labels.nii.gz", labels, np.uint8), ("probs.nii.gz", probs, np.float32)):
        encode(volume, array, "nii.gz", tmp_path / name)
        out = nib.load(tmp_path / name)
        assert out.shape == (4, 5, 6, 1) and out.get_data_dtype() == dtype
        np.testing.assert_array_equal(out.header["pixdim"], ref.header["pixdim"])
        assert out.header.get_xyzt_units() == ("mm", "sec")
        np.testing.assert_array_equal(np.asarray(out.dataobj)[..., 0], array.reshape(4, 5, 6))
    two = np.stack([probs[0], 1 - probs[0]])  # several channels: the 4th axis holds them
    encode(volume, two, "nii.gz", tmp_path / "two.nii.gz")
    assert nib.load(tmp_path / "two.nii.gz").shape == (4, 5, 6, 2)


def test_true_2d_nifti_round_trips_and_a_3d_model_refuses_it(tmp_path: Path) -> None:
    from service.pipeline import fit_to_model

    img = nib.Nifti1Image(np.arange(63, dtype=np.float32).reshape(7, 9), np.eye(4))
    volume = decode(_write(tmp_path / "flat.nii", img.to_bytes()))
    assert volume.spatial_shape == (7, 9) and not volume.single_slice

    class Spec:
        name, in_channels = "gaussian-3d", 1
        spatial_dims = 3

    with pytest.raises(UnusableInputError, match="is 3D; the input is a 2D") as info:
        fit_to_model(volume, Spec())
    assert classify(info.value).status == 422
    Spec.spatial_dims = 2
    data, dropped = fit_to_model(volume, Spec())
    assert data.shape == (1, 7, 9) and not dropped
    encode(volume, np.ones((7, 9), np.uint8), "nii", tmp_path / "labels.nii")
    assert nib.load(tmp_path / "labels.nii").shape == (7, 9)
    encode(volume, np.ones((2, 7, 9), np.float32), "nii", tmp_path / "two.nii")
    assert nib.load(tmp_path / "two.nii").shape == (7, 9, 1, 2)  # NIfTI's vector layout


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# -- the same answers over HTTP (the app in process, built-in analytic models) -----------------------


class _InProcess:
    """Synchronous ``post`` to the app running in process (lifespan entered once, anyio portal)."""

    def __init__(self, portal, client) -> None:
        self._portal, self._client = portal, client

    def post(self, url: str, content: bytes):
        return self._portal.call(functools.partial(self._client.post, url, content=content))


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_InProcess]:
    import anyio.from_thread
    import httpx

    from service.app import create_app
    from service.settings import Settings

    folder = tmp_path_factory.mktemp("srv-secret-folder")
    settings = Settings(_env_file=None, models_dir=folder, tmp_dir=folder, warmup=False, device="cpu")
    app = create_app(settings)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            transport = httpx.ASGITransport(app=app)
            client = httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120)
            yield _InProcess(portal, client)
            portal.call(client.aclose)


@pytest.mark.parametrize(("fields", "error", "words"), MALFORMED)
def test_malformed_nifti_headers_over_http_are_422(http, fields: dict, error: type, words: str) -> None:
    response = http.post("/v1/models/gaussian-3d/infer", content=_patched(**fields))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == STATUS[error][1] and "srv-secret-folder" not in body["detail"]


def test_2d_nifti_over_http_a_3d_model_refuses_it_a_2d_model_keeps_it_2d(http) -> None:
    flat = nib.Nifti1Image(np.arange(63, dtype=np.float32).reshape(7, 9), np.eye(4)).to_bytes()
    refused = http.post("/v1/models/gaussian-3d/infer", content=flat)
    assert refused.status_code == 422 and refused.json()["error"] == "unusable_input", refused.text
    assert "2D" in refused.json()["detail"]
    done = http.post("/v1/models/gaussian-2d/infer", content=flat)
    assert done.status_code == 200, done.text
    assert nib.Nifti1Image.from_bytes(gzip.decompress(done.content)).shape == (7, 9)
    one_slice = nib.Nifti1Image(np.ones((7, 9, 1), np.float32), np.eye(4)).to_bytes()
    assert http.post("/v1/models/gaussian-3d/infer", content=one_slice).status_code == 200


def test_dicom_over_http_is_read_as_a_series(http) -> None:
    data = pytest.importorskip("pydicom.data")
    dicom = Path(data.get_testdata_file("CT_small.dcm")).read_bytes()
    response = http.post("/v1/models/gaussian-2d/infer", content=dicom)  # one slice: an image too
    assert response.status_code == 200, response.text
    assert response.headers["x-tilewise-format"] == "nii.gz"


# -- label PNGs -------------------------------------------------------------------------------------


def test_2d_labels_are_written_as_palette_pngs(tmp_path: Path) -> None:
    source = tmp_path / "in.png"
    Image.fromarray(np.zeros((10, 12), np.uint8)).save(source, dpi=(300, 300))
    volume = decode(source)
    labels = np.zeros((10, 12), np.uint8)
    labels[2:5, 3:7] = 1
    labels[6:, :2] = 2
    encode(volume, labels, "png", tmp_path / "labels.png")
    with Image.open(tmp_path / "labels.png") as image:
        assert image.mode == "P" and round(image.info["dpi"][0]) == 300
        np.testing.assert_array_equal(np.asarray(image), labels)  # values stay the label ids
        palette = np.asarray(image.getpalette(), np.uint8).reshape(-1, 3)
        shown = np.asarray(image.convert("RGB"))
    assert len({tuple(c) for c in palette}) == len(palette) == 256  # a distinct colour per label
    assert tuple(palette[0]) == (0, 0, 0) and palette[1].max() >= 200 and palette[2].max() >= 200
    # the first labels in Okabe and Ito's colour-blind-safe set (grey/white matter: orange, sky blue)
    assert [tuple(c) for c in palette[1:4]] == [(230, 159, 0), (86, 180, 233), (0, 158, 115)]
    assert shown[labels == 1].max() >= 200  # a 0/1 mask is visible, not black


# -- DICOM ----------------------------------------------------------------------------------------


@pytest.fixture(params=["CT_small.dcm", "MR_small.dcm"])
def dicom_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    data = pytest.importorskip("pydicom.data")
    yield Path(data.get_testdata_file(request.param))


def test_dicom_is_detected_by_its_marker_and_read_as_a_series(dicom_path: Path) -> None:
    raw = dicom_path.read_bytes()
    assert raw[128:132] == b"DICM" and raw[:4] == b"II*\x00"  # the preamble looks like a TIFF
    assert sniff(dicom_path).kind == "dicom"
    volume = decode(dicom_path)  # tests/service/test_dicom_series.py: the geometry against dcm2niix
    assert volume.kind == "dicom" and volume.single_slice
    assert probe(dicom_path).spatial_shape == volume.spatial_shape


def test_decoded_volume_single_slice_needs_three_axes() -> None:
    assert not DecodedVolume(data=np.zeros((1, 5, 1)), kind="nifti").single_slice
    assert DecodedVolume(data=np.zeros((1, 5, 6, 1)), kind="nifti").single_slice

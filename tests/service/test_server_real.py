"""Real input through a real server: MNI152 and anatomical.nii to gaussian-3d, NIfTI quirks.

Each output must keep the input's geometry bit for bit (shape, affine, qform/sform with codes,
zooms, units) and equal ``scipy.ndimage.gaussian_filter(x, 2.0, truncate=4.0, mode="constant")``
within 1e-4, scaled by max |x| for raw intensities (DESIGN.md).
"""

from __future__ import annotations

import gzip
import io
import logging
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pytest
from _svc_helpers import tolerance
from scipy import ndimage

logger = logging.getLogger(__name__)


def _gaussian(x: np.ndarray) -> np.ndarray:
    return ndimage.gaussian_filter(x.astype(np.float32), 2.0, truncate=4.0, mode="constant")


def _load_response(response: httpx.Response) -> nib.Nifti1Image:
    assert response.status_code == 200, response.text
    raw = response.content
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    klass = nib.Nifti2Image if raw[4:8] == b"n+2\x00" else nib.Nifti1Image
    return klass.from_bytes(raw)


def _assert_same_geometry(out: nib.Nifti1Image, ref: nib.Nifti1Image) -> None:
    assert out.shape == ref.shape
    assert np.array_equal(out.affine, ref.affine)
    keys = ("qform_code", "sform_code", "quatern_b", "quatern_c", "quatern_d", "qoffset_x", "qoffset_y")
    for key in (*keys, "qoffset_z", "srow_x", "srow_y", "srow_z", "xyzt_units"):
        assert np.array_equal(out.header[key], ref.header[key]), key
    assert out.header.get_zooms() == ref.header.get_zooms()
    assert nib.aff2axcodes(out.affine) == nib.aff2axcodes(ref.affine)


def test_mni152_gaussian_3d(client: httpx.Client, mni152_path: Path) -> None:
    response = client.post(
        "/v1/models/gaussian-3d/infer",
        content=mni152_path.read_bytes(),
        headers={"Content-Type": "application/octet-stream"},
    )
    out = _load_response(response)
    ref = nib.load(mni152_path)
    _assert_same_geometry(out, ref)
    assert response.headers["content-type"] == "application/gzip"
    assert out.get_data_dtype() == np.float32
    x = np.asarray(ref.dataobj, dtype=np.float32)
    diff = float(np.abs(np.asarray(out.dataobj) - _gaussian(x)).max())
    logger.info("MNI152 via HTTP: max |out - scipy| = %.3g (tolerance %.3g)", diff, tolerance(x))
    assert diff <= tolerance(x)


def test_anatomical_sent_raw_and_as_multipart(client: httpx.Client, anatomical_path: Path) -> None:
    ref = nib.load(anatomical_path)  # big-endian int16, qform and sform code 2
    x = np.asarray(ref.dataobj, dtype=np.float32)
    raw = client.post("/v1/models/gaussian-3d/infer", content=anatomical_path.read_bytes())
    form = client.post(
        "/v1/models/gaussian-3d/infer", files={"file": ("scan.nii", anatomical_path.read_bytes())}
    )
    for response in (raw, form):
        out = _load_response(response)
        _assert_same_geometry(out, ref)
        diff = float(np.abs(np.asarray(out.dataobj) - _gaussian(x)).max())
        logger.info("anatomical.nii via HTTP: max |out - scipy| = %.3g (tolerance %.3g)", diff, tolerance(x))
        assert diff <= tolerance(x)
    assert raw.content == form.content


def _volume(rng: np.random.Generator, shape: tuple[int, ...] = (21, 18, 13)) -> np.ndarray:
    return rng.integers(0, 1000, size=shape).astype(np.int16)


def _affine(zooms: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> np.ndarray:
    affine = np.diag([*zooms, 1.0])
    affine[:3, 3] = [-10.5, 22.25, -7.0]
    affine[:3, :3] = affine[:3, :3] @ np.array([[0.0, -1, 0], [1, 0, 0], [0, 0, 1]])  # rotated
    return affine


def _scaled_int16(rng: np.random.Generator) -> tuple[nib.Nifti1Image, np.ndarray]:
    stored = _volume(rng)
    img = nib.Nifti1Image(stored, _affine())
    img.header.set_slope_inter(2.0, -1024.0)
    return img, stored.astype(np.float32) * 2.0 - 1024.0


def _big_endian(rng: np.random.Generator) -> tuple[nib.Nifti1Image, np.ndarray]:
    data = _volume(rng).astype(">f4")
    header = nib.Nifti1Header(endianness=">")
    img = nib.Nifti1Image(data, _affine(), header=header)
    assert img.header.endianness == ">"
    return img, data.astype(np.float32)


def _qform_only(rng: np.random.Generator) -> tuple[nib.Nifti1Image, np.ndarray]:
    data = _volume(rng)
    img = nib.Nifti1Image(data, None)
    img.header.set_qform(_affine((0.9, 1.1, 2.0)), code=1)
    img.header.set_sform(None, code=0)
    return img, data.astype(np.float32)


def _sform_only(rng: np.random.Generator) -> tuple[nib.Nifti1Image, np.ndarray]:
    data = _volume(rng)
    img = nib.Nifti1Image(data, None)
    img.header.set_sform(_affine((1.5, 1.5, 1.5)), code=4)
    img.header.set_qform(None, code=0)
    return img, data.astype(np.float32)


def _anisotropic(rng: np.random.Generator) -> tuple[nib.Nifti1Image, np.ndarray]:
    data = _volume(rng).astype(np.float32)
    img = nib.Nifti1Image(data, _affine((0.4, 0.75, 3.3)))
    img.header.set_xyzt_units("mm", "sec")
    return img, data


def _nifti2(rng: np.random.Generator) -> tuple[nib.Nifti2Image, np.ndarray]:
    data = _volume(rng).astype(np.uint8)
    return nib.Nifti2Image(data, _affine((2.0, 2.0, 2.0))), data.astype(np.float32)


QUIRKS = [
    pytest.param(_scaled_int16, id="int16-slope2-inter-1024"),
    pytest.param(_big_endian, id="big-endian-float32"),
    pytest.param(_qform_only, id="qform-only"),
    pytest.param(_sform_only, id="sform-only"),
    pytest.param(_anisotropic, id="anisotropic-zooms"),
    pytest.param(_nifti2, id="nifti2"),
]


@pytest.mark.parametrize("make", QUIRKS)
@pytest.mark.parametrize("gz", [pytest.param(True, id="nii.gz"), pytest.param(False, id="nii")])
def test_nifti_quirks_round_trip(client: httpx.Client, rng: np.random.Generator, make, gz: bool) -> None:
    img, values = make(rng)
    body = img.to_bytes()
    if gz:
        body = gzip.compress(body, compresslevel=1)
    response = client.post("/v1/models/gaussian-3d/infer", content=body, params={"tile": "20", "halo": "8"})
    out = _load_response(response)
    ref = type(img).from_bytes(img.to_bytes())
    assert type(out) is type(ref)
    _assert_same_geometry(out, ref)
    assert out.header.endianness == ref.header.endianness  # byte order kept
    assert out.get_data_dtype().newbyteorder("=") == np.float32
    slope, inter = out.header.get_slope_inter()
    assert slope in (None, 1.0) and inter in (None, 0.0)  # scaling reset
    result = np.asarray(out.dataobj)
    assert np.abs(result - _gaussian(values)).max() <= tolerance(values)


def test_single_slice_nifti_is_an_image_for_2d_models(client: httpx.Client, rng: np.random.Generator) -> None:
    slice2d = rng.random((40, 33), dtype=np.float32) * 100
    img = nib.Nifti1Image(slice2d[..., None], _affine((0.7, 0.7, 5.0)))
    ref = nib.Nifti1Image.from_bytes(img.to_bytes())  # the affine as stored (float32)
    for model, expected in (
        ("gaussian-2d", _gaussian(slice2d)[..., None]),
        # A 3D model sees a one-slice volume: zero padding above and below the slice.
        ("gaussian-3d", _gaussian(slice2d[..., None])),
    ):
        response = client.post(f"/v1/models/{model}/infer", content=img.to_bytes())
        out = _load_response(response)
        _assert_same_geometry(out, ref)
        assert np.abs(np.asarray(out.dataobj) - expected).max() <= tolerance(slice2d)


def test_labels_output_is_uint8_nifti(client: httpx.Client, anatomical_path: Path) -> None:
    response = client.post(
        "/v1/models/gaussian-3d/infer", content=anatomical_path.read_bytes(), params={"output": "labels"}
    )
    out = _load_response(response)
    assert out.get_data_dtype() == np.uint8
    assert out.shape == nib.load(anatomical_path).shape
    assert response.headers["x-tilewise-output"] == "labels"


@pytest.mark.parametrize("fmt", ["nii", "tiff", "npy"])
def test_other_formats_keep_the_grid(client: httpx.Client, anatomical_path: Path, fmt: str) -> None:
    response = client.post(
        "/v1/models/gaussian-3d/infer", content=anatomical_path.read_bytes(), params={"format": fmt}
    )
    assert response.status_code == 200, response.text
    shape = nib.load(anatomical_path).shape
    if fmt == "nii":
        assert _load_response(response).shape == shape
    elif fmt == "npy":
        assert np.load(io.BytesIO(response.content)).shape == (1, *shape)
    else:
        import tifffile

        assert tifffile.imread(io.BytesIO(response.content)).shape == shape

"""Real 2D input through a real server: a 16-bit radiograph PNG and a scanned page JPEG to text-det-2d.

The output has the input's width and height and equals the in-process tiled result
(``Model.run`` on the same decoded pixels, with the same options).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import httpx
import numpy as np
import pytest
import tifffile
from PIL import Image

from service.codecs import decode

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def rg1_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pydicom-data's RG1_UNCR.dcm radiograph (1955x1841, MONOCHROME1) as a 16-bit PNG."""
    pydicom = pytest.importorskip("pydicom")
    from pydicom.data import get_testdata_file

    source = get_testdata_file("RG1_UNCR.dcm")
    if source is None:
        pytest.skip("pydicom-data's RG1_UNCR.dcm is not installed")
    pixels = pydicom.dcmread(source).pixel_array
    pixels = (int(pixels.max()) - pixels).astype(np.uint16)  # MONOCHROME1: invert for display
    path = tmp_path_factory.mktemp("2d") / "rg1.png"
    Image.fromarray(pixels).save(path)
    with Image.open(path) as image:
        assert image.mode == "I;16"
    return path


@pytest.fixture(scope="module")
def page_jpg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-image's scanned ``page`` (191x384 grey) as a JPEG."""
    data = pytest.importorskip("skimage.data")
    path = tmp_path_factory.mktemp("2d") / "page.jpg"
    Image.fromarray(data.page()).save(path, quality=95)
    return path


@pytest.fixture(scope="module")
def text_det(text_models_dir: Path):
    from models import ModelRepository

    return ModelRepository(text_models_dir, device="cpu").get("text-det-2d")


@pytest.mark.parametrize(
    ("name", "halo"),
    [
        # One tile covers the page: the model's defaults (halo "auto") as a user sends them.
        pytest.param("page_jpg", None, id="page_jpg-defaults"),
        # 2x2 tiles of 1024: an explicit halo, the same on both sides, spares each side the halo
        # calibration (about half of each run); the check is still server == in-process.
        pytest.param("rg1_png", 0, id="rg1_png-halo0"),
    ],
)
def test_text_detector_on_real_images(
    client: httpx.Client, text_det, request: pytest.FixtureRequest, name: str, halo: int | None
) -> None:
    from models import InferenceParams

    path: Path = request.getfixturevalue(name)
    with Image.open(path) as image:
        width, height = image.size
    params = {} if halo is None else {"halo": str(halo)}
    response = client.post("/v1/models/text-det-2d/infer", content=path.read_bytes(), params=params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/tiff"
    out = tifffile.imread(io.BytesIO(response.content))
    assert out.shape == (height, width) and out.dtype == np.float32
    expected = text_det.run(decode(path).data, InferenceParams(halo=halo))
    assert expected.shape == (1, height, width)
    diff = float(np.abs(out - expected[0]).max())
    logger.info("text-det-2d %s %dx%d via HTTP: max |server - in-process| = %.3g (p max %.3g)",
                path.name, width, height, diff, float(out.max()))  # fmt: skip
    assert diff <= 1e-5  # same code path, same onnxruntime CPU kernels; only fp32 noise allowed


def test_text_detector_labels_as_png(client: httpx.Client, page_jpg: Path) -> None:
    response = client.post(
        "/v1/models/text-det-2d/infer", content=page_jpg.read_bytes(), params={"output": "labels"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    with Image.open(io.BytesIO(response.content)) as labels, Image.open(page_jpg) as page:
        assert labels.mode == "P" and labels.size == page.size  # palette PNG: values stay the ids
        values = np.asarray(labels)
    assert set(np.unique(values)) <= {0, 1} and values.any()  # the page has text


def test_gaussian_2d_on_a_jpeg_matches_scipy(client: httpx.Client, page_jpg: Path) -> None:
    from scipy import ndimage

    response = client.post(
        "/v1/models/gaussian-2d/infer", files={"file": ("page.jpg", page_jpg.read_bytes())}
    )
    assert response.status_code == 200, response.text
    out = tifffile.imread(io.BytesIO(response.content))
    with Image.open(page_jpg) as page:
        x = np.asarray(page, dtype=np.float32)
    expected = ndimage.gaussian_filter(x, 2.0, truncate=4.0, mode="constant")
    assert out.shape == x.shape
    assert np.abs(out - expected).max() <= 1e-4 * float(np.abs(x).max())

"""One plan per request: text-det-2d with ``halo=auto`` on grey and 16-bit images.

Before issue 10 the pipeline planned twice: once for the run (on the preprocessed, RGB image), then
again after the run, on the raw grey image, to count tiles for a metric. The second pass calibrated
a halo on one channel, and onnxruntime refused the batch: a finished run became a 500 (HTTP) or a
failed ``tilewise infer``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def _grey_png(folder: Path, dtype: type) -> Path:
    """A 300x90 grey PNG (``L`` for uint8, ``I;16`` for uint16) with some structure."""
    rng = np.random.default_rng(0)
    peak = np.iinfo(dtype).max
    pixels = (rng.random((90, 300)) * peak).astype(dtype)
    pixels[30:60, 40:260] = peak // 8  # a dark band, like a line of text
    path = folder / f"grey-{np.dtype(dtype).name}.png"
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def text_det(text_models_dir: Path):
    from models import ModelRepository

    return ModelRepository(text_models_dir, device="cpu").get("text-det-2d")


@pytest.mark.parametrize("dtype", [pytest.param(np.uint8, id="grey8"), pytest.param(np.uint16, id="grey16")])
def test_text_det_auto_halo_on_grey_image_runs_once(text_det, tmp_path: Path, dtype: type) -> None:
    from models.planning.params import parse_params
    from service.pipeline import run_file

    source = _grey_png(tmp_path, dtype)
    # tile 256 < the 320-pixel (aligned) width: two tiles, so halo=auto really calibrates
    params = parse_params({"tile": "256", "halo": "auto", "halo_tolerance": "1e-2"})
    result = run_file(text_det, source, tmp_path / "out", params)
    assert result.output_shape == (1, 90, 300)
    plan = result.plan  # the one plan: made on the preprocessed (RGB) image, before the run
    assert plan.spatial_shape == (90, 300) and plan.n_tiles == result.n_tiles >= 2
    assert plan.halo_source.startswith("sample 3x")  # calibrated on the 3-channel preprocessed image
    assert plan.header().startswith("tile=") and f"tiles={plan.n_tiles};" in plan.header()


def test_tilewise_infer_on_grey_16bit_with_auto_halo(text_models_dir: Path, tmp_path: Path) -> None:
    """The same through ``tilewise infer`` (it shares the pipeline): exit status 0, output written."""
    from service.cli import main

    source = _grey_png(tmp_path, np.uint16)
    target = tmp_path / "probabilities.tiff"
    args = ["--models", str(text_models_dir), "--device", "cpu", "--tile", "256", "--halo", "auto"]
    assert main(["infer", str(source), str(target), "--model", "text-det-2d", *args]) == 0
    assert target.is_file()


def test_plan_header_and_tta_over_http(client, tmp_path: Path) -> None:
    """X-Tilewise-Plan reports the one plan; ``tta`` is a query parameter, a /v1/models default and
    an OpenAPI parameter, all from the one schema."""
    body = _grey_png(tmp_path, np.uint8).read_bytes()
    query = {"tile": "64", "halo": "4"}
    plain = client.post("/v1/models/gaussian-2d/infer", content=body, params=query)
    mirrored = client.post("/v1/models/gaussian-2d/infer", content=body, params={**query, "tta": "mirror"})
    assert plain.status_code == mirrored.status_code == 200, mirrored.text
    # 90x300 with tile 64, halo 4: 2 x 6 tiles, sized to the image (49 x 57); mirror runs them once
    # per flip of the 2 axes
    assert plain.headers["x-tilewise-plan"] == "tile=49,57; halo=4,4; overlap=0,0; tiles=12; work=1.24"
    assert (
        mirrored.headers["x-tilewise-plan"]
        == "tile=49,57; halo=4,4; overlap=0,0; tiles=48; work=4.97; passes=4"
    )
    bad = client.post("/v1/models/gaussian-2d/infer", content=body, params={"tta": "flip"})
    assert bad.status_code == 400 and "tta='flip'" in bad.json()["detail"]
    assert client.get("/v1/models/gaussian-2d").json()["defaults"]["tta"] == "none"
    infer = client.get("/openapi.json").json()["paths"]["/v1/models/{name}/infer"]["post"]
    tta = next(p for p in infer["parameters"] if p["name"] == "tta")
    assert [v for v in tta["schema"]["enum"] if v] == ["none", "mirror"]  # "": the model's default

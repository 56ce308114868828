"""Issue 11, server side, in process (the real app and built-in models, Starlette's InProcessClient):
resource bounds from the plan, repeated and non-ASCII query values, HEAD, the OpenAPI enums and
the offline Swagger UI."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from _inprocess import InProcessClient

from models.errors import ParamError
from models.planning.params import parse_params, parse_query
from service.app import create_app


def nifti(shape: tuple[int, ...], dtype: type = np.uint8) -> bytes:
    """An uncompressed NIfTI of zeros with one voxel set (small uploads for big plans)."""
    data = np.zeros(shape, dtype)
    data[(0,) * len(shape)] = 1
    return nib.Nifti1Image(data, np.eye(4)).to_bytes()


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessClient]:
    """The app with the built-ins, a 256 MiB request budget and the default plan limits."""
    from service.settings import Settings

    root = tmp_path_factory.mktemp("hardening-http")
    (root / "models").mkdir()
    settings = Settings(
        _env_file=None,
        models_dir=root / "models",
        tmp_dir=root,
        device="cpu",
        warmup=False,
        max_request_bytes=256 * 2**20,
    )
    with InProcessClient(create_app(settings)) as client:
        yield client


def tiles_total(client: InProcessClient, model: str) -> float:
    text = client.get("/metrics").text
    match = re.search(rf'^tilewise_tiles_total{{model="{re.escape(model)}"}} ([0-9.e+]+)$', text, re.M)
    return float(match[1]) if match else 0.0


# --- resource bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "query", "status", "figure"),
    [
        # The three cases: each asked for tens of GB or minutes of work before.
        ((64, 64, 64), "tile=17&halo=8&batch_size=1000000", 422, "batch_size=1000000"),
        ((128, 128, 128), "tile=32&overlap=15", 422, "912673 tiles"),
        ((96, 96, 96), "tile=1&halo=0", 422, "884736 tiles"),
        # work: a 4-voxel core in a 24-voxel tile: 1331 tiles of 24^3 for 64^3 voxels.
        ((64, 64, 64), "tile=24&halo=10&batch_size=8", 422, "work=70.19"),
        # memory: a batch of 125 tiles of 64^3 float32 and the network's working memory: ~3 GiB
        # (the footprint measured at warm-up, or an estimate before: the figure varies by machine)
        ((128, 128, 128), "tile=64&halo=0&overlap=48&batch_size=128", 413, "batch_size=128); the limit is"),
    ],
    ids=["batch-size", "overlap-15", "tile-1", "work", "memory"],
)
def test_costly_plans_are_refused_before_any_work(
    app_client: InProcessClient, shape: tuple[int, ...], query: str, status: int, figure: str
) -> None:
    before = tiles_total(app_client, "gaussian-3d")
    started = time.monotonic()
    response = app_client.post(f"/v1/models/gaussian-3d/infer?{query}", content=nifti(shape))
    elapsed = time.monotonic() - started
    assert response.status_code == status, response.content[:300]
    body = response.json()
    assert body["error"] == "over_budget"
    assert figure in body["detail"], body["detail"]
    assert re.search(r"max_(batch_size|tiles|work|request_bytes)=\d", body["detail"]), body["detail"]
    assert tiles_total(app_client, "gaussian-3d") == before  # no tile ran
    # cheaper than running the model's own plan on the same input, timed now (not a fixed figure:
    # a loaded machine is slow for both)
    started = time.monotonic()
    honest = app_client.post("/v1/models/gaussian-3d/infer", content=nifti(shape))
    honest_s = time.monotonic() - started
    assert honest.status_code == 200 and tiles_total(app_client, "gaussian-3d") > before
    assert elapsed < 2 * honest_s, (elapsed, honest_s)


def test_batch_size_over_the_limit_is_refused_before_the_upload(app_client: InProcessClient) -> None:
    """No body needed: the query alone is refused (the upload is never read)."""
    response = app_client.post("/v1/models/gaussian-3d/infer?batch_size=100000", content=b"")
    assert response.status_code == 422 and "max_batch_size=256" in response.json()["detail"]


def test_a_plan_within_the_limits_runs(app_client: InProcessClient) -> None:
    response = app_client.post("/v1/models/gaussian-3d/infer?tile=32&format=nii", content=nifti((40,) * 3))
    assert response.status_code == 200, response.text
    assert tiles_total(app_client, "gaussian-3d") >= 8


def test_dimensionality_is_refused_from_the_header(app_client: InProcessClient) -> None:
    """A 2D image to a 3D model: 422 from the header (no decode), before the queue."""
    response = app_client.post("/v1/models/gaussian-3d/infer", content=nifti((32, 32)))
    assert response.status_code == 422 and "3D" in response.json()["detail"]


# --- query values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    ["tile=64&tile=128", "blend=hann&blend=hann", "format=nii&format=nii.gz"],
)
def test_repeated_query_parameters_are_refused(app_client: InProcessClient, query: str) -> None:
    name = query.partition("=")[0]
    response = app_client.post(f"/v1/models/gaussian-3d/infer?{query}", content=nifti((8, 8, 8)))
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "bad_parameter"
    assert f"'{name}'" in response.json()["detail"] and "more than once" in response.json()["detail"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tile", "\u0666\u0664"),  # Arabic-Indic 64
        ("tile", "64,\u0666\u0664,64"),
        ("batch_size", "\u0968"),  # Devanagari 2
        ("overlap", "\uff18"),  # full-width 8
        ("tile", "1_000"),
        ("halo_tolerance", "\u0661e-2"),
        ("halo_tolerance", "1_0.5"),
    ],
)
def test_non_ascii_digits_are_not_numbers(app_client: InProcessClient, name: str, value: str) -> None:
    with pytest.raises(ParamError, match=name):
        parse_params({name: value})
    response = app_client.post("/v1/models/gaussian-3d/infer", params={name: value}, content=nifti((8, 8, 8)))
    assert response.status_code == 400 and name in response.json()["detail"], response.text


def test_ascii_numbers_still_parse() -> None:
    params = parse_query([("tile", " 64 "), ("halo", "8,4,+2"), ("halo_tolerance", "1e-2")])
    assert params.tile == 64 and params.halo == (8, 4, 2) and params.halo_tolerance == 0.01
    with pytest.raises(ParamError, match="'halo' is given more than once"):
        parse_query([("halo", "8"), ("halo", "8")])


# --- HEAD ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/v1/models", "/v1/models/gaussian-3d",
                                  "/openapi.json", "/docs"])  # fmt: skip
def test_head_answers_like_get_without_a_body(app_client: InProcessClient, path: str) -> None:
    get = app_client.get(path)
    head = app_client.head(path)
    assert get.status_code == 200
    assert head.status_code == 200, head.text
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # counters move between the two requests
        assert head.headers["content-length"] == get.headers["content-length"]


def test_head_on_post_only_and_unknown_paths(app_client: InProcessClient) -> None:
    assert app_client.head("/v1/models/gaussian-3d/infer").status_code == 405
    assert app_client.head("/v1/models/nope").status_code == 404


# --- OpenAPI and /docs -----------------------------------------------------------------------------


def test_openapi_states_the_closed_value_sets(app_client: InProcessClient) -> None:
    spec = app_client.get("/openapi.json").json()
    operation = spec["paths"]["/v1/models/{name}/infer"]["post"]
    enums = {  # "" (blank: the model's default) is documented too
        p["name"]: [v for v in p["schema"].get("enum") or [] if v != ""] or None
        for p in operation["parameters"]
        if p["in"] == "query"
    }
    formats = ["nii.gz", "nii", "png", "tiff", "npy", "dicom-seg", "ome.tiff", "geojson", "ome.zarr"]
    assert enums["format"] == formats
    assert enums["tilt"] == ["refuse", "resample"]
    assert enums["seg_type"] == ["binary", "labelmap", "fractional"]
    assert enums["blend"] == ["constant", "gaussian", "hann", "triangular"]
    assert enums["output"] == ["probabilities", "labels"]
    assert enums["tta"] == ["none", "mirror"]
    assert {"408", "413", "422"} <= set(operation["responses"])


def test_docs_make_no_request_outside_the_server(app_client: InProcessClient) -> None:
    page = app_client.get("/docs")
    assert page.status_code == 200
    html = page.text
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html), html
    assert not re.search(r"https?://", html), re.findall(r"https?://\S+", html)
    assert '"validatorUrl": null' in html  # the badge would call swagger.io
    assets = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    assert {Path(a).name for a in assets} >= {"swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"}
    for asset in assets:
        response = app_client.get(asset)
        assert response.status_code == 200 and response.content, asset
        if asset.endswith(".css"):
            assert not re.search(r"url\(\s*['\"]?(?:https?:)?//", response.text)
    assert app_client.get("/docs/oauth2-redirect").status_code == 200
    assert app_client.get("/redoc").status_code == 404  # CDN-only: not served

"""A halo below a local model's receptive-field radius answers 200 with ``X-Tilewise-Warning``."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from fastapi.testclient import TestClient

from models import ModelRepository, parse_params
from service.app import create_app


def test_halo_below_radius_answers_with_a_warning(make_settings: Any, tmp_path: Path) -> None:
    volume = np.random.default_rng(0).random((40, 36, 30), dtype=np.float32)
    body = gzip.compress(nib.Nifti1Image(volume, np.eye(4)).to_bytes())
    settings = make_settings(models_dir=tmp_path / "none", tmp_dir=tmp_path, device="cpu", warmup=False)
    url = "/v1/models/gaussian-3d/infer?tile=24"  # several tiles per axis: seams exist
    with TestClient(create_app(settings)) as client:
        low = client.post(f"{url}&halo=2", content=body)
        enough = client.post(f"{url}&halo=8", content=body)
        auto = client.post(f"{url}&halo=auto", content=body)
        one_tile = client.post("/v1/models/gaussian-3d/infer?tile=48&halo=2", content=body)
    assert low.status_code == 200 and enough.status_code == 200 and auto.status_code == 200
    warning = low.headers["X-Tilewise-Warning"]
    assert "halo 2,2,2 is below the receptive-field radius 8,8,8 of model 'gaussian-3d'" in warning
    assert warning.count(". ") == 0 and warning.endswith(".")  # one sentence
    for response in (enough, one_tile):  # no seam (one tile) or enough halo: no warning
        assert "X-Tilewise-Warning" not in response.headers
    # halo=auto reaches the radius; the given tile grown for it is said (issue 23 item 2), no halo warning
    grown = auto.headers.get("X-Tilewise-Warning", "")
    assert "receptive-field radius" not in grown and grown.startswith("tile=24,24,24 grown to"), grown
    assert low.headers["X-Tilewise-Plan"].startswith("tile=")


def test_plan_warns_for_local_models_only(tmp_path: Path) -> None:
    repository = ModelRepository(tmp_path / "none", device="cpu")
    model = repository.get("gaussian-2d")
    assert model.plan((100, 100), parse_params({"tile": 32, "halo": 3})).warning is not None
    assert model.plan((100, 100), parse_params({"tile": 32, "halo": 8})).warning is None
    assert model.plan((20, 20), parse_params({"tile": 32, "halo": 0})).warning is None  # one tile
    dependent = model.spec.model_copy(update={"tile_dependent": True})
    from models import Model

    unjudged = Model(dependent, model.predictor)  # tile-dependent: no halo makes it exact
    assert unjudged.plan((100, 100), parse_params({"tile": 32, "halo": 3})).warning is None

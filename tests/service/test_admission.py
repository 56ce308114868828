"""One admission for every route (issue 20 item 1; issue 23 item 9; issue 24 item 10).

The synchronous route and ``POST /v1/jobs`` admit a request with the same function
(:func:`service.admission.admit`), so the same request gets the same refusal on both: a model whose
file is missing (it fails to load on first use: 503 ``model_unavailable`` with the repository's
reason), and ``format=png`` for a 3D model (400 ``bad_parameter``, before the body is read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from service.app import create_app


def _body() -> bytes:
    volume = np.random.default_rng(0).random((20, 18, 16), dtype=np.float32)
    return nib.Nifti1Image(volume, np.eye(4)).to_bytes()


@pytest.fixture
def client(tmp_path: Path, make_settings: Any) -> Any:
    models = tmp_path / "models"
    models.mkdir()
    spec = {"name": "missing-3d", "spatial_dims": 3, "in_channels": 1, "out_channels": 2,
            "backend": "torchscript", "file": "absent.pt"}  # fmt: skip
    (models / "missing-3d.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    settings = make_settings(models_dir=models, tmp_dir=tmp_path, jobs_dir=tmp_path / "jobs", device="cpu",
                             warmup=False)  # fmt: skip
    with TestClient(create_app(settings)) as c:
        yield c


def _same(sync: Any, job: Any) -> dict[str, Any]:
    a, b = sync.json(), job.json()
    assert (sync.status_code, a["error"], a["detail"]) == (job.status_code, b["error"], b["detail"])
    return a


def test_a_model_that_fails_to_load_is_503_on_both_routes(client: Any) -> None:
    body = _body()
    job = client.post("/v1/jobs?model=missing-3d", content=body)  # first use: the load fails here
    sync = client.post("/v1/models/missing-3d/infer", content=body)
    again = client.post("/v1/jobs?model=missing-3d", content=body)
    answer = _same(sync, job)
    _same(sync, again)
    assert job.status_code == 503 and answer["error"] == "model_unavailable"
    assert "field 'file'" in answer["detail"]
    assert client.get("/v1/jobs").json() == []  # refused: no job was made


def test_jobs_refuse_png_for_a_3d_model_like_the_sync_route(client: Any) -> None:
    body = _body()
    sync = client.post("/v1/models/gaussian-3d/infer?format=png", content=body)
    job = client.post("/v1/jobs?model=gaussian-3d&format=png", content=body)
    answer = _same(sync, job)
    assert job.status_code == 400 and answer["error"] == "bad_parameter"
    assert "format=png needs a 2D output" in answer["detail"]
    ok = client.post("/v1/jobs?model=gaussian-2d&format=png", content=b"")  # 2D: png is fine
    assert ok.status_code == 400 and "empty" in ok.json()["detail"].lower()

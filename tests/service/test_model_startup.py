"""Start-up that one bad model cannot break: unavailable models, strict mode, reload, replaced built-ins."""

from __future__ import annotations

import gzip
import warnings
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from fastapi.testclient import TestClient

from models import ModelRepository, SpecError
from service.app import create_app
from service.cli import main


def _torchscript(path: Path, out_channels: int) -> Path:
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, out_channels, 3, padding=1).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript deprecation notices
        torch.jit.trace(net, torch.zeros(1, 1, 8, 8, 8)).save(str(path))
    return path


def _spec(folder: Path, name: str, **fields: Any) -> Path:
    data = {"name": name, "spatial_dims": 3, "in_channels": 1, "out_channels": 2, **fields}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    """One good model and four bad ones: a typo, a missing file, an unimportable architecture and a
    wrong ``out_channels``."""
    folder = tmp_path / "models"
    folder.mkdir()
    _torchscript(folder / "good.pt", 2)
    _spec(folder, "good-3d", backend="torchscript", file="good.pt", receptive_field=1)
    _spec(folder, "typo-3d", backend="torchscript", file="good.pt", in_chanels=1)
    _spec(folder, "missing-3d", backend="torchscript", file="absent.pt")
    _spec(folder, "arch-3d", backend="eager", file="good.pt", architecture="no_such_package.nets:build")
    _spec(folder, "wrong-3d", backend="torchscript", file="good.pt", out_channels=3)
    return folder


def _nifti(tmp_path: Path) -> Path:
    path = tmp_path / "volume.nii.gz"
    volume = np.random.default_rng(0).random((20, 18, 16), dtype=np.float32)
    path.write_bytes(gzip.compress(nib.Nifti1Image(volume, np.eye(4)).to_bytes()))
    return path


def test_bad_models_are_listed_unavailable_and_the_others_serve(
    models_dir: Path, tmp_path: Path, make_settings: Any
) -> None:
    settings = make_settings(models_dir=models_dir, tmp_dir=tmp_path, device="cpu")
    body = _nifti(tmp_path).read_bytes()
    with TestClient(create_app(settings)) as client:
        listing = {m["name"]: m for m in client.get("/v1/models").json()}
        ready = client.get("/readyz").json()
        answers = {name: client.post(f"/v1/models/{name}/infer", content=body) for name in listing}
        one = client.get("/v1/models/wrong-3d").json()
    reasons = {name: m.get("reason") for name, m in listing.items() if m["status"] == "unavailable"}
    assert set(reasons) == {"typo-3d", "missing-3d", "arch-3d", "wrong-3d"} == set(ready["unavailable"])
    assert "typo-3d.yaml" in reasons["typo-3d"] and "field 'in_chanels' is unknown" in reasons["typo-3d"]
    assert "missing-3d.yaml" in reasons["missing-3d"] and "field 'file'" in reasons["missing-3d"]
    assert "arch-3d.yaml" in reasons["arch-3d"] and "field 'architecture'" in reasons["arch-3d"]
    assert "wrong-3d.yaml" in reasons["wrong-3d"]
    assert "field 'out_channels' is 3, the network returns 2" in reasons["wrong-3d"]
    assert one == {"name": "wrong-3d", "status": "unavailable", "reason": reasons["wrong-3d"]}
    assert listing["good-3d"]["status"] == "ready" and listing["gaussian-3d"]["status"] == "ready"
    for name, response in answers.items():
        if name in reasons:
            assert response.status_code == 503 and response.json()["error"] == "model_unavailable", name
            assert reasons[name] in response.json()["detail"]
        elif name.endswith("-3d"):
            assert response.status_code == 200, (name, response.text)


def test_strict_models_make_any_failure_fatal(models_dir: Path, tmp_path: Path, make_settings: Any) -> None:
    settings = make_settings(models_dir=models_dir, tmp_dir=tmp_path, device="cpu", strict_models=True)
    with pytest.raises(SpecError, match="in_chanels"), TestClient(create_app(settings)):
        pass
    # the failed start closed its work folder's lock file (issue 25 item 17: ResourceWarning)
    import gc
    import warnings

    from service.workdir import _FOLDER

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught
    assert not any((tmp_path / _FOLDER).glob("*")) if (tmp_path / _FOLDER).exists() else True
    for name in ("typo-3d", "arch-3d", "missing-3d"):
        (models_dir / f"{name}.yaml").unlink()
    with pytest.raises(SpecError, match="field 'out_channels' is 3"):
        ModelRepository(models_dir, device="cpu", strict=True).warmup()


def test_infer_command_with_a_builtin_works_beside_bad_specs(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TILEWISE_MODELS_DIR", str(models_dir))
    out = tmp_path / "out.nii.gz"
    assert main(["infer", str(_nifti(tmp_path)), str(out), "--model", "gaussian-3d", "--device", "cpu"]) == 0
    assert nib.load(out).shape == (20, 18, 16)


def test_reload_rescans_and_a_folder_spec_replaces_a_builtin(
    tmp_path: Path, make_settings: Any, models_dir: Path
) -> None:
    folder = tmp_path / "late"
    folder.mkdir()
    settings = make_settings(
        models_dir=folder, tmp_dir=tmp_path, device="cpu", api_key="s3cret", warmup=False
    )
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(create_app(settings)) as client:
        before = {m["name"] for m in client.get("/v1/models", headers=auth).json()}
        (folder / "good.pt").write_bytes((models_dir / "good.pt").read_bytes())
        _spec(folder, "good-3d", backend="torchscript", file="good.pt")
        replaced = {"name": "gaussian-2d", "backend": "analytic", "architecture": "gaussian",
                    "spatial_dims": 2, "in_channels": 1, "out_channels": 1, "params": {"sigma": 1.0},
                    "receptive_field": 4}  # fmt: skip
        (folder / "mine.yaml").write_text(yaml.safe_dump(replaced), encoding="utf-8")
        assert client.post("/v1/models/reload").status_code == 401  # the API key is required
        after = client.post("/v1/models/reload", headers=auth)
        gaussian = client.get("/v1/models/gaussian-2d", headers=auth).json()
    assert "good-3d" not in before and after.status_code == 200
    listing = {m["name"]: m for m in after.json()}
    assert listing["good-3d"]["status"] == "ready"
    assert gaussian["params"] == {"sigma": 1.0} and gaussian["receptive_field"] == [4, 4]


def test_a_model_that_fails_on_first_use_is_unavailable_from_then_on(
    models_dir: Path, tmp_path: Path, make_settings: Any
) -> None:
    settings = make_settings(models_dir=models_dir, tmp_dir=tmp_path, device="cpu", warmup=False)
    body = _nifti(tmp_path).read_bytes()
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/models/missing-3d").json()["status"] == "ready"  # not loaded yet
        first = client.post("/v1/models/missing-3d/infer", content=body)
        listed = client.get("/v1/models/missing-3d").json()
    assert first.status_code == 503 and first.json()["error"] == "model_unavailable"
    assert listed["status"] == "unavailable" and "field 'file'" in listed["reason"]

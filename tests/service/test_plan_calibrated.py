"""``tilewise plan`` reports the plan that runs: the calibrated halo, its tiles, and the server's ETA.

Issue 25 item 11: the dry run used to report the receptive-field radius for ``halo=auto`` (the run
calibrates a smaller halo on the image itself), so plan and run disagreed (3 vs 2). Now the dry
run calibrates on the run's own sample (the preprocessed image on the model grid), or reads that
calibration from the measurements, and the run reuses it. Compared: the CLI's plan (a fresh process'
repository reading the shared measurements) against the ``X-Tilewise-Plan`` of the server's real
run and the ``eta_s`` of the server's dry run, for ``tissue-3d`` on an MNI152 crop and for an
imported MONAI bundle (a local network: ``halo: auto``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from _import_kit import need, write_monai_bundle  # noqa: E402


@pytest.fixture(scope="module")
def mni152(mni152_path: Path) -> np.ndarray:
    """The 1 mm MNI152 T1 template as float32 (197 x 233 x 189)."""
    return np.asarray(nib.load(mni152_path).get_fdata(dtype=np.float32))


def _cli_plan(path: Path, *options: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(path), "--device", "cpu", *options]) == 0
    return json.loads(out.getvalue())


def _header(plan: dict[str, Any]) -> str:
    return f"tile={','.join(map(str, plan['tile']))}; halo={','.join(map(str, plan['halo']))};"


def _plan_equals_run(client: TestClient, model: str, path: Path, query: str, plan: dict[str, Any]) -> None:
    dry = client.post(f"/v1/models/{model}/infer?dry_run=true&{query}", content=path.read_bytes())
    assert dry.status_code == 200, dry.text
    assert dry.json()["eta_s"] == plan["eta_s"] and dry.json()["halo"] == plan["halo"]
    ran = client.post(f"/v1/models/{model}/infer?format=npy&{query}", content=path.read_bytes())
    assert ran.status_code == 200, ran.text
    header = ran.headers["x-tilewise-plan"]
    assert header.startswith(_header(plan)) and f"tiles={plan['tiles']};" in header, (header, plan)


def test_tissue_plan_is_the_run_with_a_calibrated_halo(
    mni152: np.ndarray, tmp_path: Path, make_settings: Any
) -> None:
    path = tmp_path / "crop.nii.gz"
    nib.save(nib.Nifti1Image(np.ascontiguousarray(mni152[60:140, 70:160, 50:120]), np.eye(4)), path)
    plan = _cli_plan(path, "--model", "tissue-3d", "--tile", "48", "--halo", "auto")
    assert plan["tiles"] > 1 and plan["halo_source"].startswith("sample"), plan["halo_source"]
    assert plan["halo"] != [23, 23, 23]  # the radius, which the run never used
    settings = make_settings(tmp_dir=tmp_path, device="cpu")
    with TestClient(create_app(settings)) as client:
        _plan_equals_run(client, "tissue-3d", path, "tile=48&halo=auto", plan)


@pytest.mark.slow  # four CLI processes' worth of torch start-up and one footprint
def test_tissue_plan_reads_the_measurements_and_measures_nothing(mni152: np.ndarray, tmp_path: Path) -> None:
    """Second ``tilewise plan`` of the whole template: no footprint, no calibration (the cache)."""
    path = tmp_path / "mni.nii.gz"
    nib.save(nib.Nifti1Image(mni152, np.eye(4)), path)
    env = {**os.environ, "TILEWISE_MEASUREMENTS_DIR": str(tmp_path / "measured"), "TILEWISE_DEVICE": "cpu"}
    argv = [
        sys.executable,
        "-m",
        "service.cli",
        "--log-level",
        "INFO",
        "plan",
        str(path),
        "--model",
        "tissue-3d",
    ]
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "footprint: batch" not in second.stderr and "calibrated halo" not in second.stderr
    assert json.loads(first.stdout)["eta_s"] == json.loads(second.stdout)["eta_s"]


def test_bundle_plan_is_the_run_with_a_calibrated_halo(tmp_path: Path, make_settings: Any) -> None:
    need("monai")
    bundle, models = tmp_path / "bundle", tmp_path / "models"
    write_monai_bundle(bundle, roi=(32, 32, 32))  # batch norm: local, halo auto
    assert main(["import-model", str(bundle), "--name", "local", "--models", str(models)]) == 0
    rng = np.random.default_rng(2)
    coarse = rng.uniform(0, 120, (20, 18, 16)).astype(np.float32)
    volume = np.kron(coarse, np.ones((4, 4, 4), np.float32))[:77, :70, :61]
    path = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(volume, np.eye(4)), path)
    plan = _cli_plan(path, "--model", "local", "--models", str(models))
    assert plan["tiles"] > 1 and plan["halo_source"].startswith("sample"), plan["halo_source"]
    settings = make_settings(models_dir=models, tmp_dir=tmp_path, device="cpu")
    with TestClient(create_app(settings)) as client:
        _plan_equals_run(client, "local", path, "", plan)

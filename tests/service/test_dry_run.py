"""The dry run (HTTP ``dry_run=true`` and ``tilewise plan``): the plan as JSON, the network not run;
``TILEWISE_MEMORY_BUDGET`` picks the tile and batch; the pipeline reports the plan that ran after an
out-of-memory retry."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from _inprocess import InProcessClient

from models import InferenceParams, ModelRepository
from models.errors import DeviceOutOfMemoryError
from models.model import Model
from service.app import create_app
from service.codecs import decode
from service.pipeline import run_volume

KEYS = {"model", "input_shape", "model_shape", "tile", "halo", "overlap", "blend", "batch_size", "tiles",
        "work", "peak_bytes", "eta_s", "tta", "tile_dependent"}  # fmt: skip


def _nifti(path: Path, shape: tuple[int, ...]) -> Path:
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    return path


class Counting:
    """Counts the forward passes of a predictor (after warm-up)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(batch)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessClient, Path]]:
    from service.settings import Settings

    root = tmp_path_factory.mktemp("dry-run")
    (root / "models").mkdir()
    settings = Settings(_env_file=None, models_dir=root / "models", tmp_dir=root, device="cpu", warmup=False,
                        memory_budget=300 * 10**6)  # fmt: skip
    repository = ModelRepository(root / "models", device="cpu")
    model = repository.get("gaussian-3d")
    model.footprint()  # the warm-up's measurement
    model.predictor = Counting(model.predictor)
    with InProcessClient(create_app(settings, repository=repository)) as client:
        yield client, _nifti(root / "v.nii", (150, 120, 100))


def test_http_dry_run_answers_the_plan_without_running_the_network(
    served: tuple[InProcessClient, Path],
) -> None:
    client, volume = served
    predictor = client.app.state.repository.get("gaussian-3d").predictor
    before = predictor.calls
    response = client.post(
        "/v1/models/gaussian-3d/infer?dry_run=true&batch_size=2", content=volume.read_bytes()
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    plan = response.json()
    assert KEYS <= set(plan)
    assert plan["model"] == "gaussian-3d" and plan["input_shape"] == plan["model_shape"] == [150, 120, 100]
    assert plan["halo"] == [8, 8, 8] and plan["batch_size"] == 2 and plan["tta"] == "none"
    assert plan["tile_source"] == "budget" and plan["memory_budget"] == 300 * 10**6
    assert plan["peak_bytes"] <= 300 * 10**6 and plan["eta_s"] > 0 and plan["over_budget"] is None
    tiles = np.prod([-(-s // t) for s, t in zip([150, 120, 100], plan["tile"], strict=True)])
    assert plan["tiles"] >= tiles and 1 <= plan["work"] <= 2.4
    assert predictor.calls == before  # no forward pass


def test_http_dry_run_plan_is_the_plan_that_runs(served: tuple[InProcessClient, Path]) -> None:
    client, volume = served
    body = volume.read_bytes()
    plan = client.post("/v1/models/gaussian-3d/infer?dry_run=true&format=npy", content=body).json()
    ran = client.post("/v1/models/gaussian-3d/infer?format=npy", content=body)
    assert ran.status_code == 200
    tile, halo = ",".join(map(str, plan["tile"])), ",".join(map(str, plan["halo"]))
    assert ran.headers["x-tilewise-plan"].startswith(f"tile={tile}; halo={halo};")
    assert f"tiles={plan['tiles']};" in ran.headers["x-tilewise-plan"]


def test_http_dry_run_refuses_a_bad_flag(served: tuple[InProcessClient, Path]) -> None:
    client, volume = served
    response = client.post("/v1/models/gaussian-3d/infer?dry_run=maybe", content=volume.read_bytes())
    assert response.status_code == 400 and "dry_run" in response.json()["detail"]


def test_tilewise_plan_prints_the_same_plan(tmp_path: Path, empty_models_dir: Path) -> None:
    from service.cli import main

    volume = _nifti(tmp_path / "v.nii", (100, 90, 80))
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["plan", str(volume), "--model", "gaussian-3d", "--device", "cpu", "--tile", "48"])
    assert status == 0
    plan = json.loads(out.getvalue())
    assert KEYS <= set(plan) and plan["tile_source"] == "given" and plan["memory_budget"] is None
    model = ModelRepository(empty_models_dir, device="cpu").get("gaussian-3d")
    expected = model.plan((100, 90, 80), InferenceParams(tile=48))
    assert plan["tile"] == list(expected.grid.used_tile_shape) and plan["tiles"] == expected.n_tiles
    assert main(["plan", str(tmp_path / "missing.nii"), "--model", "gaussian-3d"]) == 2
    assert main(["plan", str(volume), "--model", "nope"]) == 2  # a usage error, as in infer and batch


def test_tilewise_plan_fits_a_memory_budget(tmp_path: Path) -> None:
    from service.cli import main

    volume = _nifti(tmp_path / "v.nii", (160, 160, 160))
    answers = []
    for budget in (90 * 2**20, 400 * 2**20):
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["plan", str(volume), "--model", "gaussian-3d", "--memory-budget", str(budget)]) == 0
        answers.append(json.loads(out.getvalue()))
    small, large = answers
    assert small["peak_bytes"] <= 90 * 2**20 < large["peak_bytes"] <= 400 * 2**20
    assert large["tiles"] < small["tiles"] and large["eta_s"] < small["eta_s"]


def test_a_memory_budget_no_plan_meets_is_said_not_hidden(tmp_path: Path, monkeypatch) -> None:
    """A budget below what the input and output alone take: the smallest plan, and a warning in the
    dry run (the same text the run sends as X-Tilewise-Warning); sizes take units, as the variable."""
    from service.cli import main

    volume = _nifti(tmp_path / "v.nii", (160, 160, 160))
    answers = {}
    # a streamed .nii holds neither input nor output (issue 20): only a budget below the smallest
    # tile's own memory is unmet
    for budget in ("3MB", "400MiB"):
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["plan", str(volume), "--model", "gaussian-3d", "--memory-budget", budget]) == 0
        answers[budget] = json.loads(out.getvalue())
    tight, roomy = answers["3MB"], answers["400MiB"]
    assert tight["streamed"] is True and tight["disk_bytes"] >= 4 * 160**3
    assert tight["memory_budget"] == 3_000_000 and roomy["memory_budget"] == 400 * 2**20
    assert tight["peak_bytes"] > 3_000_000
    assert "no plan fits the memory budget of 3 MiB" in tight["warning"], tight["warning"]
    assert roomy["warning"] is None and roomy["peak_bytes"] <= 400 * 2**20
    model = ModelRepository(tmp_path / "models", device="cpu").get("gaussian-3d")
    plan = model.plan((160, 160, 160), memory_budget=20_000_000)  # without the request's input
    assert plan.warning is not None and plan.warning.startswith("no plan fits the memory budget of 19 MiB")
    with pytest.raises(SystemExit):  # argparse: a size it cannot read
        main(["plan", str(volume), "--model", "gaussian-3d", "--memory-budget", "3xB"])
    from service.settings import Settings

    monkeypatch.setenv("TILEWISE_MEMORY_BUDGET", "2GiB")
    assert Settings().memory_budget == 2 * 2**30
    monkeypatch.setenv("TILEWISE_MEMORY_BUDGET", "")
    assert Settings().memory_budget is None


class _OutOfMemoryAbove1:
    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] > 1:
            raise DeviceOutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(batch)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_the_pipeline_reports_the_plan_that_ran_after_out_of_memory(
    tmp_path: Path, empty_models_dir: Path
) -> None:
    model = ModelRepository(empty_models_dir, device="cpu").get("gaussian-3d")
    failing = Model(model.spec, _OutOfMemoryAbove1(model.predictor))
    volume = decode(_nifti(tmp_path / "v.nii", (70, 60, 50)))
    reference = run_volume(model, volume, InferenceParams(tile=32, batch_size=1)).result
    run = run_volume(failing, volume, InferenceParams(tile=32, batch_size=4))
    np.testing.assert_array_equal(run.result, reference)
    assert run.plan.batch_size == 1 and run.plan.output == "probabilities"

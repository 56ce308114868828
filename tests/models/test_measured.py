"""Warm-up measurements kept on disk (issue 25 items 1, 11): a second warm-up measures nothing.

The network is a real TorchScript conv stack (radius 3 by construction: kernels 3 and 5), so the
receptive-field probe, the tile-dependence probe and the footprint all run on the first warm-up.
The second repository must answer the same figures without calling any of them (each is replaced
by a function that fails the test), and its warm-up must be a small fraction of the first's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
nn = torch.nn


def _stack_model(folder: Path) -> None:
    from models.export import export_torchscript

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 5, padding=2))  # radius 3
    export_torchscript(net.eval(), folder / "stack.pt", in_channels=1, export_shape=(32, 32))
    spec = {
        "name": "stack",
        "backend": "torchscript",
        "file": "stack.pt",
        "spatial_dims": 2,
        "in_channels": 1,
        "out_channels": 2,
        "defaults": {"tile": 64},
    }
    (folder / "stack.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")


def _forbid_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object, **__: object) -> None:
        raise AssertionError("measured again although the measurements were stored")

    import models.measure.calibration
    import models.measure.seams
    import models.model

    monkeypatch.setattr(models.measure.calibration, "probe_receptive_field", fail)
    monkeypatch.setattr(models.measure.seams, "probe_tile_dependence", fail)
    monkeypatch.setattr(models.model, "footprint_of", fail)


def test_second_warmup_reads_what_the_first_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from models import ModelRepository

    models_dir, cache = tmp_path / "models", tmp_path / "cache"
    models_dir.mkdir()
    _stack_model(models_dir)
    start = time.perf_counter()
    first = ModelRepository(models_dir, device="cpu", measurements_dir=cache)
    assert first.warming() == first.names()
    first.warmup(["stack", "gaussian-2d"])
    first_s = time.perf_counter() - start
    assert "stack" not in first.warming() and "gaussian-2d" not in first.warming()
    measured = first.get("stack").measurements()
    assert measured.receptive_field is not None and measured.receptive_field.radius == (3, 3)
    assert measured.tile_dependence is not None and measured.tile_dependence.tile_dependent is False
    # beside the model for the folder's own spec; the built-in's in the cache folder
    beside = list((models_dir / ".tilewise-measured").glob("stack-*.json"))
    assert len(beside) == 1 and json.loads(beside[0].read_text())["footprint"]["method"]
    assert list(cache.glob("gaussian-2d-*.json")) and not list(cache.glob("stack-*.json"))

    _forbid_measuring(monkeypatch)
    start = time.perf_counter()
    second = ModelRepository(models_dir, device="cpu", measurements_dir=cache)
    second.warmup(["stack", "gaussian-2d"])
    second_s = time.perf_counter() - start
    again = second.get("stack").measurements()
    assert again.receptive_field == measured.receptive_field
    assert again.tile_dependence == measured.tile_dependence
    assert again.footprint == measured.footprint
    assert second.spec("stack").info()["receptive_field"] == [3, 3]
    assert second_s < first_s / 2, (first_s, second_s)


def test_calibrated_halos_survive_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run after a restart plans the halo calibrated before it (not the bare radius)."""
    import numpy as np

    from models import InferenceParams, ModelRepository

    models_dir = tmp_path / "models"
    models_dir.mkdir()
    _stack_model(models_dir)
    first = ModelRepository(models_dir, device="cpu", measurements_dir=tmp_path / "cache")
    model = first.get("stack")
    x = np.random.default_rng(0).random((1, 150, 131), dtype=np.float32)
    params = InferenceParams(tile=64, halo="auto")
    ran = model.plan(x.shape[1:], params, sample=x)
    first.store_measurements("stack")

    _forbid_measuring(monkeypatch)
    second = ModelRepository(models_dir, device="cpu", measurements_dir=tmp_path / "cache")
    dry = second.get("stack").plan(x.shape[1:], params, calibrate=False)
    assert dry.halo == ran.halo and dry.tile == ran.tile
    assert dry.halo_source.startswith("dry run: sample"), dry.halo_source


def test_other_key_other_file_and_garbage_ignored(tmp_path: Path) -> None:
    """Another device or spec is another file; an unreadable file is measured again, not fatal."""
    from models import ModelRepository
    from models.measure.measured import MeasurementStore

    repo = ModelRepository(tmp_path / "none", device="cpu", measurements_dir=tmp_path / "cache")
    spec = repo.spec("gaussian-2d")
    store = MeasurementStore(tmp_path / "none", tmp_path / "cache")
    assert store.paths(spec, "cpu") != store.paths(spec, "cuda:0")
    other = spec.model_copy(update={"alignment": 2})
    assert store.paths(spec, "cpu") != store.paths(other, "cpu")
    path = store.paths(spec, "cpu")[-1]
    path.parent.mkdir(parents=True)
    path.write_text("{not json", encoding="utf-8")
    repo.warmup(["gaussian-2d"])  # measures, overwrites the garbage
    assert json.loads(path.read_text())["footprint"] is not None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_model_folder_uses_the_cache_dir(tmp_path: Path) -> None:
    from models import ModelRepository

    models_dir, cache = tmp_path / "models", tmp_path / "cache"
    models_dir.mkdir()
    _stack_model(models_dir)
    models_dir.chmod(0o555)
    try:
        ModelRepository(models_dir, device="cpu", measurements_dir=cache).warmup(["stack"])
    finally:
        models_dir.chmod(0o755)
    assert not (models_dir / ".tilewise-measured").exists()
    assert list(cache.glob("stack-*.json"))


def test_setup_models_folder_keeps_its_measurements_across_another_models_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The models ``setup-models`` installs (the user folder) keep their measurements beside them
    whichever ``--models`` folder the server starts on (a fresh-user trial re-measured
    ``brain-mask-3d`` and ``text-det-2d``, 43 s, after restarting with ``--models my-models``)."""
    from models import ModelRepository

    user, cache = tmp_path / "user", tmp_path / "cache"
    user.mkdir()
    _stack_model(user)
    first = ModelRepository(tmp_path / "none", device="cpu", measurements_dir=cache, user_models_dir=user)
    first.warmup(["stack"])
    assert list((user / ".tilewise-measured").glob("stack-*.json"))
    mine = tmp_path / "my-models"
    mine.mkdir()
    _forbid_measuring(monkeypatch)
    second = ModelRepository(mine, device="cpu", measurements_dir=cache, user_models_dir=user)
    second.warmup(["stack"])

"""Tile-dependent networks (issue 12, item 3): detected at warm-up, ``halo=auto`` does not search.

The case that misbehaved: an instance-norm U-Net whose spec does not say it is tile-dependent,
with ``halo="auto"``, grew its halo hunting a tolerance no halo reaches (calibration inside the
request, more tiles). Now warm-up probes it once; the request then runs the blended default plan
(half-tile overlap, Gaussian blend, no halo) with no more network calls than that plan, no
calibration, and a measured seam. Network calls are counted with a forward pre-hook.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from models import InferenceParams, ModelRepository
from models.execution.options import RunOptions
from models.zoo.nets import UNet
from tiling import TileGrid

logger = logging.getLogger(__name__)


def _write(folder: Path, name: str, norm: str, **extra: Any) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    params = {"features": 4, "levels": 2, "norm": norm}
    save_file(UNet(3, 1, 2, **params).state_dict(), str(folder / f"{name}.safetensors"))
    spec = {
        "name": name,
        "backend": "eager",
        "architecture": "unet",
        "params": params,
        "file": f"{name}.safetensors",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "alignment": 4,
        "output": {"activation": "softmax", "kind": "labels"},
        "defaults": {"tile": 32, "halo": "auto", "batch_size": 2},
        **extra,
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> ModelRepository:
    folder = tmp_path_factory.mktemp("dependence")
    _write(folder, "inorm-3d", "instance")
    _write(folder, "bnorm-3d", "batch", receptive_field=10)
    repository = ModelRepository(folder, device="cpu")
    repository.warmup()
    return repository


def _count_calls(model: Any) -> list[int]:
    """Batch sizes of every forward pass of ``model``'s network from now on."""
    calls: list[int] = []
    model.predictor.module.register_forward_pre_hook(lambda _m, args: calls.append(int(args[0].shape[0])))
    return calls


def test_warmup_probes_and_lists_tile_dependence(repo: ModelRepository) -> None:
    assert repo.spec("inorm-3d").info()["tile_dependent"] is True
    assert repo.spec("bnorm-3d").info()["tile_dependent"] is False
    assert repo.spec("gaussian-3d").info()["tile_dependent"] is False  # analytic: local, no probe


def test_auto_halo_runs_the_blended_default_plan(
    repo: ModelRepository, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = repo.get("inorm-3d")

    def no_search(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no calibration or radius probe inside the request")

    monkeypatch.setattr(model.calibrator, "calibrate", no_search)
    monkeypatch.setattr(model.calibrator, "receptive_field", no_search)
    calls = _count_calls(model)
    x = rng.standard_normal((1, 70, 60, 40)).astype(np.float32)
    plan = model.plan(x.shape[1:], InferenceParams(halo="auto"), sample=x)
    assert plan.halo_source == "tile-dependent" and plan.halo == (0, 0, 0)
    assert plan.overlap == (16, 16, 16) and plan.blend == "gaussian" and plan.grid.fixed_tile_shape
    assert not calls  # planning ran nothing: the probe ran at warm-up
    blended = TileGrid.plan(x.shape[1:], 32, overlap=16, alignment=4, blend="gaussian", fixed_tile_shape=True)
    assert plan.grid.n_tiles == blended.n_tiles
    seam = model.seam_stats(plan)
    assert seam is not None
    labels = model.execute(x, plan, options=RunOptions(seam=seam))
    assert labels.shape == x.shape[1:]
    assert len(calls) == math.ceil(blended.n_tiles / 2) and sum(calls) == blended.n_tiles
    assert seam.measured and 0 < seam.max_abs <= 1 and seam.mean_abs < seam.max_abs
    logger.info(
        "instance-norm U-Net, halo=auto: %d tiles in %d calls; seam %s", sum(calls), len(calls), seam.header()
    )


def test_request_overrides_and_local_models(repo: ModelRepository, rng: np.random.Generator) -> None:
    """A request's own overlap and blend hold; a local model keeps calibrating (and reports a seam
    only when its halo is below its radius)."""
    model = repo.get("inorm-3d")
    plan = model.plan((70, 60, 40), InferenceParams(halo="auto", overlap=8, blend="hann"))
    assert plan.overlap == (8, 8, 8) and plan.blend == "hann" and plan.halo == (0, 0, 0)
    local = repo.get("bnorm-3d")
    x = rng.standard_normal((1, 70, 60, 40)).astype(np.float32)
    assert local.seam_stats(local.plan(x.shape[1:], InferenceParams(halo=10))) is None
    short = local.plan(x.shape[1:], InferenceParams(halo=4, overlap=4))
    seam = local.seam_stats(short)
    assert seam is not None
    local.execute(x, short, options=RunOptions(seam=seam))
    assert seam.measured and seam.max_abs > 1e-3  # the halo lacks 6 voxels of context


def test_no_seam_reported_when_a_grown_tiles_calibration_met_its_tolerance(
    repo: ModelRepository, rng: np.random.Generator
) -> None:
    """A local model with ``halo=auto`` whose tile the planner grew: the grown tile is calibrated on
    its own crop of the request's image (another sample name than the first tile's). When that
    calibration met its tolerance, the kept output is within it of the whole pass, so no seam is
    reported (the trial's MONAI bundle sent ``max=0.10`` for a run within 1.2e-7 of the whole pass)."""
    local = repo.get("bnorm-3d")
    x = rng.standard_normal((1, 65, 76, 49)).astype(np.float32)
    plan = local.plan(x.shape[1:], InferenceParams(halo="auto", tile=24), sample=x)
    assert plan.halo_source.startswith("sample ")
    _, halos = local.calibrator.measured()
    mine = [c for (t, _, _), c in halos if tuple(t) == tuple(plan.tile)]
    assert mine and mine[-1].met, "the plan's own tile was calibrated on the sample and met it"
    assert local.seam_stats(plan) is None
    whole = local.execute(x, local.plan(x.shape[1:], InferenceParams(tile=(68, 76, 52), halo=0)))
    tiled = local.execute(x, plan)
    assert np.mean(whole != tiled) < 1e-3  # labels of the kept output equal the whole pass

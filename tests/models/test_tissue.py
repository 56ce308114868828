"""tissue-3d: committed weights and their records, Dice on the held-out band, exact tiling, training.

The acceptance bars (issue 12): Dice >= 0.85 (grey matter) and >= 0.90 (white matter) on the
held-out axial band of the MNI152 template, measured on the full-volume prediction; tiled logits
equal the whole-volume pass within 1e-5 with identical labels; a re-training from scratch lands
within 0.02 Dice of the committed metrics (``slow``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiling
from models import InferenceParams, ModelRepository
from models.transforms.preprocess import preprocess
from models.weights import sha256_file
from models.zoo.tissue_net import ALIGNMENT, RECEPTIVE_FIELD, TissueUNet
from models.zoo.train_tissue import (
    LABEL_NAMES,
    SPEC_PATH,
    TrainConfig,
    _PatchSampler,
    band_dice,
    dice_scores,
    held_out_band,
    load_mni152,
    run,
    train_module,
)

logger = logging.getLogger(__name__)

BUILTIN = SPEC_PATH.parent
# Issue 12's bars on the held-out band (the committed weights reach 0.93 and 0.92).
BARS = {"grey matter": 0.85, "white matter": 0.90}


@pytest.fixture(scope="module")
def template() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(t1, maps, labels)`` of the MNI152 template (raw T1, class maps, uint8 labels)."""
    return load_mni152()


@pytest.fixture(scope="module")
def tissue(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The built-in tissue-3d model, loaded through the repository on the CPU."""
    repo = ModelRepository(tmp_path_factory.mktemp("no-extra-models") / "missing", device="cpu")
    return repo.get("tissue-3d")


@pytest.fixture(scope="module")
def metrics() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((BUILTIN / "tissue-3d.metrics.json").read_text(encoding="utf-8"))
    return data


def _whole(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """One forward pass over the whole ``(1, *spatial)`` input, zero-padded at the far ends to the
    alignment (as tiling pads), cropped back: ``(3, *spatial)`` logits."""
    pad = [(0, 0)] + [(0, -s % ALIGNMENT) for s in x.shape[1:]]
    with torch.inference_mode():
        out = module(torch.from_numpy(np.pad(x, pad))[None])[0].numpy()
    return out[(slice(None), *(slice(0, s) for s in x.shape[1:]))]


def test_records_agree_with_the_weights(tissue: Any, metrics: dict[str, Any]) -> None:
    """Spec, .sha256 file and metrics name the committed file's digest; sizes and fields as documented."""
    spec = tissue.spec
    weights = BUILTIN / "tissue-3d.safetensors"
    digest = sha256_file(weights)
    assert spec.file == weights.resolve()
    assert spec.sha256 == digest
    assert (BUILTIN / "tissue-3d.sha256").read_text(encoding="utf-8") == f"{digest}  tissue-3d.safetensors\n"
    assert metrics["sha256"] == digest
    assert weights.stat().st_size == metrics["weights_bytes"] < 2 * 1024 * 1024
    module = tissue.predictor.module
    assert isinstance(module, TissueUNet)
    assert sum(p.numel() for p in module.parameters()) == metrics["parameters"]
    assert (spec.alignment, spec.receptive_field) == (ALIGNMENT, (RECEPTIVE_FIELD,) * 3)
    assert all(h >= RECEPTIVE_FIELD for h in spec.defaults.halo)
    assert (spec.in_channels, spec.out_channels, spec.activation, spec.output_kind) == (
        1,
        3,
        "softmax",
        "labels",
    )
    assert not spec.tile_dependent
    assert [(s.kind, dict(s.params)) for s in spec.preprocess] == [("percentile", {"lo": 0.0, "hi": 99.5})]
    for name, bar in BARS.items():
        assert metrics["dice"][name] >= bar, (name, metrics["dice"])
    # "under 15 minutes on 2 CPU cores": CPU-seconds summed over the 2 threads, under 2 x 15 minutes
    assert metrics["config"]["threads"] == 2 and metrics["train_cpu_seconds"] < 2 * 15 * 60


def test_receptive_field_is_the_impulse_response_radius() -> None:
    """RECEPTIVE_FIELD (the spec's radius, the halo's lower bound) is what an impulse reaches, per axis."""
    torch.manual_seed(0)
    module = TissueUNet().double().eval()  # float64: no change is lost to rounding
    length, narrow = 96, 16
    for axis in range(3):
        shape = [narrow] * 3
        shape[axis] = length
        x = torch.randn(1, 1, *shape, dtype=torch.float64)
        reach = 0
        with torch.inference_mode():
            base = module(x)
            for phase in range(ALIGNMENT):  # every position on the stride-4 grid
                centre = [narrow // 2] * 3
                centre[axis] = length // 2 + phase
                y = x.clone()
                y[(0, 0, *centre)] += 1.0
                changed = (module(y) - base).abs().amax(dim=(0, 1))
                other = tuple(a for a in range(3) if a != axis)
                where = torch.nonzero(changed.amax(dim=other) > 0).ravel()
                reach = max(reach, centre[axis] - int(where.min()), int(where.max()) - centre[axis])
        assert reach == RECEPTIVE_FIELD, (axis, reach)


def test_held_out_band_is_never_read_in_training(template: tuple[np.ndarray, ...]) -> None:
    """The band is the middle 20 % of the brain's z-extent; patches never read it, not even by
    interpolation (NaN planted in the band would poison any patch that touched it)."""
    t1, maps, labels = template
    band = held_out_band(labels)
    assert band == (62, 93)
    x = (t1 / np.float32(t1.max()))[None].astype(np.float32)
    poisoned_x, poisoned_maps = x.copy(), maps.copy()
    poisoned_x[..., band[0] : band[1]] = np.nan
    poisoned_maps[..., band[0] : band[1]] = np.nan
    config = TrainConfig(batch_size=4, patch=48)
    sampler = _PatchSampler(poisoned_x, poisoned_maps, labels, band, config, np.random.default_rng(0))
    for _ in range(10):
        inputs, targets = sampler.batch()
        assert torch.isfinite(inputs).all()
        assert set(torch.unique(targets).tolist()) <= {0, 1, 2}
    assert sampler.rejected > 0  # draws near the band were refused, so the check had work to do
    # and a sampler without the band rule would read it: the poison is visible
    sampler = _PatchSampler(poisoned_x, poisoned_maps, labels, (0, 0), config, np.random.default_rng(0))
    seen = [not torch.isfinite(sampler.batch()[0]).all() for _ in range(10)]
    assert any(seen)


def test_dice_on_held_out_band_meets_the_bars(
    template: tuple[np.ndarray, ...], tissue: Any, metrics: dict[str, Any]
) -> None:
    """Committed weights through the served path (whole MNI152, default tile and halo, labels):
    Dice on the band >= the bars, and equal to the script's own figures."""
    t1, _, labels = template
    band = held_out_band(labels)
    served = tissue.run(t1[None])  # default options: labels, tile 128, halo 24
    assert served.shape == labels.shape and served.dtype == np.uint8
    dice = dice_scores(served[..., band[0] : band[1]], labels[..., band[0] : band[1]])
    logger.info("tissue-3d band Dice (served): %s", dice)
    for name, bar in BARS.items():
        assert dice[name] >= bar, (name, dice)
    for name in LABEL_NAMES:
        assert dice[name] == pytest.approx(metrics["dice"][name], abs=2e-4), (name, dice, metrics["dice"])
    # the script's measure (whole-volume logits on the band) gives the same figures
    x = preprocess(t1[None], tissue.spec)
    direct = band_dice(tissue.predictor.module, x, labels, band)
    for name in LABEL_NAMES:
        assert direct[name] == pytest.approx(dice[name], abs=2e-4)
    # the whole volume, not only the band, is segmented sensibly
    whole = dice_scores(served, labels)
    assert whole["grey matter"] >= 0.85 and whole["white matter"] >= 0.90, whole


@pytest.mark.parametrize("tile", [128, (128, 96, 112)])
def test_tiled_equals_whole_volume(template: tuple[np.ndarray, ...], tissue: Any, tile: Any) -> None:
    """Tiles with halo = the receptive-field radius reproduce the whole-volume pass: logits within
    1e-5 and identical labels, on an odd-sized crop holding the volume's bottom border."""
    t1 = template[0]
    x = preprocess(t1[None], tissue.spec)[:, 30:177, 41:182, 0:101]  # 147 x 141 x 101, z from 0
    module = tissue.predictor.module
    whole = _whole(module, x)
    tiled = tiling.tiled_inference(
        x, tissue.predictor, tile, halo=RECEPTIVE_FIELD, alignment=ALIGNMENT, batch_size=2
    )
    err = float(np.abs(tiled - whole).max())
    logger.info("tissue-3d tiled %s vs whole on %s: max abs logit diff %.3g", tile, x.shape, err)
    assert tiled.shape == whole.shape
    assert err <= 1e-5
    assert np.array_equal(np.argmax(tiled, axis=0), np.argmax(whole, axis=0))


def test_served_model_matches_the_network(tissue: Any, template: tuple[np.ndarray, ...]) -> None:
    """``Model.run`` on raw data (percentile scaling, tiles, then softmax and argmax per finalized
    region): the same labels as the network's whole pass."""
    t1 = template[0]
    raw = t1[None, 60:124, 80:160, 40:100]  # 64 x 80 x 60 of raw 0..255 values
    labels = tissue.run(raw, InferenceParams(tile=64, halo=RECEPTIVE_FIELD))
    expected = np.argmax(_whole(tissue.predictor.module, preprocess(raw, tissue.spec)), axis=0)
    assert labels.dtype == np.uint8 and np.array_equal(labels, expected)
    assert set(np.unique(labels).tolist()) == {0, 1, 2}
    probabilities = tissue.run(raw, InferenceParams(tile=64, halo=RECEPTIVE_FIELD, output="probabilities"))
    assert probabilities.shape == (3, *raw.shape[1:])
    np.testing.assert_allclose(probabilities.sum(axis=0), 1.0, atol=1e-5)


def test_training_is_deterministic(template: tuple[np.ndarray, ...]) -> None:
    """Same seed, same weights bit for bit; another seed, other weights. Global torch state restored."""
    t1, maps, labels = template
    x = (t1 / np.float32(t1.max()))[None].astype(np.float32)
    band = held_out_band(labels)
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    config = TrainConfig(steps=2, batch_size=1, patch=24, patch_z=16)
    runs = [train_module(c, x, maps, labels, band)[0].state_dict() for c in (config, config)]
    other = train_module(replace(config, seed=1), x, maps, labels, band)[0]
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], v) for k, v in other.state_dict().items())
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_cli_writes_weights_digest_and_metrics(tmp_path: Path) -> None:
    """``tilewise train-tissue`` (two steps) writes the three files, consistent with each other."""
    from service.cli import main

    assert main(["train-tissue", "--out", str(tmp_path), "--steps", "2", "--seed", "3"]) == 0
    weights = tmp_path / "tissue-3d.safetensors"
    digest = sha256_file(weights)
    assert (tmp_path / "tissue-3d.sha256").read_text(encoding="utf-8") == f"{digest}  tissue-3d.safetensors\n"
    metrics = json.loads((tmp_path / "tissue-3d.metrics.json").read_text(encoding="utf-8"))
    assert metrics["sha256"] == digest
    assert metrics["config"]["seed"] == 3 and metrics["config"]["steps"] == 2
    assert metrics["held_out_band"] == {"axis": 2, "start": 62, "stop": 93, "slices": 31}
    assert set(metrics["dice"]) == set(LABEL_NAMES)
    assert weights.stat().st_size == metrics["weights_bytes"] < 2 * 1024 * 1024


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~8 min on 2 idle cores; far longer while other work shares them
def test_retraining_reproduces_the_committed_metrics(tmp_path: Path, metrics: dict[str, Any]) -> None:
    """From scratch with the committed configuration: within 0.02 Dice of the committed metrics."""
    config = TrainConfig(**metrics["config"])
    fresh = run(config, tmp_path)
    logger.info("re-trained tissue-3d: %s (committed %s)", fresh["dice"], metrics["dice"])
    for name in LABEL_NAMES:
        assert abs(fresh["dice"][name] - metrics["dice"][name]) <= 0.02, (
            name,
            fresh["dice"],
            metrics["dice"],
        )
    for name, bar in BARS.items():
        assert fresh["dice"][name] >= bar
    # "under 15 minutes on 2 CPU cores": CPU-seconds over both threads, whatever else runs here.
    assert fresh["train_cpu_seconds"] < 2 * 15 * 60
    if fresh["sha256"] != metrics["sha256"]:
        logger.warning("re-trained weights differ in bytes (another CPU or thread count rounds differently)")

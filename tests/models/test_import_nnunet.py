"""An nnU-Net v2 folder imported by tilewise predicts what ``nnUNetPredictor`` predicts.

The folder is written here in nnU-Net's own format: plans (3d_fullres, anisotropic pooling, CT
normalization, SimpleITK reader) and dataset JSON, and two folds of random weights for the network
nnU-Net builds from the plans. Arrays handed to nnU-Net are in its SimpleITK order ``(z, y, x)``;
tilewise gets the same voxels in NIfTI order ``(x, y, z)``, as its codecs decode them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from _import_kit import need, write_nnunet_folder

from models import Model, ModelRepository, parse_params
from service.cli import main

SPACING = [2.0, 1.0, 1.0]  # the plans' spacing (z, y, x): no resampling on either side


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_nnunet_folder(tmp_path_factory.mktemp("nnunet"))


@pytest.fixture(scope="module")
def models_dir(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models")
    assert main(["import-model", str(folder), "--models", str(out), "--name", "toy-ct-3d"]) == 0
    return out


@pytest.fixture(scope="module")
def model(models_dir: Path) -> Model:
    return ModelRepository(models_dir, device="cpu").get("toy-ct-3d")


def _predictor(folder: Path, *, mirroring: bool, exact: bool) -> Any:
    """``nnUNetPredictor`` on the folder's two folds (``exact``: float32 accumulation, one window)."""
    need("nnunetv2")
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    class Float32OneWindow(nnUNetPredictor):  # type: ignore[misc]
        """nnU-Net accumulates window logits in float16 (rounding 2**-11 relative, i.e. up to ~1e-3
        on these logits): with one window the gaussian weighting cancels, so the exact result is the
        window's mirrored prediction itself."""

        def _internal_predict_sliding_window_return_logits(self, data, slicers, do_on_device=True):
            assert len(slicers) == 1, "one window only"
            return self._internal_maybe_mirror_and_predict(data[slicers[0]][None].to(self.device))[0]

    cls = Float32OneWindow if exact else nnUNetPredictor
    predictor = cls(
        tile_step_size=0.5,
        use_gaussian=True,
        use_mirroring=mirroring,
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        verbose=False,
        allow_tqdm=False,
    )
    predictor.initialize_from_trained_model_folder(str(folder), use_folds=(0, 1))
    return predictor


def _ct(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A CT-like ``(1, z, y, x)`` volume in HU: air around a soft-tissue body with bright spots."""
    z, y, x = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    body = (y**2 + x**2 < 0.7) & (np.abs(z) < 0.95)
    volume = np.where(body, 40.0, -1000.0) + rng.normal(0, 30, shape)
    volume[body & (rng.random(shape) < 0.02)] = 900.0
    return volume[None].astype(np.float32)


def _to_tilewise(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(x, (1, 2, 3), (3, 2, 1)))  # (C, z, y, x) -> (C, x, y, z)


def _from_tilewise(y: np.ndarray) -> np.ndarray:
    return np.moveaxis(y, (-3, -2, -1), (-1, -2, -3))  # (..., x, y, z) -> (..., z, y, x)


def test_import_maps_plans_and_dataset(models_dir: Path) -> None:
    spec = yaml.safe_load((models_dir / "toy-ct-3d.yaml").read_text())
    assert spec["in_channels"] == 1 and spec["out_channels"] == 3
    assert spec["alignment"] == [8, 8, 4]  # (x, y, z): pooling strides (4, 8, 8) in (z, y, x), per axis
    assert spec["padding"] == "centred-nnunet"
    assert spec["tile_dependent"] is True  # instance norm
    assert spec["spacing"] == [1.0, 1.0, 2.0]  # (x, y, z): the plans' (z, y, x) reversed
    assert spec["labels"] == {0: "background", 1: "liver", 2: "tumour"}
    assert spec["preprocess"] == [
        {"type": "clip", "lo": [-900.0], "hi": [1200.0]},
        {"type": "normalize", "mean": [100.0], "std": [250.0]},
    ]
    assert spec["output"] == {"activation": "softmax", "kind": "labels", "tta_average": "logits"}
    assert spec["defaults"] == {"tile": [48, 48, 32], "halo": 0, "overlap": [24, 24, 16],
                                "blend": "gaussian", "batch_size": 1, "tta": "mirror"}  # fmt: skip


@pytest.mark.parametrize(
    "mirroring", [pytest.param(False, id="mirroring-off"), pytest.param(True, id="mirroring-on")]
)
def test_patch_sized_input_equals_nnunet_predictor(
    folder: Path, model: Model, mirroring: bool, rng: np.random.Generator
) -> None:
    x = _ct((32, 48, 48), rng)  # the patch size: one window in nnU-Net, one tile in tilewise
    tta = "mirror" if mirroring else "none"
    got = _from_tilewise(model.run(_to_tilewise(x), parse_params({"output": "probabilities", "tta": tta})))
    labels = _from_tilewise(model.run(_to_tilewise(x), parse_params({"output": "labels", "tta": tta})))
    seg, prob = _predictor(folder, mirroring=mirroring, exact=True).predict_single_npy_array(
        x, {"spacing": SPACING}, None, None, True
    )
    assert got.shape == prob.shape == (3, 32, 48, 48)
    assert np.abs(got - prob).max() <= 1e-4
    np.testing.assert_array_equal(labels, seg)
    # nnU-Net as shipped multiplies each window by a gaussian (10 at the centre) and accumulates in
    # float16: where that weight underflows (< 1e-3, the outer third of the patch) its logits are
    # rounded to nothing (probabilities of 1/3); elsewhere it equals ours up to float16 rounding
    from nnunetv2.inference.sliding_window_prediction import compute_gaussian

    seg16, prob16 = _predictor(folder, mirroring=mirroring, exact=False).predict_single_npy_array(
        x, {"spacing": SPACING}, None, None, True
    )
    weight = compute_gaussian((32, 48, 48), 1 / 8, 10, device=torch.device("cpu")).float().numpy()
    kept = weight >= 1e-3
    assert np.abs(got - prob16).max(axis=0)[kept].max() <= 1e-3
    top2 = np.sort(prob, axis=0)[-2:]
    clear = kept & (top2[1] - top2[0] > 4e-3)  # voxels whose label float16 rounding cannot flip
    np.testing.assert_array_equal(labels[clear], seg16[clear])


def test_larger_ct_agrees_with_whole_volume_at_least_as_well_as_nnunet(
    folder: Path, model: Model, rng: np.random.Generator
) -> None:
    x = _ct((40, 64, 64), rng)  # 2 windows per axis in both
    predictor = _predictor(folder, mirroring=False, exact=False)
    seg_nnunet = predictor.predict_single_npy_array(x, {"spacing": SPACING}, None, None, False)
    normalization = need("nnunetv2.preprocessing.normalization.default_normalization_schemes")
    props = predictor.plans_manager.foreground_intensity_properties_per_channel["0"]
    normalized = normalization.CTNormalization(intensityproperties=props).run(x.copy())
    with torch.inference_mode():  # the whole-volume pass: the folds' mean logits, one forward each
        logits = []
        for params in predictor.list_of_parameters:
            predictor.network.load_state_dict(params)
            logits.append(predictor.network(torch.from_numpy(normalized)[None])[0])
        whole = torch.stack(logits).mean(0).argmax(0).numpy()
    labels = _from_tilewise(model.run(_to_tilewise(x), parse_params({"tta": "none"})))
    nnunet_agreement = float(np.mean(seg_nnunet == whole))
    tilewise_agreement = float(np.mean(labels == whole))
    assert tilewise_agreement >= nnunet_agreement, (tilewise_agreement, nnunet_agreement)

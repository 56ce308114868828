"""Imported models place the image in their windows exactly as their own framework does (issue 23).

Oracles: MONAI's ``sliding_window_inference`` and the bundle's own MONAI pipeline (``ConfigParser``:
its transforms, network, weights and inferer), and ``nnUNetPredictor`` (its padding, windows,
gaussian and mirroring; accumulated in float32 instead of float16 so that it can be compared to
1e-4). Sizes below, on and above the window, off the network's alignment; small random networks
built with MONAI's and nnU-Net's own classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from _import_kit import need, nnunet_plans, write_monai_bundle, write_nnunet_folder

from models import ModelRepository, ParamError, parse_params
from models.geometry.mapping import run_mapped
from service.cli import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:NvImgCodecPydicomReader:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Orientationd.__init__.labels.:FutureWarning"),
]


def _bundle(
    root: Path,
    *,
    roi: tuple[int, ...],
    arch: dict[str, Any],
    norm: str,
    post: list[Any],
    mode: str = "constant",
    overlap: float = 0.25,
    seed: int = 0,
) -> torch.nn.Module:
    """The test kit's bundle with another UNet (``arch``), inferer mode and post-transforms."""
    nets = need("monai.networks.nets")
    write_monai_bundle(root, roi=roi, norm=norm, seed=seed)
    torch.manual_seed(seed)
    net = nets.UNet(spatial_dims=3, in_channels=1, num_res_units=1, norm=norm, **arch)
    torch.save(net.state_dict(), root / "models" / "model.pt")
    path = root / "configs" / "inference.json"
    config = json.loads(path.read_text())
    config["network_def"] = {"_target_": "UNet", "spatial_dims": 3, "in_channels": 1, "num_res_units": 1,
                             "norm": norm, **arch}  # fmt: skip
    config["inferer"].update(mode=mode, overlap=overlap)
    config["postprocessing"]["transforms"] = post
    path.write_text(json.dumps(config))
    meta_path = root / "configs" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    pred = meta["network_data_format"]["outputs"]["pred"]
    pred["num_channels"] = arch["out_channels"]
    pred["channel_def"] = {str(i): f"label {i}" for i in range(arch["out_channels"])}
    meta_path.write_text(json.dumps(meta))
    return net.eval()


def _import(source: Path, folder: Path, name: str) -> Any:
    assert main(["import-model", str(source), "--models", str(folder), "--name", name]) == 0
    return ModelRepository(folder, device="cpu").get(name)


def _scaled(volume: np.ndarray) -> torch.Tensor:
    """The kit bundle's ScaleIntensityRanged(0, 100, 0, 1, clip) as a ``(1, 1, *S)`` tensor."""
    return torch.from_numpy(np.clip(volume / 100.0, 0.0, 1.0).astype(np.float32))[None, None]


def _volume(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 120, [-(-s // 4) for s in shape]).astype(np.float32)
    return np.kron(coarse, np.ones((4, 4, 4), np.float32))[tuple(slice(0, s) for s in shape)]


SOFTMAX_POST = [{"_target_": "Activationsd", "keys": "pred", "softmax": True},
                {"_target_": "AsDiscreted", "keys": "pred", "argmax": True}]  # fmt: skip


@pytest.fixture(scope="module")
def dependent_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Any]:
    """A tile-dependent (instance-norm) bundle, roi 32, alignment 4, windows 24 apart (overlap 0.25)."""
    need("monai")
    root = tmp_path_factory.mktemp("bundles") / "dependent"
    arch = {"out_channels": 3, "channels": [4, 8, 16], "strides": [2, 2]}
    net = _bundle(root, roi=(32, 32, 32), arch=arch, norm="instance", post=SOFTMAX_POST)
    model = _import(root, tmp_path_factory.mktemp("models"), "dependent")
    return root, net, model


def test_bundle_spec_says_monai_placement(dependent_bundle: tuple[Path, Any, Any]) -> None:
    spec = dependent_bundle[2].spec
    assert spec.padding.value == "centred-monai" and spec.tile_dependent is True
    assert spec.defaults.tile == (32, 32, 32) and spec.defaults.overlap == (8, 8, 8)  # int(32 * 0.75) apart


@pytest.mark.parametrize(
    "shape",
    [pytest.param((19, 26, 30), id="below"), pytest.param((32, 32, 32), id="on"),
     pytest.param((32, 30, 45), id="mixed"), pytest.param((47, 37, 33), id="above")],
)  # fmt: skip
def test_tile_dependent_bundle_equals_monai_sliding_window(
    dependent_bundle: tuple[Path, Any, Any], shape: tuple[int, ...]
) -> None:
    from monai.inferers import sliding_window_inference

    _, net, model = dependent_bundle
    volume = _volume(shape, sum(shape))
    with torch.no_grad():
        logits = sliding_window_inference(
            _scaled(volume), (32, 32, 32), 2, net, overlap=0.25, mode="constant"
        )
    expected = torch.softmax(logits[0], 0).numpy()
    got = model.run(volume[None], parse_params({"output": "probabilities"}))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


def test_anisotropic_bundle_gets_per_axis_alignment_and_monai_windows(tmp_path: Path) -> None:
    from monai.inferers import sliding_window_inference

    need("monai")
    arch = {"out_channels": 2, "channels": [4, 8, 16], "strides": [[1, 2, 2], [2, 2, 2]]}
    net = _bundle(tmp_path / "aniso", roi=(18, 32, 32), arch=arch, norm="instance", post=SOFTMAX_POST)
    model = _import(tmp_path / "aniso", tmp_path / "models", "aniso")
    assert model.spec.alignment == (2, 4, 4) and model.spec.defaults.tile == (18, 32, 32)  # not 20 (lcm 4)
    volume = _volume((13, 29, 40), 5)
    with torch.no_grad():
        roi = (18, 32, 32)
        logits = sliding_window_inference(_scaled(volume), roi, 2, net, overlap=0.25, mode="constant")
    expected = torch.softmax(logits[0], 0).numpy()
    got = model.run(volume[None], parse_params({"output": "probabilities"}))
    assert np.abs(got - expected).max() <= 1e-4


def _monai_pipeline(bundle: Path, path: Path) -> np.ndarray:
    """MONAI's own run of the bundle (its transforms, network, weights, inferer) and the softmax."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle)
    network = parser.get_parsed_content("network_def")  # the kit's bundles carry no `$` code
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    data = parser.get_parsed_content("preprocessing")({"image": str(path)})
    with torch.no_grad():
        logits = parser.get_parsed_content("inferer")(data["image"][None], network.eval())[0]
    return torch.softmax(torch.as_tensor(logits), 0).numpy()


def test_lps_input_at_the_bundle_spacing_equals_the_bundle_pipeline(
    dependent_bundle: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    root, _, model = dependent_bundle
    volume = _volume((41, 29, 30), 7)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0])
    lps[:3, 3] = [20.0, 14.0, -15.0]
    path = tmp_path / "lps.nii.gz"
    nib.save(nib.Nifti1Image(volume, lps), path)
    expected_ras = _monai_pipeline(root, path)  # Orientationd(RAS): x and y reversed
    expected = np.ascontiguousarray(expected_ras[:, ::-1, ::-1])
    got = run_mapped(model, volume[None], lps, parse_params({"output": "probabilities"})).result
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


@pytest.fixture(scope="module")
def sigmoid_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Any]:
    """A multi-label bundle: sigmoid over 3 channels, AsDiscreted(threshold=0.5); roi 48, alignment 8."""
    need("monai")
    root = tmp_path_factory.mktemp("bundles") / "multilabel"
    arch = {"out_channels": 3, "channels": [4, 4, 8, 8], "strides": [2, 2, 2]}
    post = [{"_target_": "Activationsd", "keys": "pred", "sigmoid": True},
            {"_target_": "AsDiscreted", "keys": "pred", "threshold": 0.5}]  # fmt: skip
    net = _bundle(root, roi=(48, 48, 48), arch=arch, norm="batch", post=post, mode="gaussian", seed=3)
    return net, _import(root, tmp_path_factory.mktemp("models"), "multilabel")


@pytest.mark.parametrize("depth", [pytest.param(30, id="off-alignment"), pytest.param(32, id="on-alignment")])
def test_sigmoid_bundle_equals_monai_off_and_on_the_alignment(
    sigmoid_bundle: tuple[torch.nn.Module, Any], depth: int
) -> None:
    from monai.inferers import sliding_window_inference

    net, model = sigmoid_bundle
    assert model.spec.alignment == 8 and model.spec.output.kind.value == "probabilities"
    volume = _volume((40, 40, depth), depth)
    with torch.no_grad():  # 30 slices: MONAI pads 9 before, (48 - 30) // 2, not 8 (after 30 -> 32)
        logits = sliding_window_inference(
            _scaled(volume), (48, 48, 48), 1, net, overlap=0.25, mode="gaussian"
        )
    expected = torch.sigmoid(logits[0]).numpy()
    got = model.run(volume[None], parse_params({"output": "probabilities"}))
    assert np.abs(got - expected).max() <= 1e-4


def test_sigmoid_bundle_refuses_labels_by_name(sigmoid_bundle: tuple[torch.nn.Module, Any]) -> None:
    _, model = sigmoid_bundle
    with pytest.raises(ParamError, match="multi-label"):
        model.run(_volume((40, 40, 30), 1)[None], parse_params({"output": "labels"}))


# nnU-Net ------------------------------------------------------------------------------------------


def _nnunet_plans(strides: list[list[int]], patch: tuple[int, ...]) -> dict[str, Any]:
    """The kit's plans with another (small) PlainConvUNet: one stage per pooling stride."""
    plans = nnunet_plans(patch=patch)
    arch = plans["configurations"]["3d_fullres"]["architecture"]["arch_kwargs"]
    n = len(strides)
    arch.update(n_stages=n, features_per_stage=[4, 8, 8, 8][:n], kernel_sizes=[[3, 3, 3]] * n,
                strides=strides, n_conv_per_stage=[1] * n,
                n_conv_per_stage_decoder=[1] * (n - 1))  # fmt: skip
    return plans


def _float32_predictor(folder: Path, *, mirroring: bool) -> Any:
    """``nnUNetPredictor`` with its window loop accumulating in float32 (else nnU-Net's own code)."""
    need("nnunetv2")
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.inference.sliding_window_prediction import compute_gaussian

    class Float32(nnUNetPredictor):  # type: ignore[misc]
        def _internal_predict_sliding_window_return_logits(self, data, slicers, do_on_device=True):
            heads = self.label_manager.num_segmentation_heads
            logits = torch.zeros((heads, *data.shape[1:]), dtype=torch.float32)
            weights = torch.zeros(data.shape[1:], dtype=torch.float32)
            gaussian = compute_gaussian(
                tuple(self.configuration_manager.patch_size),
                sigma_scale=1.0 / 8,
                value_scaling_factor=10,
                dtype=torch.float32,
                device=self.device,
            )
            for sl in slicers:
                prediction = self._internal_maybe_mirror_and_predict(data[sl][None])[0]
                logits[sl] += prediction * gaussian
                weights[sl[1:]] += gaussian
            return logits / weights

    predictor = Float32(tile_step_size=0.5, use_gaussian=True, use_mirroring=mirroring,
                        perform_everything_on_device=False, device=torch.device("cpu"), verbose=False,
                        allow_tqdm=False)  # fmt: skip
    predictor.initialize_from_trained_model_folder(str(folder), use_folds=(0, 1))
    return predictor


def _ct(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A CT-like ``(1, z, y, x)`` volume in HU."""
    rng = np.random.default_rng(seed)
    z, y, x = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    body = (y**2 + x**2 < 0.7) & (np.abs(z) < 0.95)
    volume = np.where(body, 40.0, -1000.0) + rng.normal(0, 30, shape)
    volume[body & (rng.random(shape) < 0.02)] = 900.0
    return volume[None].astype(np.float32)


def _to_tilewise(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(x, (1, 2, 3), (3, 2, 1)))  # (C, z, y, x) -> (C, x, y, z)


def _from_tilewise(y: np.ndarray) -> np.ndarray:
    return np.moveaxis(y, (-3, -2, -1), (-1, -2, -3))


STRIDES = {
    "2-8-8": ([[1, 1, 1], [1, 2, 2], [1, 2, 2], [2, 2, 2]], (20, 48, 48), [8, 8, 2]),
    "1-2-2": ([[1, 1, 1], [1, 2, 2]], (13, 30, 30), [2, 2, 1]),
}


@pytest.fixture(scope="module", params=sorted(STRIDES))
def anisotropic(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    strides, patch, alignment = STRIDES[request.param]
    folder = write_nnunet_folder(tmp_path_factory.mktemp("nnunet"), plans=_nnunet_plans(strides, patch))
    model = _import(folder, tmp_path_factory.mktemp("models"), f"aniso-{request.param}")
    return folder, model, patch, alignment


def test_anisotropic_strides_give_per_axis_alignment_and_the_patch_as_tile(
    anisotropic: tuple[Any, ...],
) -> None:
    _, model, patch, alignment = anisotropic
    assert list(model.spec.alignment_per_axis) == alignment  # (x, y, z): the strides' product, reversed
    assert model.spec.defaults.tile == tuple(reversed(patch))
    plan = model.plan(tuple(reversed(patch)))  # the model's own default tile, on an image of its size
    assert plan.grid.used_tile_shape == tuple(reversed(patch)) and plan.grid.n_tiles == 1


@pytest.mark.parametrize("where", ["below", "on", pytest.param("above", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "mirroring", [pytest.param(False, id="mirror-off"), pytest.param(True, id="mirror-on")]
)
def test_anisotropic_nnunet_equals_nnunet_predictor(
    anisotropic: tuple[Any, ...], where: str, mirroring: bool
) -> None:
    folder, model, patch, _ = anisotropic
    if where == "above" and mirroring and patch[0] > 16:
        pytest.skip("8 flips of 8 windows of 2 folds: covered by the smaller network")
    shape = {"below": tuple(p - 4 - 3 * i for i, p in enumerate(patch)), "on": patch,
             "above": tuple(p + 7 + 11 * i for i, p in enumerate(patch))}[where]  # fmt: skip
    x = _ct(shape, sum(shape))
    tta = "mirror" if mirroring else "none"
    got = _from_tilewise(model.run(_to_tilewise(x), parse_params({"output": "probabilities", "tta": tta})))
    _, expected = _float32_predictor(folder, mirroring=mirroring).predict_single_npy_array(
        x, {"spacing": [2.0, 1.0, 1.0]}, None, None, True
    )
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4

"""A MONAI bundle imported and served equals MONAI's own bundle pipeline.

The bundle is built here with MONAI's network class and bundle layout (random weights, Orientationd +
Spacingd + ScaleIntensityRanged, softmax + argmax). The test volumes are at the bundle's spacing and
orientation (1 mm, RAS), so Spacingd and Orientationd are no-ops on both sides: tilewise's pipeline
does not yet apply the spec's ``spacing`` / ``orientation`` (the geometry module is not wired in).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from _import_kit import need, write_monai_bundle
from fastapi.testclient import TestClient

from models import ModelRepository
from service.app import create_app
from service.cli import main

# MONAI's LoadImaged warns that NVIDIA's image codec is absent; Orientationd about a future default
pytestmark = [
    pytest.mark.filterwarnings("ignore:NvImgCodecPydicomReader:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Orientationd.__init__.labels.:FutureWarning"),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("monai")
    root = tmp_path_factory.mktemp("bundles") / "tissue_unet"
    write_monai_bundle(root, code=True)  # model-zoo style: $ expressions, imported with --trust
    return root


@pytest.fixture(scope="module")
def models_dir(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    assert main(["import-model", str(bundle), "--models", str(folder), "--trust"]) == 0
    return folder


def _monai_pipeline(bundle: Path, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """MONAI's own run of the bundle: its preprocessing, network, weights, inferer, softmax, argmax."""
    from monai.bundle import ConfigParser
    from monai.transforms import Activations, AsDiscrete

    parser = ConfigParser()
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle)
    network = parser.get_parsed_content("network")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    data = parser.get_parsed_content("preprocessing")({"image": str(path)})
    with torch.no_grad():
        logits = parser.get_parsed_content("inferer")(data["image"][None], network.eval())[0]
    probabilities = Activations(softmax=True)(logits)
    labels = AsDiscrete(argmax=True)(probabilities)[0]
    return np.asarray(probabilities), np.asarray(labels).astype(np.uint8)


def test_import_writes_the_mapped_spec(models_dir: Path) -> None:
    spec = yaml.safe_load((models_dir / "tissue-unet.yaml").read_text())
    assert (models_dir / "tissue-unet.pt").is_file() and spec["backend"] == "torchscript"
    assert spec["spacing"] == [1.0, 1.0, 1.0] and spec["orientation"] == "RAS"
    assert spec["preprocess"] == [
        {"type": "scale_range", "a_min": 0.0, "a_max": 100.0, "b_min": 0.0, "b_max": 1.0, "clip": True}
    ]
    assert spec["output"] == {"activation": "softmax", "kind": "labels"}
    assert spec["labels"] == {0: "background", 1: "grey matter", 2: "white matter"}
    assert spec["alignment"] == 4 and spec["tile_dependent"] is False  # 2 stride-2 levels, batch norm
    assert spec["defaults"] == {"tile": [48, 48, 48], "batch_size": 2, "halo": "auto", "overlap": 0,
                                "blend": "constant"}  # fmt: skip


def test_served_output_equals_monai_bundle_pipeline_below_roi(
    bundle: Path, models_dir: Path, tmp_path: Path, make_settings: Any, rng: np.random.Generator
) -> None:
    # a smooth 0..120 volume, smaller than roi_size 48 on every axis: MONAI pads it to 48, centred
    coarse = rng.uniform(0, 120, (6, 5, 6)).astype(np.float32)
    volume = np.kron(coarse, np.ones((6, 6, 6), np.float32))[:36, :28, :32]
    path = tmp_path / "small.nii.gz"
    nib.save(nib.Nifti1Image(volume, np.diag([1.0, 1.0, 1.0, 1.0])), path)
    expected_p, expected_l = _monai_pipeline(bundle, path)
    settings = make_settings(models_dir=models_dir, tmp_dir=tmp_path, device="cpu")
    with TestClient(create_app(settings)) as client:
        listing = {m["name"]: m for m in client.get("/v1/models").json()}
        assert listing["tissue-unet"]["labels"] == {
            "0": "background",
            "1": "grey matter",
            "2": "white matter",
        }
        body = path.read_bytes()
        got_p = client.post("/v1/models/tissue-unet/infer?output=probabilities&format=npy", content=body)
        got_l = client.post("/v1/models/tissue-unet/infer?format=npy", content=body)
    assert got_p.status_code == 200 and got_l.status_code == 200, got_p.text
    probabilities = np.load(io.BytesIO(got_p.content))
    labels = np.load(io.BytesIO(got_l.content))
    assert probabilities.shape == expected_p.shape == (3, 36, 28, 32)
    assert np.abs(probabilities - expected_p).max() <= 1e-4
    np.testing.assert_array_equal(labels, expected_l)


def _mni(step: int) -> np.ndarray:
    """nilearn's MNI152 T1 (uint8, RAS, 1 mm), every ``step``-th voxel, cropped to multiples of 4."""
    import nilearn

    path = (
        Path(nilearn.__file__).parent
        / "datasets"
        / "data"
        / "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
    )
    data = np.asarray(nib.load(path).dataobj, dtype=np.float32)[::step, ::step, ::step]
    return data[tuple(slice(0, s // 4 * 4) for s in data.shape)]


@pytest.mark.parametrize(
    "step",
    [pytest.param(3, id="mni152-every-3rd-voxel"), pytest.param(1, id="mni152", marks=pytest.mark.slow)],
)
def test_mni152_labels_agree_with_whole_volume_at_least_as_well_as_monai(
    bundle: Path, models_dir: Path, step: int
) -> None:
    from monai.inferers import sliding_window_inference

    network = write_monai_bundle(bundle.parent / "again")  # the same seed: the same network
    volume = _mni(step)
    x = np.clip(volume / 100.0, 0.0, 1.0).astype(np.float32)  # ScaleIntensityRanged(0, 100, 0, 1, clip)
    with torch.no_grad():
        whole = network(torch.from_numpy(x)[None, None])[0].argmax(0).numpy()
        window = (
            sliding_window_inference(
                torch.from_numpy(x)[None, None], (48, 48, 48), 2, network, overlap=0.25, mode="gaussian"
            )[0]
            .argmax(0)
            .numpy()
        )
    model = ModelRepository(models_dir, device="cpu").get("tissue-unet")
    labels = model.run(volume[None])
    monai_agreement = float(np.mean(window == whole))
    tilewise_agreement = float(np.mean(labels == whole))
    assert tilewise_agreement >= monai_agreement, (tilewise_agreement, monai_agreement)

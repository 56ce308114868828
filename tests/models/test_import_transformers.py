"""MONAI's transformers (UNETR, SwinUNETR) in bundles: imported with their one window, served blended.

Issue 25 item 6. UNETR's position embeddings fix its input to ``img_size``; SwinUNETR's traced graph
keeps the window partition of the size it was traced at. The probe finds the self-attention and
gives the spec ``fixed_tile: true`` with tile = alignment = the window, tile-dependent; the served
probabilities on a volume larger than the window (odd sizes, several windows per axis) are compared
with MONAI's own ``sliding_window_inference`` (same roi, overlap 0.25) on the bundle's own
preprocessing. ``mode=constant``: MONAI's gaussian floors its N-D weights at 1e-3, which no
separable window reproduces (see :mod:`models.importers.bundle`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from _import_kit import need
from fastapi.testclient import TestClient

from service.app import create_app
from service.cli import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:NvImgCodecPydicomReader:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Orientationd.__init__.labels.:FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WINDOW = (32, 32, 32)


def _bundle(root: Path, network: str) -> None:
    from models.importers.example_bundle import write_example_bundle

    need("monai")
    write_example_bundle(root, network=network, roi=WINDOW)
    path = root / "configs" / "inference.json"
    config = json.loads(path.read_text())
    config["inferer"]["mode"] = "constant"
    path.write_text(json.dumps(config))


def _monai_sliding_window(bundle: Path, path: Path) -> np.ndarray:
    """The bundle's preprocessing and network, then MONAI's ``sliding_window_inference`` + softmax."""
    from monai.bundle import ConfigParser
    from monai.inferers import sliding_window_inference

    parser = ConfigParser()
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.read_config(str(bundle / "configs" / "inference.json"))
    network = parser.get_parsed_content("network_def")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    image = parser.get_parsed_content("preprocessing")({"image": str(path)})["image"]
    with torch.no_grad():
        logits = sliding_window_inference(
            image[None], WINDOW, 2, network.eval(), overlap=0.25, mode="constant"
        )
    return np.asarray(torch.softmax(torch.as_tensor(logits[0]), 0))


@pytest.mark.parametrize(
    "network",
    ["UNETR", pytest.param("SwinUNETR", marks=pytest.mark.slow)],  # Swin: ~25 s of CPU
)
def test_transformer_bundle_imports_with_its_window_and_serves_monai_windows(
    network: str, tmp_path: Path, make_settings: Any, rng: np.random.Generator
) -> None:
    bundle, models = tmp_path / "bundle", tmp_path / "models"
    _bundle(bundle, network)
    assert main(["import-model", str(bundle), "--name", "vit", "--models", str(models)]) == 0
    spec = yaml.safe_load((models / "vit.yaml").read_text())
    assert spec["fixed_tile"] is True and spec["tile_dependent"] is True
    assert spec["alignment"] == 32 and spec["defaults"]["tile"] == list(WINDOW)
    coarse = rng.uniform(0, 120, (12, 11, 10)).astype(np.float32)
    volume = np.kron(coarse, np.ones((4, 4, 4), np.float32))[:45, :40, :37]  # above the window
    path = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(volume, np.eye(4)), path)
    expected = _monai_sliding_window(bundle, path)
    settings = make_settings(models_dir=models, tmp_dir=tmp_path, device="cpu")
    with TestClient(create_app(settings)) as client:
        got = client.post("/v1/models/vit/infer?output=probabilities&format=npy", content=path.read_bytes())
        assert got.status_code == 200, got.text
        probabilities = np.load(io.BytesIO(got.content))
        assert probabilities.shape == expected.shape == (3, *volume.shape)
        assert np.abs(probabilities - expected).max() <= 1e-4
        plan = got.headers["x-tilewise-plan"]
        assert "tile=32,32,32" in plan and "tiles=8" in plan, plan  # two windows 24 apart per axis
        assert "x-tilewise-seam" in got.headers  # the disagreement of overlapping windows
        wrong = client.post("/v1/models/vit/infer?tile=64&format=npy", content=path.read_bytes())
        assert wrong.status_code == 400 and "takes exactly tile=32,32,32" in wrong.text, wrong.text


def test_unetr_with_img_size_not_the_window_is_refused_in_one_line(tmp_path: Path, capsys: Any) -> None:
    from models.importers.example_bundle import write_example_bundle

    need("monai")
    write_example_bundle(tmp_path / "b", network="UNETR", roi=(48, 48, 48))  # img_size 48
    path = tmp_path / "b" / "configs" / "inference.json"
    config = json.loads(path.read_text())
    config["inferer"]["roi_size"] = list(WINDOW)  # MONAI's own windows of 32 would fail too
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import-model", str(tmp_path / "b"), "--models", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "takes one input size" in err and "(32, 32, 32)" in err, err

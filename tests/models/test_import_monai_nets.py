"""MONAI's networks (``monai.networks.nets``) in bundles: imported by ``tilewise import-model``, served.

Each bundle is written by ``tilewise import-model --example-bundle`` (small feature sizes, random
weights) and imported through the real CLI; the served probabilities are compared with MONAI's own
run of the same bundle (its ``preprocessing``, ``network_def`` with ``models/model.pt``,
``SlidingWindowInferer`` and a softmax), on a volume of exactly one window (MONAI's inferer is then
one whole-volume pass of the network) and on one thinner than the window on one axis (MONAI pads it,
centred, to the window). Volumes are at the bundle's spacing and orientation (1 mm, RAS).

Issue 25 item 6: BasicUNet pads its skip connections to make any size run eagerly, so the probe
measured ``alignment 1`` and the traced graph failed at other sizes; the total stride (16 for four
poolings) is now read from the network's feature maps.
"""

from __future__ import annotations

import io
import warnings
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

#: network, norm, roi, expected alignment (the total stride, worked out by hand from the class)
NETWORKS = {
    "basicunet-batch": ("BasicUNet", "batch", (32, 32, 32), 16),  # four 2x max-pools
    "basicunet-instance": ("BasicUNet", "instance", (32, 32, 32), 16),
    "unet": ("UNet", "batch", (48, 48, 48), 4),  # strides [2, 2]
    "segresnet": ("SegResNet", "batch", (32, 32, 32), 4),  # blocks_down [1, 1, 1]: two stride-2 convs
}
SLOW: set[str] = set()


def _monai_probabilities(bundle: Path, path: Path) -> np.ndarray:
    """MONAI's own run of the bundle on ``path``: preprocessing, network + weights, inferer, softmax."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_meta(str(bundle / "configs" / "metadata.json"))
    parser.read_config(str(bundle / "configs" / "inference.json"))
    network = parser.get_parsed_content("network_def")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    data = parser.get_parsed_content("preprocessing")({"image": str(path)})
    with torch.no_grad():
        logits = parser.get_parsed_content("inferer")(data["image"][None], network.eval())[0]
    return np.asarray(torch.softmax(torch.as_tensor(logits), 0))


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in NETWORKS]
)
def test_monai_network_bundle_imports_and_serves_monai_output(
    case: str, tmp_path: Path, make_settings: Any, rng: np.random.Generator, capsys: Any
) -> None:
    need("monai")
    network, norm, roi, alignment = NETWORKS[case]
    bundle, models = tmp_path / "bundle", tmp_path / "models"
    assert main(["import-model", "--example-bundle", str(bundle), "--example-network", network]) == 0
    if norm != "batch":  # the CLI writes batch norm; the window (roi) is the CLI's for each network
        from models.importers.example_bundle import write_example_bundle

        write_example_bundle(bundle, network=network, roi=roi, norm=norm)
    # the example bundle holds no code: it imports without --trust
    assert main(["import-model", str(bundle), "--name", case, "--models", str(models)]) == 0
    spec = yaml.safe_load((models / f"{case}.yaml").read_text())
    assert spec["alignment"] == alignment, spec
    assert spec["output"]["activation"] == "softmax"
    coarse = rng.uniform(0, 120, (8, 8, 8)).astype(np.float32)
    smooth = np.kron(coarse, np.ones((roi[0] // 4,) * 3, np.float32))
    volumes = {
        "one-window": smooth[: roi[0], : roi[1], : roi[2]],
        "thin": smooth[: roi[0], : roi[1] // 2, : roi[2]],  # MONAI pads axis 1, centred
    }
    settings = make_settings(models_dir=models, tmp_dir=tmp_path, device="cpu")
    with TestClient(create_app(settings)) as client:
        card = client.get(f"/v1/models/{case}").json()
        assert card["alignment"] == alignment and card["output"]["activation"] == "softmax"
        for label, volume in volumes.items():
            path = tmp_path / f"{label}.nii.gz"
            nib.save(nib.Nifti1Image(volume, np.eye(4)), path)
            expected = _monai_probabilities(bundle, path)
            got = client.post(
                f"/v1/models/{case}/infer?output=probabilities&format=npy", content=path.read_bytes()
            )
            assert got.status_code == 200, got.text
            probabilities = np.load(io.BytesIO(got.content))
            assert probabilities.shape == expected.shape == (3, *volume.shape), label
            assert np.abs(probabilities - expected).max() <= 1e-4, (
                label,
                np.abs(probabilities - expected).max(),
            )


def test_basicunet_onnx_export_atol_and_one_line_refusal(tmp_path: Path, capsys: Any) -> None:
    """``--format onnx`` of BasicUNet: parity within ``--atol``; a parity refusal is one line."""
    need("monai")
    bundle = tmp_path / "bundle"
    assert main(["import-model", "--example-bundle", str(bundle), "--example-network", "BasicUNet"]) == 0
    capsys.readouterr()
    argv = ["import-model", str(bundle), "--models", str(tmp_path / "m"), "--format", "onnx"]
    assert main([*argv, "--atol", "0"]) == 2  # no export is bit-exact: refused, naming the figure
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs from eager by" in err and "--atol" in err, err
    assert main([*argv, "--atol", "1e-3"]) == 0
    spec = yaml.safe_load((tmp_path / "m" / "example-basicunet.yaml").read_text())
    assert spec["backend"] == "onnx" and spec["alignment"] == 16


def test_refusal_is_one_line_and_verbose_gives_the_traceback(tmp_path: Path, capsys: Any) -> None:
    """A network that runs at no probed size: one line naming the cause; the traceback under --verbose."""
    need("monai")
    import json

    bundle = tmp_path / "bundle"
    assert main(["import-model", "--example-bundle", str(bundle), "--example-network", "UNETR"]) == 0
    # UNETR takes only its img_size: a window of another size cannot run
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    config["network_def"]["img_size"] = [48, 48, 48]
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    capsys.readouterr()
    argv = ["import-model", str(bundle), "--models", str(tmp_path / "m")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 600 and "Traceback" not in err, err
    assert main([*argv, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[0].startswith("tilewise import-model: cannot import")


def test_torchscript_runtime_error_summarized_in_one_line() -> None:
    """The cause of a traced graph's failure off its grid, without the serialized code around it."""
    need("monai")
    from monai.networks.nets import BasicUNet

    from models.importers.convert import error_summary

    net = BasicUNet(spatial_dims=3, features=(4, 4, 8, 8, 16, 4)).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings
        traced = torch.jit.trace(net, torch.zeros(1, 1, 32, 32, 32))
        with pytest.raises(RuntimeError) as caught:
            traced(torch.zeros(1, 1, 33, 33, 33))  # the traced pads are the 32^3 ones
    assert len(str(caught.value)) > 1000 and "\n" in str(caught.value)
    line = error_summary(caught.value)
    assert "\n" not in line and len(line) <= 300 and "Error" in line and "size" in line.lower(), line

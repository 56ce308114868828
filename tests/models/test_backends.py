"""Backends: one small 3D U-Net run eager, as TorchScript and as exported ONNX gives one tiled output.

The ONNX file is produced by ``tilewise export-onnx`` itself (dynamic batch and spatial axes), so
the CLI, the exporter and the ONNX Runtime backend are exercised together.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from models import InferenceParams, ModelRepository
from models.backends.ort import choose_providers
from models.errors import BackendUnavailableError
from models.export import export_onnx, export_torchscript
from models.zoo.nets import UNet

logger = logging.getLogger(__name__)

UNET_PARAMS: dict[str, Any] = {"features": 4, "levels": 2, "norm": "batch"}


def _unet() -> UNet:
    torch.manual_seed(0)
    net = UNet(3, 1, 2, **UNET_PARAMS)
    for m in net.modules():  # non-trivial running statistics, so eval-mode BN matters
        if isinstance(m, nn.BatchNorm3d) and m.running_mean is not None and m.running_var is not None:
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def _spec(name: str, backend: str, file: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "backend": backend,
        "file": file,
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "alignment": 4,
        "output": {"activation": "softmax", "kind": "probabilities"},
        "defaults": {"tile": 32, "halo": 6, "batch_size": 2},
        **extra,
    }


@pytest.fixture(scope="module")
def unet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with the U-Net as eager (DataParallel-prefixed state dict), TorchScript and ONNX."""
    from service.cli import main

    folder = tmp_path_factory.mktemp("unet")
    net = _unet()
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, folder / "unet.pt")
    spec = _spec("unet-eager", "eager", "unet.pt", architecture="unet", params=UNET_PARAMS)
    (folder / "unet-eager.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    export_torchscript(net, folder / "unet.ts", in_channels=1, export_shape=(16, 16, 16), alignment=4)
    (folder / "unet-ts.yaml").write_text(
        yaml.safe_dump(_spec("unet-ts", "torchscript", "unet.ts")), encoding="utf-8"
    )
    status = main(
        [
            "export-onnx",
            "unet-eager",
            str(folder / "unet.onnx"),
            "--models",
            str(folder),
            "--tile",
            "16",
            "--spec",
        ]
    )
    assert status == 0
    return folder


def test_export_wrote_onnx_spec(unet_dir: Path) -> None:
    repo = ModelRepository(unet_dir, device="cpu")
    assert {"unet-eager", "unet-ts", "unet-eager-onnx"} <= set(repo.names())
    spec = repo.spec("unet-eager-onnx")
    assert spec.backend == "onnx" and spec.sha256 and spec.activation == "softmax"


def test_backends_give_the_same_tiled_output(unet_dir: Path, rng: np.random.Generator) -> None:
    """Acceptance: eager, TorchScript and ONNX tiled outputs agree within 1e-4 (float32 rounding)."""
    repo = ModelRepository(unet_dir, device="cpu")
    x = rng.standard_normal((1, 28, 36, 20)).astype(np.float32)
    options = InferenceParams(tile=(16, 24, 12), halo=2, overlap=4, blend="gaussian")
    outputs = {name: repo.get(name).run(x, options) for name in ("unet-eager", "unet-ts", "unet-eager-onnx")}
    eager = outputs["unet-eager"]
    assert eager.shape == (2, 28, 36, 20)
    np.testing.assert_allclose(eager.sum(0), 1.0, atol=1e-5)  # softmax over channels
    for name in ("unet-ts", "unet-eager-onnx"):
        err = float(np.abs(outputs[name] - eager).max())
        logger.info("tiled U-Net %s vs eager: max abs diff %.3g", name, err)
        assert err <= 1e-4
    labels = repo.get("unet-eager-onnx").run(x, InferenceParams(tile=(16, 24, 12), halo=2, output="labels"))
    assert labels.shape == x.shape[1:] and labels.dtype == np.uint8


def test_export_norm_layers_with_dynamic_axes(tmp_path: Path) -> None:
    """Conv3d, ConvTranspose3d, batch/instance/group norms export with dynamic batch and spatial axes."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1),
        nn.BatchNorm3d(4),
        nn.ReLU(),
        nn.Conv3d(4, 8, 3, stride=2, padding=1),
        nn.InstanceNorm3d(8, affine=True),
        nn.ConvTranspose3d(8, 4, 2, stride=2),
        nn.GroupNorm(2, 4),
        nn.Conv3d(4, 2, 1),
    ).eval()
    report = export_onnx(net, tmp_path / "n.onnx", in_channels=1, export_shape=(16, 16, 16), alignment=2)
    assert report.parity_shape == (18, 18, 18) and report.max_abs_diff <= 1e-4
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "n.onnx"), providers=["CPUExecutionProvider"])
    for shape in [(1, 1, 8, 12, 20), (3, 1, 24, 8, 16)]:
        x = torch.randn(shape)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        with torch.inference_mode():
            assert np.abs(got - net(x).numpy()).max() <= 1e-4
    logger.info("norm-layer export: max abs diff %.3g", report.max_abs_diff)


def test_safetensors_weights(unet_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    net = _unet()
    save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    spec = _spec("unet-st", "eager", "w.safetensors", architecture="unet", params=UNET_PARAMS)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    batch = torch.randn(1, 1, 16, 16, 16)
    got = ModelRepository(tmp_path, device="cpu").get("unet-st").predictor(batch)
    with torch.inference_mode():
        assert torch.equal(got, net(batch))


def test_provider_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    assert choose_providers(torch.device("cpu")) == ["CPUExecutionProvider"]
    everything = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider", *everything[:2]])
    assert choose_providers(torch.device("cuda")) == everything
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert choose_providers(torch.device("cuda")) == ["CPUExecutionProvider"]
    with pytest.raises(BackendUnavailableError, match="CUDAExecutionProvider"):
        choose_providers(torch.device("cpu"), ["CUDAExecutionProvider"])


def test_onnx_session_reports_providers(unet_dir: Path) -> None:
    model = ModelRepository(unet_dir, device="cpu").get("unet-eager-onnx")
    assert model.predictor.describe()["providers"] == ["CPUExecutionProvider"]


@pytest.mark.gpu
def test_cuda_backends_match_cpu(unet_dir: Path, rng: np.random.Generator) -> None:  # pragma: no cover
    x = rng.standard_normal((1, 32, 32, 32)).astype(np.float32)
    cpu = ModelRepository(unet_dir, device="cpu")
    gpu = ModelRepository(unet_dir, device="cuda")
    for name in ("unet-eager", "unet-eager-onnx"):
        err = np.abs(gpu.get(name).run(x) - cpu.get(name).run(x)).max()
        assert err <= 1e-3  # TF32/cuDNN algorithms differ from CPU in the last bits

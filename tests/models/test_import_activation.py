"""``import-model --activation`` for TorchScript / ONNX files: probed from outputs, or given (issue 25.8).

Oracle: ``torch.softmax`` / ``torch.sigmoid`` of the network's own output.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from models import ModelRepository, parse_params
from service.cli import main


def _net(out_channels: int, head: torch.nn.Module | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(4, out_channels, 1)]
    with torch.no_grad():
        layers[2].weight.mul_(20.0)  # logits well outside [0, 1]
    return torch.nn.Sequential(*layers, *([head] if head is not None else [])).eval()


def _import(tmp_path: Path, net: torch.nn.Module, name: str, *extra: str) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(net, torch.zeros(1, 1, 16, 16, 16)).save(str(tmp_path / f"{name}.pt"))
    assert main(["import-model", str(tmp_path / f"{name}.pt"), "--models", str(tmp_path / "m"), *extra]) == 0
    return yaml.safe_load((tmp_path / "m" / f"{name}.yaml").read_text())


def test_logits_get_softmax_and_the_served_output_is_probabilities(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    net = _net(3)
    spec = _import(tmp_path, net, "logits")
    assert spec["output"]["activation"] == "softmax" and "probabilities" in spec["description"]
    # the comment says how to keep the logits ("--activation says otherwise" left a reader asking what)
    assert (
        "raw logits; softmax chosen (--activation none keeps the raw outputs)"
        in (tmp_path / "m" / "logits.yaml").read_text()
    )
    x = rng.standard_normal((1, 19, 23, 17)).astype(np.float32)
    got = ModelRepository(tmp_path / "m", device="cpu").get("logits").run(x, parse_params({}))
    with torch.inference_mode():
        expected = torch.softmax(net(torch.from_numpy(x)[None]), 1)[0].numpy()
    assert np.abs(got - expected).max() <= 1e-5


def test_one_channel_logits_get_sigmoid(tmp_path: Path) -> None:
    assert _import(tmp_path, _net(1), "single")["output"]["activation"] == "sigmoid"


def test_softmax_inside_the_network_is_recognised(tmp_path: Path, capsys: Any) -> None:
    spec = _import(tmp_path, _net(3, torch.nn.Softmax(dim=1)), "inside")
    assert spec["output"]["activation"] == "none"
    assert "softmax already applied" in (tmp_path / "m" / "inside.yaml").read_text()
    capsys.readouterr()
    argv = [
        "import-model",
        str(tmp_path / "inside.pt"),
        "--models",
        str(tmp_path / "m2"),
        "--activation",
        "softmax",
    ]
    assert main(argv) == 2 and "squash probabilities twice" in capsys.readouterr().err


def test_activation_none_on_logits_is_not_called_probabilities(tmp_path: Path) -> None:
    spec = _import(tmp_path, _net(3), "raw", "--activation", "none")
    assert spec["output"]["activation"] == "none"
    assert "raw values (logits), not probabilities" in spec["description"]


@pytest.mark.parametrize("bad", ["relu", "Softmax"])
def test_unknown_activation_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["import-model", str(tmp_path / "x.pt"), "--activation", bad])
    assert caught.value.code == 2

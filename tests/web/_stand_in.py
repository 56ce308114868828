"""A three-label volume model for the page's tests while ``tissue-3d`` is not in main yet.

``tissue-stand-in-3d`` mimics ``tissue-3d``'s interface (one channel in; labels ``0 background,
1 grey matter, 2 white matter``): a 3x3x3 mean of the unit-range intensity ``m``, then three linear
logits, so label 1 wins above ``m = 0.3`` and label 2 above ``m = 0.7`` (roughly grey and white
matter on the MNI152 T1). Saved as TorchScript, so the server needs no import path for it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import yaml
from torch import nn

NAME = "tissue-stand-in-3d"
LABELS = {0: "background", 1: "grey matter", 2: "white matter"}


class _MeanThenLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Conv3d(1, 1, 3, padding=1, bias=False)
        self.head = nn.Conv3d(1, 3, 1)
        with torch.no_grad():
            self.mean.weight.fill_(1.0 / 27.0)
            self.head.weight.copy_(torch.tensor([0.0, 10.0, 20.0]).reshape(3, 1, 1, 1, 1))
            self.head.bias.copy_(torch.tensor([0.0, -3.0, -10.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mean(x))


def write_model(folder: Path) -> Path:
    """The TorchScript file and spec of ``tissue-stand-in-3d`` in ``folder``; the spec's path."""
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.*", category=DeprecationWarning)
        traced = torch.jit.trace(_MeanThenLogits().eval(), torch.zeros(1, 1, 8, 8, 8))
        traced.save(str(folder / f"{NAME}.pt"))
    spec = {
        "name": NAME,
        "description": "Stand-in for tissue-3d: intensity thresholds after a 3x3x3 mean.",
        "backend": "torchscript",
        "file": f"{NAME}.pt",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 3,
        "receptive_field": 1,
        "tile_dependent": False,
        "labels": LABELS,
        "preprocess": ["unit_range"],
        "output": {"activation": "softmax", "kind": "labels"},
        "defaults": {"tile": 48, "halo": 1, "batch_size": 2},
    }
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path

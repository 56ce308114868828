"""A local, orientation-sensitive 3-class "tissue" network for the geometry tests (eager backend).

``SmoothClassifier``: an asymmetric 5x5x5 smoothing (positive weights summing to 1, different along
every axis and direction, so a flipped or transposed input gives a different output), then three
linear logits of the smoothed intensity ``m`` (unit range): class 1 wins above ``m = 0.2``, class 2
above ``m = 0.7``. Receptive-field radius 2, no normalization: tiles with halo >= 2 are exact.

:func:`write_model` writes its weights (safetensors) and a spec with ``spacing``, ``orientation``,
``labels`` and ``mirror_axes`` into a model folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

NAME = "smooth-tissue-3d"
LABELS = {0: "background", 1: "grey", 2: "bright"}


class SmoothClassifier(nn.Module):
    def __init__(self, spatial_dims: int, in_channels: int, out_channels: int) -> None:
        super().__init__()
        assert (spatial_dims, in_channels, out_channels) == (3, 1, 3)
        self.smooth = nn.Conv3d(1, 1, 5, padding=2, bias=False)
        self.head = nn.Conv3d(1, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.smooth(x))


def weights() -> dict[str, torch.Tensor]:
    """Deterministic weights: the smoothing kernel grows along each axis at a different rate."""
    i, j, k = torch.meshgrid(torch.arange(5.0), torch.arange(5.0), torch.arange(5.0), indexing="ij")
    kernel = (1.0 + i) * (1.0 + 0.5 * j) * (3.0 + k) ** 2
    return {
        "smooth.weight": (kernel / kernel.sum()).reshape(1, 1, 5, 5, 5),
        "head.weight": torch.tensor([0.0, 10.0, 20.0]).reshape(3, 1, 1, 1, 1),
        "head.bias": torch.tensor([0.0, -2.0, -9.0]),
    }


def write_model(folder: Path, **fields: Any) -> Path:
    """Weights and spec of ``smooth-tissue-3d`` in ``folder``; ``fields`` override the spec's."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights(), str(folder / f"{NAME}.safetensors"))
    spec = {
        "name": NAME,
        "backend": "eager",
        "architecture": "_medical_nets:SmoothClassifier",
        "file": f"{NAME}.safetensors",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 3,
        "receptive_field": 2,
        "tile_dependent": False,
        "spacing": [1.0, 1.0, 1.0],
        "orientation": "RAS",
        "labels": LABELS,
        "preprocess": ["unit_range"],
        "output": {"activation": "softmax", "kind": "labels"},
        "defaults": {"tile": 64, "halo": 2, "batch_size": 2},
        **fields,
    }
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path

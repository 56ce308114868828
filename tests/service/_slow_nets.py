"""A 1x1x1 convolution that sleeps on tiles larger than its warm-up saw, for the time-limit tests.

``SlowOnLarge`` sleeps ``delay_s`` per forward pass whose spatial extent passes ``above`` voxels on
some axis: its footprint, measured on the spec's default tile (32) and half of it, predicts a fast
network, so a request with larger tiles runs far slower than its plan's ``eta_s`` (as on a machine
that became loaded after warm-up). Output: the input times a seeded weight plus a bias (exact).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

NAME = "slow-3d"


class SlowOnLarge(nn.Module):
    def __init__(
        self, spatial_dims: int, in_channels: int, out_channels: int, delay_s: float = 0.0, above: int = 32
    ) -> None:
        super().__init__()
        assert spatial_dims == 3
        self.conv = nn.Conv3d(in_channels, out_channels, 1)
        self.delay_s = float(delay_s)
        self.above = int(above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s and max(x.shape[2:]) > self.above:
            time.sleep(self.delay_s)
        out: torch.Tensor = self.conv(x)
        return out


def write_model(folder: Path, delay_s: float, **fields: Any) -> Path:
    """Weights and spec of ``slow-3d`` in ``folder`` (default tile 32, halo 0, batch 1)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = SlowOnLarge(3, 1, 1)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(folder / f"{NAME}.safetensors"))
    spec = {
        "name": NAME,
        "backend": "eager",
        "architecture": "_slow_nets:SlowOnLarge",
        "file": f"{NAME}.safetensors",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 1,
        "receptive_field": 0,
        "tile_dependent": False,
        "preprocess": [],
        "params": {"delay_s": delay_s, "above": 32},
        "output": {"activation": "none", "kind": "probabilities"},
        "defaults": {"tile": 32, "halo": 0, "batch_size": 1},
        **fields,
    }
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path

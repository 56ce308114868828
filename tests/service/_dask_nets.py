"""A random local conv stack as a tilewise model folder, for the ``--dask`` and cluster-job tests.

``ConvStack``: 3-D convolutions (3x3x3, dilations 1, 2, 1, ReLU between), seeded random weights,
receptive-field radius ``sum(dilations) = 4``, no normalization: tiles with halo >= 4 equal the
whole-volume pass. Its spec asks for 1 mm spacing, RAS orientation, unit-range preprocessing,
softmax and labels, so a run goes through the pipeline's geometry both ways.

Dask workers import ``_dask_nets:ConvStack`` by name: ``LocalCluster`` workers get the test
process's ``sys.path``; separately started ``dask worker`` processes need ``tests/service`` on
``PYTHONPATH``. ``params: {delay_s: ...}`` makes every forward pass sleep (to kill a worker mid-run)
without changing the output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
import yaml
from torch import nn

NAME = "conv-stack-3d"
DILATIONS = (1, 2, 1)


class ConvStack(nn.Module):
    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        dilations: Sequence[int] = DILATIONS,
        width: int = 4,
        delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        assert spatial_dims == 3
        layers: list[nn.Module] = []
        c = in_channels
        for i, d in enumerate(dilations):
            last = i == len(dilations) - 1
            layers.append(nn.Conv3d(c, out_channels if last else width, 3, padding=d, dilation=d))
            if not last:
                layers.append(nn.ReLU())
            c = width
        self.net = nn.Sequential(*layers)
        self.delay_s = float(delay_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        out: torch.Tensor = self.net(x)
        return out


def write_model(folder: Path, seed: int = 0, **fields: Any) -> Path:
    """Weights (seeded) and spec of ``conv-stack-3d`` in ``folder``; ``fields`` override the spec's."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    net = ConvStack(3, 1, 3)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(folder / f"{NAME}.safetensors"))
    spec = {
        "name": NAME,
        "backend": "eager",
        "architecture": "_dask_nets:ConvStack",
        "file": f"{NAME}.safetensors",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 3,
        "receptive_field": sum(DILATIONS),
        "tile_dependent": False,
        "spacing": [1.0, 1.0, 1.0],
        "orientation": "RAS",
        "labels": {0: "a", 1: "b", 2: "c"},
        "preprocess": ["unit_range"],
        "output": {"activation": "softmax", "kind": "labels"},
        "defaults": {"tile": 32, "halo": 4, "batch_size": 2},
        **fields,
    }
    path = folder / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def random_volume(path: Path, shape: tuple[int, int, int] = (40, 36, 30), seed: int = 0) -> Path:
    """A smooth random float32 NIfTI, LPS-oriented with 1.5 x 1.5 x 2 mm voxels (so the model's
    RAS 1 mm grid means a flip and a resampling each way)."""
    rng = np.random.default_rng(seed)
    data = rng.random(shape, dtype=np.float32)
    for axis in range(3):  # smooth a little: neighbouring voxels correlate, as in an image
        data = (data + np.roll(data, 1, axis) + np.roll(data, -1, axis)) / 3
    affine = np.diag([-1.5, -1.5, 2.0, 1.0])
    affine[:3, 3] = (30.0, 27.0, -30.0)
    nib.save(nib.Nifti1Image(data.astype(np.float32), affine), path)
    return path

"""The benchmark networks (worker side), each wrapped to count the tiles and voxels it sees."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import TEXT_DET, UNET_ALIGNMENT, UNET_FEATURES


class Counted:
    """Wraps a predictor and counts the tiles (batch items) it sees."""

    def __init__(
        self, fn: Callable[[Any], Any], *, spatial_dims: int, in_channels: int, alignment: int
    ) -> None:
        self.fn = fn
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.alignment = alignment
        self.scale = 1
        self.receptive_field = None
        self.items = 0
        self.voxels = 0

    def __call__(self, batch: Any) -> Any:
        self.items += int(batch.shape[0])
        self.voxels += int(math.prod(batch.shape[2:])) * int(batch.shape[0])
        return self.fn(batch)


def build_unet(norm: str) -> Any:
    """MONAI's BasicUNet, 3D, features (8, 8, 16, 32, 64, 8), seed 0, eval mode."""
    import torch
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {} if norm == "instance" else {"norm": ("batch", {})}
    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=UNET_FEATURES, **kwargs)
    return net.eval()


class BoxNet:
    """Engine-bound 3D network for the scaling case: ``[mean3x3x3(x), x]`` (2 channels, radius 1)."""

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        return torch.cat([F.avg_pool3d(x, 3, stride=1, padding=1), x], dim=1)


class SleepyBoxNet(BoxNet):
    """``box-3d`` plus a fixed wait per tile that holds no CPU: a stand-in for an accelerator, whose
    network time leaves the host's cores free for the reading thread."""

    def __init__(self, seconds_per_tile: float) -> None:
        self.seconds_per_tile = seconds_per_tile

    def __call__(self, x: Any) -> Any:
        import time

        time.sleep(self.seconds_per_tile * int(x.shape[0]))
        return super().__call__(x)


def build_predictor(name: str, job: dict[str, Any]) -> tuple[Counted, dict[str, Any]]:
    """Predictor and metadata (``alignment``, ``out_channels``, ``spatial_dims``) by model name."""
    if name in ("unet-batch", "unet-instance"):
        net = build_unet(name.split("-")[1])
        return Counted(net, spatial_dims=3, in_channels=1, alignment=UNET_ALIGNMENT), {"out_channels": 2}
    if name == "log-3d":
        from models.zoo.analytic import AnalyticNet

        net = AnalyticNet("log", 3).eval()
        return Counted(net, spatial_dims=3, in_channels=1, alignment=1), {"out_channels": 1}
    if name == "box-3d":
        return Counted(BoxNet(), spatial_dims=3, in_channels=1, alignment=1), {"out_channels": 2}
    if name == "box-3d-sleep":
        net = SleepyBoxNet(float(job.get("seconds_per_tile", 0.1)))
        return Counted(net, spatial_dims=3, in_channels=1, alignment=1), {"out_channels": 2}
    if name == TEXT_DET:
        spec, predictor = load_text_det(Path(job["models_dir"]))
        return Counted(predictor, spatial_dims=2, in_channels=3, alignment=int(spec.alignment)), {
            "out_channels": int(spec.out_channels)
        }
    raise ValueError(f"unknown benchmark model {name!r}")


def load_text_det(models_dir: Path) -> tuple[Any, Any]:
    """The text detector's spec and its raw ONNX predictor (no global-pooling wrapper)."""
    from models.backends import load_predictor
    from models.repository import ModelRepository

    spec = ModelRepository(models_dir, device="cpu").spec(TEXT_DET)
    return spec, load_predictor(spec, "cpu")

"""The impulse probe and the calibrated halo on conv stacks of known radius."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from models import calibrate_halo, probe_receptive_field

logger = logging.getLogger(__name__)

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class Stack:
    """A conv stack as a Predictor (metadata plus __call__)."""

    def __init__(self, net: nn.Module, spatial_dims: int, alignment: int = 1) -> None:
        self.net = net.eval()
        for p in self.net.parameters():  # positive weights: no accidental cancellation
            p.data = p.data.abs() + 0.1
        self.spatial_dims, self.in_channels, self.out_channels = spatial_dims, 1, 1
        self.alignment, self.scale = alignment, 1

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = self.net(batch)
        return out


def plain(nd: int) -> Stack:  # radius 1 + 1 + 2 = 4
    c = CONV[nd]
    return Stack(
        nn.Sequential(
            c(1, 2, 3, padding=1), nn.Tanh(), c(2, 2, 3, padding=1), nn.Tanh(), c(2, 1, 5, padding=2)
        ),
        nd,
    )


def dilated(nd: int) -> Stack:  # radius 1 + 2 + 4 = 7
    c = CONV[nd]
    return Stack(
        nn.Sequential(
            c(1, 2, 3, padding=1),
            nn.Tanh(),
            c(2, 2, 3, padding=2, dilation=2),
            nn.Tanh(),
            c(2, 1, 3, padding=4, dilation=4),
        ),
        nd,
    )


def strided(nd: int) -> Stack:
    """Stride-2 conv (k3), conv k3 at half resolution, nearest 2x upsampling.

    Output o reads half-resolution cells o // 2 - 1 .. o // 2 + 1, each reading input
    2j - 1 .. 2j + 1: so inputs o - 3 .. o + 3 for even o and o - 4 .. o + 2 for odd o: radius 4.
    """
    c = CONV[nd]
    return Stack(
        nn.Sequential(
            c(1, 2, 3, stride=2, padding=1),
            nn.Tanh(),
            c(2, 1, 3, padding=1),
            nn.Upsample(scale_factor=2, mode="nearest"),
        ),
        nd,
        alignment=2,
    )


@pytest.mark.parametrize(
    ("build", "nd", "radius"),
    [
        pytest.param(plain, 1, 4, id="plain-1d"),
        pytest.param(plain, 2, 4, id="plain-2d"),
        pytest.param(plain, 3, 4, id="plain-3d"),
        pytest.param(dilated, 2, 7, id="dilated-2d"),
        pytest.param(dilated, 3, 7, id="dilated-3d"),
        pytest.param(strided, 1, 4, id="strided-1d"),
        pytest.param(strided, 2, 4, id="strided-2d"),
        pytest.param(strided, 3, 4, id="strided-3d"),
    ],
)
def test_probe_exact_radius(build, nd: int, radius: int) -> None:
    result = probe_receptive_field(build(nd), probe_shape=32)
    assert result.radius == (radius,) * nd
    assert result.bounded


def test_probe_single_phase_misses_strided_reach() -> None:
    # Only phase 0 (even voxels): the odd-phase reach of 4 is not seen: hence the default phases.
    result = probe_receptive_field(strided(1), probe_shape=32, phases=[0])
    assert result.radius == (3,)


def test_probe_reports_unbounded_when_too_small() -> None:
    result = probe_receptive_field(dilated(2), probe_shape=8)
    assert not result.bounded


def test_calibrated_halo_within_radius() -> None:
    stack = dilated(2)
    exact = calibrate_halo(stack, (48, 48), tolerance=1e-6, max_halo=12)
    assert exact.met and exact.halo <= 7 and exact.errors[7] == 0.0
    loose = calibrate_halo(stack, (48, 48), tolerance=1.0, max_halo=12)
    assert loose.halo <= exact.halo


def test_text_det_radius_is_finite(text_det) -> None:
    """Acceptance: the probe returns a finite radius for text-det-2d (global pools frozen)."""
    radius = text_det.receptive_field()
    logger.info("text-det-2d receptive field radius %s", radius)
    assert len(radius) == 2 and all(100 <= r < 512 for r in radius)
    assert text_det.calibrator._probe is not None and text_det.calibrator._probe.bounded


def test_calibration_is_cached_per_sample_not_first_sample_wins(caplog: pytest.LogCaptureFixture) -> None:
    """A flat image needs no halo; a textured one does: the first one's halo must not stick."""
    import numpy as np

    from models import ModelRepository

    model = ModelRepository("/nonexistent-tilewise-models").get("gaussian-2d")
    flat = np.zeros((1, 96, 96), dtype=np.float32)
    textured = np.random.default_rng(0).random((1, 96, 96), dtype=np.float32)
    with caplog.at_level(logging.INFO, logger="models.measure.calibration"):
        first = model.calibrate((32, 32), 1e-4, flat)
        second = model.calibrate((32, 32), 1e-4, textured)
    assert first.halo == 0 and second.halo > 0
    assert first.sample != second.sample and second.sample.startswith("sample 1x")
    assert second.sample in caplog.text  # the log names the sample the halo came from
    assert model.calibrate((32, 32), 1e-4, textured.copy()) is second  # same data: cached
    assert model.calibrate((32, 32), 1e-4).sample == "synthetic sample"


def test_measured_receptive_field_reaches_the_models_listing(tmp_path) -> None:
    """A spec without receptive_field: warm-up probes it and spec().info() (/v1/models) reports it."""
    import yaml

    from models import ModelRepository
    from models.export import export_torchscript

    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 1, 5, padding=2))  # radius 3
    export_torchscript(net.eval(), tmp_path / "stack.pt", in_channels=1, export_shape=(32, 32))
    spec = {
        "name": "stack",
        "backend": "torchscript",
        "file": "stack.pt",
        "spatial_dims": 2,
        "in_channels": 1,
        "out_channels": 1,
    }
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    repo = ModelRepository(tmp_path, device="cpu")
    assert repo.spec("stack").info()["receptive_field"] is None  # not measured yet
    repo.warmup(["stack"])
    assert repo.spec("stack").info()["receptive_field"] == [3, 3]
    assert [s.info()["receptive_field"] for s in repo.specs() if s.name == "stack"] == [[3, 3]]
    assert repo.spec("gaussian-2d").info()["receptive_field"] == [8, 8]

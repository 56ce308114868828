"""models.measure.dependence: the tile-dependence probe on local and tile-dependent torch networks.

Small networks with known behaviour: conv + eval-mode batch norm and dilated convs are local (a far
change leaves the centre bit-identical); instance norm, global average pooling and train-mode batch
norm use whole-tile statistics.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.errors import InputError
from models.measure.dependence import ProbeError, TileDependence, probe_tile_dependence


def _conv_stack(dims: int, norm: type[nn.Module], dilations=(1, 1, 1), channels: int = 4) -> nn.Sequential:
    conv = nn.Conv3d if dims == 3 else nn.Conv2d
    layers: list[nn.Module] = []
    c_in = 1
    for d in dilations:
        layers += [conv(c_in, channels, 3, padding=d, dilation=d), norm(channels), nn.ReLU()]
        c_in = channels
    layers.append(conv(channels, 2, 1))
    net = nn.Sequential(*layers)
    for m in net.modules():  # non-trivial running statistics, so eval-mode batch norm is not identity
        if isinstance(m, nn.BatchNorm2d | nn.BatchNorm3d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return net.eval()


class _GlobalPool(nn.Module):
    """A conv whose output gets the tile's channel means added back (squeeze-and-excitation-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y + y.mean(dim=(2, 3, 4), keepdim=True)


def _probe(net, dims=3, tile=24, **kw) -> TileDependence:
    return probe_tile_dependence(net, spatial_dims=dims, in_channels=1, tile_shape=tile, **kw)


def test_conv_with_eval_batch_norm_is_local():
    result = _probe(_conv_stack(3, nn.BatchNorm3d))
    assert not result.tile_dependent
    assert result.radius == (3, 3, 3) and result.radius_source == "measured"
    assert result.max_change == 0.0  # the centre's inputs are identical: so are its outputs
    assert result.n_far > 0 and result.n_calls == 3  # impulse probe (one call) + two tiles


def test_instance_norm_is_tile_dependent():
    net = _conv_stack(3, nn.InstanceNorm3d)
    result = _probe(net)
    assert result.tile_dependent and result.relative_change > 0.1
    # the impulse reaches the tile's edge, so the radius is assumed: a quarter of the tile
    assert result.radius_source == "assumed" and result.radius == (6, 6, 6)
    given = _probe(net, radius=3)
    assert given.tile_dependent and given.radius_source == "given" and given.n_calls == 2


def test_global_average_pool_is_tile_dependent():
    result = _probe(_GlobalPool().eval(), radius=1)
    assert result.tile_dependent and result.relative_change > 0.05
    assert _probe(_GlobalPool().eval()).tile_dependent


def test_train_mode_batch_norm_is_tile_dependent():
    # batch statistics over one tile: the two tiles run in separate calls, so the change shows
    net = _conv_stack(3, nn.BatchNorm3d).train()
    assert _probe(net, radius=3).tile_dependent


def test_dilated_net_with_a_large_finite_radius_is_local():
    net = _conv_stack(3, nn.BatchNorm3d, dilations=(1, 3, 9))  # radius 1 + 3 + 9 = 13
    measured = _probe(net, tile=32)
    assert measured.radius == (13, 13, 13) and measured.radius_source == "measured"
    assert not measured.tile_dependent and measured.max_change == 0.0
    assert not _probe(net, tile=32, radius=13).tile_dependent
    # a radius below the true one puts changed voxels inside the receptive field: the probe says so
    assert _probe(net, tile=32, radius=8).tile_dependent


def test_2d_networks_and_per_axis_tiles():
    local = probe_tile_dependence(
        _conv_stack(2, nn.BatchNorm2d), spatial_dims=2, in_channels=1, tile_shape=(40, 24)
    )
    assert not local.tile_dependent and local.tile_shape == (40, 24)
    dependent = probe_tile_dependence(
        _conv_stack(2, nn.InstanceNorm2d), spatial_dims=2, in_channels=1, tile_shape=(40, 24)
    )
    assert dependent.tile_dependent and dependent.radius == (10, 6)


def test_tolerance_is_relative_to_the_outputs():
    net = _conv_stack(3, nn.InstanceNorm3d)
    result = _probe(net, radius=3)
    assert not _probe(net, radius=3, tolerance=result.relative_change * 1.01).tile_dependent
    # the same network with outputs 1000 times larger: same relative change, same verdict
    big = _probe(lambda x: 1000.0 * net(x), radius=3)
    assert big.tile_dependent and big.relative_change == pytest.approx(result.relative_change, rel=1e-5)


def test_errors():
    net = _conv_stack(3, nn.BatchNorm3d)
    with pytest.raises(ProbeError, match="no voxel farther than radius"):
        _probe(net, tile=9, radius=4)
    with pytest.raises(ProbeError, match=r"tile_shape=\(8, 8\)"):
        _probe(net, tile=(8, 8))
    with pytest.raises(ProbeError, match="radius"):
        _probe(net, radius=(1, -1, 1))
    with pytest.raises(ProbeError, match="spatial_dims=4"):
        _probe(net, dims=4)
    with pytest.raises(ProbeError, match="tolerance"):
        _probe(net, radius=1, tolerance=float("nan"))
    pool = nn.Sequential(net, nn.MaxPool3d(2))
    with pytest.raises(ProbeError, match=r"predictor returned shape \(1, 2, 12, 12, 12\)"):
        _probe(pool, radius=1)
    assert issubclass(ProbeError, InputError)

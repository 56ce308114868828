"""Centred placements reproduce MONAI's ``sliding_window_inference`` and nnU-Net's window origins.

Oracles: ``monai.inferers.sliding_window_inference`` itself (padding, windows, blending) and
``nnunetv2``'s ``compute_steps_for_sliding_window``, on sizes below, on and above the window, odd
and prime, with a tile-dependent predictor (its output depends on where the window lies).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tiling import Placement, TileGrid, tiled_inference
from tiling.grid import centred_starts


def _dependent(x: torch.Tensor) -> torch.Tensor:
    """A tile-dependent predictor: a 3x3 average minus the window's mean, and a position ramp."""
    dims = tuple(range(2, x.ndim))
    local = torch.nn.functional.avg_pool2d(x, 3, 1, 1, count_include_pad=True) if x.ndim == 4 else x
    ramp = torch.linspace(0, 1, x.shape[-1]).expand_as(x)
    return torch.cat([local - x.mean(dims, keepdim=True), x * ramp], dim=1)


@pytest.mark.parametrize("shape", [(30, 40), (32, 32), (33, 50), (61, 97), (17, 131), (64, 29)])
@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5])
def test_centred_monai_equals_monai_sliding_window(shape: tuple[int, int], overlap: float) -> None:
    from monai.inferers import sliding_window_inference

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((1, *shape)).astype(np.float32)
    roi = (32, 32)
    expected = sliding_window_inference(torch.from_numpy(x)[None], roi, 3, _dependent, overlap=overlap,
                                        mode="constant")[0].numpy()  # fmt: skip
    voxels = [t - int(t * (1 - overlap)) for t in roi]
    got = tiled_inference(x, _dependent, roi, overlap=voxels, blend="constant", alignment=4, batch_size=3,
                          placement="centred-monai")  # fmt: skip
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5
    end = tiled_inference(x, _dependent, roi, overlap=voxels, blend="constant", alignment=4)
    if shape != (32, 32):  # the end placement differs wherever padding or windows move
        assert np.abs(end - expected).max() > 1e-2


@pytest.mark.parametrize("shape", [(30, 40), (61, 97)])
def test_centred_monai_gaussian_is_monai_where_its_weights_are_not_floored(shape: tuple[int, int]) -> None:
    from monai.data.utils import compute_importance_map, dense_patch_slices
    from monai.inferers import sliding_window_inference

    x = np.random.default_rng(1).standard_normal((1, *shape)).astype(np.float32)
    expected = sliding_window_inference(torch.from_numpy(x)[None], (32, 32), 1, _dependent, overlap=0.5,
                                        mode="gaussian")[0].numpy()  # fmt: skip
    got = tiled_inference(x, _dependent, 32, overlap=16, blend="gaussian", placement="centred-monai")
    # MONAI floors its N-D importance map at 1e-3 (tilewise's windows are separable, floored at 1e-6
    # per axis): where every window covering a voxel is floored, MONAI takes their plain mean
    importance = compute_importance_map((32, 32), "gaussian").numpy()
    padded = [max(s, 32) for s in shape]
    strongest = np.zeros(padded, np.float32)
    for window in dense_patch_slices(padded, (32, 32), (16, 16)):
        strongest[window] = np.maximum(strongest[window], importance)
    pads = [(p - s) // 2 for p, s in zip(padded, shape, strict=True)]
    strongest = strongest[tuple(slice(p, p + s) for p, s in zip(pads, shape, strict=True))]
    # (a floored weight moves a voxel by at most 1e-3 / strongest of the outputs' spread there)
    diff = np.abs(got - expected).max(axis=0)
    assert diff[strongest >= 0.1].max() <= 1e-2, diff[strongest >= 0.1].max()
    assert np.mean(strongest >= 0.1) >= 0.25


def test_centred_starts_are_nnunet_steps() -> None:
    from nnunetv2.inference.sliding_window_prediction import compute_steps_for_sliding_window

    for tile, length in itertools.product((8, 13, 20, 25, 32, 48), range(1, 160)):
        if length <= tile:
            continue
        expected = compute_steps_for_sliding_window((length,), (tile,), 0.5)[0]
        assert centred_starts(length, tile, tile // 2, Placement.CENTRED_NNUNET) == expected, (length, tile)


def test_centred_pads_half_before_as_monai_and_nnunet() -> None:
    grid = TileGrid.plan((30, 64, 5), (64, 64, 8), alignment=(16, 16, 1), placement="centred-monai")
    assert [a.pad_lo for a in grid.axes] == [17, 0, 1]  # (64 - 30) // 2, none, (8 - 5) // 2
    assert grid.used_tile_shape == (64, 64, 8) and grid.n_tiles == 1
    end = TileGrid.plan((30, 64, 5), (64, 64, 8), alignment=(16, 16, 1))
    assert [a.pad_lo for a in end.axes] == [0, 0, 0] and end.used_tile_shape == (32, 64, 5)


def test_an_axis_with_a_halo_keeps_the_exact_end_plan() -> None:
    centred = TileGrid.plan((100, 20), 32, (4, 4), alignment=4, placement="centred-nnunet")
    end = TileGrid.plan((100, 20), 32, (4, 4), alignment=4)
    assert centred.axes[0].starts == end.axes[0].starts and centred.axes[0].placement is Placement.END
    assert centred.axes[1].pad_lo == 6 and centred.axes[1].tile == 32

"""The Dask path's plan is the plan that runs (issue 20): :func:`tiling.distributed.plan_dask`
against the tiles the predictor is really fed across the chunks (Dask's local scheduler), and
against the blocks' own grids planned one by one."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest
import torch

from tiling import TileGrid
from tiling.distributed import plan_dask, tiled_inference_dask

pytest.importorskip("dask")
pytest.importorskip("zarr")


class CountingFactory:
    """Builds a predictor (x -> 2x) that counts the tiles and voxels it is fed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (tiles, voxels) of each call, in order
        self.lock = threading.Lock()

    def __call__(self):
        def predict(x: torch.Tensor) -> torch.Tensor:
            with self.lock:
                self.calls.append((int(x.shape[0]), int(x[:, 0].numel())))
            return x * 2

        return predict


CASES = [
    pytest.param((61, 47), {"halo": 3, "tile_shape": 16, "chunk_shape": 24}, id="2d-prime"),
    pytest.param(
        (37, 29, 23),
        {"halo": (2, 3, 1), "tile_shape": (12, 16, 8), "chunk_shape": (16, 12, 20), "overlap": (2, 0, 0)},
        id="3d-anisotropic",
    ),  # fmt: skip
    pytest.param((50, 30), {"halo": 4, "chunk_shape": 16, "alignment": 2}, id="block-is-one-tile"),
]


@pytest.mark.parametrize(("shape", "kwargs"), CASES)
def test_the_dask_plan_counts_the_tiles_that_run(shape, kwargs):
    x = np.random.default_rng(0).random((1, *shape), dtype=np.float32)
    factory = CountingFactory()
    y = tiled_inference_dask(x, factory, **kwargs)
    plan = plan_dask(shape, **kwargs)
    ran = factory.calls[1:]  # the first call is the probe (one zero tile, before any block)
    assert factory.calls[0][0] == 1 and sum(n for n, _ in ran) == plan.n_tiles
    assert sum(v for _, v in ran) == pytest.approx(plan.work * math.prod(shape))
    align = kwargs.get("alignment", 1)
    fed = 0
    for block in itertools.product(*plan.blocks):  # each block's own grid, planned one by one
        tile = kwargs.get("tile_shape") or tuple(-(-n // align) * align for n in block)
        grid = TileGrid.plan(block, tile, kwargs["halo"], overlap=kwargs.get("overlap", 0), alignment=align)
        fed += grid.n_tiles
    assert fed == plan.n_tiles and plan.n_chunks > 1
    assert all(d > 0 for d, c in zip(plan.depth, plan.chunks, strict=True) if len(c) > 1)
    np.testing.assert_allclose(np.asarray(y[...]), 2 * x, rtol=0, atol=1e-6)

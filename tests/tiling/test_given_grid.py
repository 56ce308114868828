"""``tiled_inference(..., grid=TileGrid)`` runs the grid it is handed (issue 20 item 1).

Oracle: the same network over the whole image (``_tiling_nets.whole``); a grid planned by
:meth:`TileGrid.plan` gives the very output of the keyword path, and a grid for another image is
refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from _tiling_nets import ConvStack, whole

from tiling import GridError, TileGrid, tiled_inference


@pytest.mark.parametrize("fixed", [False, True])
def test_given_grid_equals_keyword_plan_and_whole_image(fixed: bool) -> None:
    net = ConvStack(2, 1, 2, (1, 1, 1))
    x = np.random.default_rng(3).standard_normal((1, 37, 41)).astype(np.float32)
    kw = {"halo": 3, "overlap": (2, 1), "blend": "hann", "fixed_tile_shape": fixed}
    grid = TileGrid.plan(x.shape[1:], (16, 12), kw["halo"], overlap=kw["overlap"], blend="hann",
                         fixed_tile_shape=fixed)  # fmt: skip
    by_grid = tiled_inference(x, net, grid=grid, batch_size=3)
    by_keywords = tiled_inference(x, net, (16, 12), batch_size=3, **kw)
    assert np.array_equal(by_grid, by_keywords)
    assert float(np.abs(by_grid - whole(net, x)).max()) < 1e-5


def test_given_grid_runs_its_own_tiles() -> None:
    """The engine counts the handed grid's tiles, not a plan of its own."""
    x = np.zeros((1, 50, 50), np.float32)
    grid = TileGrid.plan((50, 50), 20, 2)
    seen: list[int] = []
    tiled_inference(x, lambda t: t, grid=grid, batch_size=1, progress=seen.append)
    assert sum(seen) == grid.n_tiles == 9


def test_grid_for_another_shape_is_refused() -> None:
    grid = TileGrid.plan((40, 40), 16, 2)
    with pytest.raises(GridError, match=r"planned for spatial shape \(40, 40\).*input's is \(41, 40\)"):
        tiled_inference(np.zeros((1, 41, 40), np.float32), lambda t: t, grid=grid)


def test_grid_and_disagreeing_tile_are_refused() -> None:
    grid = TileGrid.plan((40, 40), 16, 2)
    with pytest.raises(GridError, match="disagrees"):
        tiled_inference(np.zeros((1, 40, 40), np.float32), lambda t: t, (20, 20), grid=grid)


def test_neither_tile_nor_grid_is_refused() -> None:
    with pytest.raises(GridError, match="give tile_shape"):
        tiled_inference(np.zeros((1, 8), np.float32), lambda t: t)

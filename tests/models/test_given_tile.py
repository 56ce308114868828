"""A given tile is honoured as a limit on a grid of the fewest tiles (issue 23 item 2).

The field case: ``tissue-3d``, ``tta=mirror``, an MNI152 crop with ``tile=`` its own shape,
``halo=0``, ``overlap=0`` answered ``X-Tilewise-Plan: ...; tiles=8`` where the plan without TTA
says 1: the grid is the one tile, run once per flip of the three axes. The header now says so
(``passes=8``), the grid with ``tta=mirror`` is the grid without it whatever the tile and shape, and
a given tile that ``halo=auto`` grows is said in the plan's warning (``X-Tilewise-Warning``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from models import ModelRepository, parse_params


@pytest.fixture(scope="module")
def repo() -> ModelRepository:
    return ModelRepository("/nonexistent", device="cpu")


def _plan(model: Any, shape: tuple[int, ...], query: dict[str, str]) -> Any:
    return model.plan(shape, parse_params(query), calibrate=False)


def test_the_field_case_one_tile_eight_passes(repo: ModelRepository) -> None:
    tissue = repo.get("tissue-3d")
    shape = (48, 56, 44)  # a crop of the MNI152 (multiples of the alignment 4)
    query = {"tile": "48,56,44", "halo": "0", "overlap": "0"}
    plain = _plan(tissue, shape, query)
    mirrored = _plan(tissue, shape, {**query, "tta": "mirror"})
    assert plain.grid.n_tiles == mirrored.grid.n_tiles == 1
    assert mirrored.grid.used_tile_shape == plain.grid.used_tile_shape == shape
    assert plain.header() == "tile=48,56,44; halo=0,0,0; overlap=0,0,0; tiles=1; work=1.00"
    assert mirrored.header() == "tile=48,56,44; halo=0,0,0; overlap=0,0,0; tiles=8; work=8.00; passes=8"
    assert mirrored.warning is None and mirrored.tile_source == "given"


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(*[st.integers(5, 97)] * 3),
    tile=st.tuples(*[st.sampled_from((4, 8, 12, 28, 48, 64, 100))] * 3),
    halo=st.integers(0, 9),
)
def test_mirror_keeps_the_grid_of_a_given_tile(
    repo: ModelRepository, shape: tuple[int, ...], tile: tuple[int, ...], halo: int
) -> None:
    """Over shapes, tiles and halos: the given tile bounds the tile fed to the network, the grid
    has the fewest tiles of that limit on every axis, and ``tta=mirror`` only multiplies by 8."""
    assume(min(tile) > 2 * halo)
    gauss = repo.get("gaussian-3d")
    query = {"tile": ",".join(map(str, tile)), "halo": str(halo), "overlap": "0"}
    plain = _plan(gauss, shape, query)
    mirrored = _plan(gauss, shape, {**query, "tta": "mirror"})
    assert _layout(mirrored.grid) == _layout(plain.grid) and mirrored.n_tiles == 8 * plain.grid.n_tiles
    assert all(u <= t for u, t in zip(plain.grid.used_tile_shape, tile, strict=True))
    if halo == 0:  # the fewest tiles of that limit
        assert plain.grid.n_tiles == math.prod(-(-n // t) for n, t in zip(shape, tile, strict=True))
    assert mirrored.header().endswith("; passes=8") and "passes" not in plain.header()


def _layout(grid: Any) -> list[Any]:
    """Where each tile of each axis reads and writes."""
    return [(grid.used_tile_shape, a.starts, a.writes, a.crops) for a in grid.axes]


def test_a_given_tile_grown_by_auto_halo_says_why(repo: ModelRepository) -> None:
    """``halo=auto`` on a given tile of 16: the halo (the receptive-field radius 8, no calibration
    in a dry plan) would feed (32/16)^3 = 8 voxels per input voxel; the planner grows the tile and
    the warning names the given tile, the tile used and why."""
    gauss = repo.get("gaussian-3d")
    plan = _plan(gauss, (120, 120, 120), {"tile": "16", "halo": "auto"})
    assert plan.tile_source == "grown" and plan.grid.used_tile_shape == (51, 51, 51)
    assert plan.warning is not None and "tile=16,16,16 grown to 51,51,51" in plan.warning
    assert "give a halo to keep the tile" in plan.warning
    kept = _plan(gauss, (120, 120, 120), {"tile": "16", "halo": "6"})
    assert kept.tile_source == "given" and max(kept.grid.used_tile_shape) <= 16

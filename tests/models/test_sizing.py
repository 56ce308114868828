"""Halo and tile chosen together, within a memory budget (models.planning.sizing, models.planning.planner).

Footprints here are fixed numbers (no measurement), so the plans are pure arithmetic: the grow rule
on the issue's case (a calibrated halo of 40 on 96^3 tiles of the 1 mm MNI152: 560 tiles), the
default plan of every built-in model at or below 2.4 voxels through the network per input voxel,
the fit rule within a budget, and the out-of-memory shrink.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models import InferenceParams, ModelRepository
from models.measure.footprint import Footprint
from models.planning.cost import network_seconds, peak_bytes
from models.planning.params import Blend, OutputKind, Tta
from models.planning.planner import auto_halo_rule, given_halo_rule, shrink_plan, size_plan
from models.planning.sizing import WORK_TARGET, batch_options, shrink_tile
from models.spec import spec_from_mapping

MNI = (197, 233, 189)
#: The benchmarks' U-Net: ~300 B per voxel at any batch, 3 us per voxel.
UNET = Footprint(300.0, 8 * 2**20, 300.0, 8 * 2**20, 2**21, 3e-6, 0.01, "hwm")
GB = 10**9


def _unet_spec(**defaults: object) -> object:
    return spec_from_mapping(
        {
            "name": "unet-3d",
            "backend": "torchscript",
            "file": "unet.pt",
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": 2,
            "alignment": 16,
            "defaults": {"tile": 96, "halo": "auto", "batch_size": 1, **defaults},
        }
    )


def _size(spec: object, shape: tuple[int, ...], halo_of: object, *, budget: int | None = None,
          default_budget: int = 12 * GB, tile: int = 96, batch: int = 1, tile_given: bool = True,
          batch_given: bool = False, auto: bool = True) -> object:  # fmt: skip
    return size_plan(
        spec,
        shape,
        (tile,) * 3,
        halo_of,
        (0, 0, 0),
        Blend.CONSTANT,
        batch,
        OutputKind.PROBABILITIES,
        Tta.NONE,
        fixed_tile_shape=auto,
        tile_given=tile_given,
        batch_given=batch_given,
        auto_halo=auto,
        footprint=lambda: UNET,
        memory_budget=budget,
        default_budget=lambda: default_budget,
    )


def test_the_issue_case_grows_the_tile_instead_of_560_tiles() -> None:
    """halo="auto" calibrated to 40 (the cap of a 96^3 tile) on the 1 mm MNI152: 8x10x7 = 560 tiles
    at the tile limit; the planner grows the tile: at most MONAI's 27 tiles, work <= 2.4."""
    spec = _unet_spec()
    rule = auto_halo_rule((47, 47, 47), (63, 63, 63), MNI, 16)  # not met: the largest halo tried
    assert rule((96, 96, 96)) == (40, 40, 40)
    sized = _size(spec, MNI, rule)
    assert sized.tile_source == "grown"
    assert sized.grid.n_tiles <= 27 and sized.grid.work <= WORK_TARGET
    # within the budget, and the halo no smaller than at the tile limit (or one tile: no seam)
    assert peak_bytes(_plan(sized, MNI), 1, 2, UNET) <= 12 * GB
    assert all(h >= 40 for h in sized.halo) or sized.grid.n_tiles == 1


def test_growth_stops_at_the_budget_with_the_least_work_that_fits() -> None:
    spec = _unet_spec()
    rule = auto_halo_rule((40, 40, 40), (63, 63, 63), MNI, 16)
    budget = 1 * GB  # 96^3 holds ~280 MB of activations, the whole volume ~2.9 GB
    sized = _size(spec, MNI, rule, default_budget=budget)
    assert sized.tile_source == "grown"
    assert peak_bytes(_plan(sized, MNI), 1, 2, UNET) <= budget
    fixed = _size(spec, MNI, rule, default_budget=1)  # nothing larger fits: the tile limit stays
    assert fixed.tile_source == "given" and fixed.grid.n_tiles == 560
    assert sized.grid.n_tiles < 560 / 4 and sized.grid.work < fixed.grid.work / 2


def test_a_small_calibrated_halo_keeps_the_requested_tile_where_it_is_cheap() -> None:
    big = (400, 400, 400)  # 5 tiles of 96 per axis: work 1.73
    sized = _size(_unet_spec(), big, auto_halo_rule((6, 6, 6), (63, 63, 63), big, 16))
    assert sized.tile_source == "given" and sized.tile == (96, 96, 96) and sized.grid.n_tiles == 125
    # on the MNI152 the same halo at the same tile feeds 2.75 (MONAI's 27 tiles): it grows
    grown = _size(_unet_spec(), MNI, auto_halo_rule((6, 6, 6), (63, 63, 63), MNI, 16))
    assert grown.tile_source == "grown" and grown.grid.work <= WORK_TARGET and grown.grid.n_tiles <= 27


def _calibration(halo: int, errors: dict[int, float], tolerance: float, floor: float = 0.0) -> object:
    from models.measure.receptive import HaloCalibration

    return HaloCalibration(halo, errors[halo], tolerance, errors, errors[halo] <= tolerance, 0.0, "s", floor)


def test_a_grown_tile_keeps_a_halo_no_worse_than_the_start() -> None:
    """The halo a grown tile gets (models.measure.calibration.AutoHalo.halo_no_worse_than)."""
    from models.measure.calibration import AutoHalo

    def auto(halo: int, errors: dict[int, float], tolerance: float, floor: float = 0.0) -> AutoHalo:
        return AutoHalo((halo,) * 3, (63,) * 3, "s", _calibration(halo, errors, tolerance, floor))

    met = auto(6, {0: 0.1, 6: 5e-5, 47: 0.0}, 1e-4)
    assert auto(8, {0: 0.1, 8: 9e-5, 63: 0.0}, 1e-4).halo_no_worse_than(met) == (8, 8, 8)
    assert auto(63, {0: 0.1, 63: 2e-4}, 1e-4).halo_no_worse_than(met) is None  # errs more
    # 1e-12 (never met): the rounding-level errors of two tiles are noise, and the grown tile gets
    # the smallest halo within rounding, not its own largest (which would eat it again)
    start = auto(47, {0: 0.1, 30: 3e-6, 47: 1.5e-8}, 1e-12, floor=1.5e-5)
    grown = {0: 0.1, 20: 1e-3, 30: 4e-6, 47: 3e-8, 63: 4.5e-8}
    assert auto(63, grown, 1e-12, floor=1.5e-5).halo_no_worse_than(start) == (30, 30, 30)
    # without the floor: the halo whose error is within the start's own
    coarse = auto(47, {0: 0.1, 47: 2e-3}, 1e-6)
    assert auto(63, {0: 0.1, 20: 5e-3, 25: 1e-3, 63: 1e-3}, 1e-6).halo_no_worse_than(coarse) == (25, 25, 25)
    assert auto(63, {0: 0.1, 63: 5e-3}, 1e-6).halo_no_worse_than(coarse) is None
    assert AutoHalo((0,) * 3, (63,) * 3, "one tile").halo_no_worse_than(start) == (0, 0, 0)


def test_a_grown_tile_whose_own_halo_costs_more_than_the_start_is_not_taken() -> None:
    spec = _unet_spec()
    rule = auto_halo_rule((40, 40, 40), (63, 63, 63), MNI, 16)
    start = _size(spec, MNI, rule, default_budget=1 * GB)
    assert start.tile_source == "grown"
    grown_tile = start.tile

    def verify_with(halo: int) -> object:
        def verify(tile: tuple[int, ...]) -> object:
            assert tile == grown_tile
            return given_halo_rule((halo,) * 3)

        return verify

    kept = size_plan(*_args(spec, rule), **_kwargs(verify=verify_with(40), default_budget=1 * GB))
    assert kept.tile_source == "grown" and kept.tile == grown_tile and kept.grid.work == start.grid.work
    smaller = size_plan(*_args(spec, rule), **_kwargs(verify=verify_with(8), default_budget=1 * GB))
    assert smaller.tile_source == "grown" and smaller.halo == (8, 8, 8)
    assert smaller.grid.work <= start.grid.work
    # a halo that leaves the grown tile a core of 16: more work than the 560 tiles at the limit
    eaten_halo = (min(grown_tile) - 16) // 2
    eaten = size_plan(*_args(spec, rule), **_kwargs(verify=verify_with(eaten_halo), default_budget=1 * GB))
    assert eaten.tile_source == "given" and eaten.grid.n_tiles == 560
    # a halo the grown tile cannot hold at all
    none = size_plan(*_args(spec, rule), **_kwargs(verify=verify_with(10**6), default_budget=1 * GB))
    assert none.tile_source == "given" and none.grid.n_tiles == 560


def _args(spec: object, rule: object) -> tuple[object, ...]:
    return (spec, MNI, (96,) * 3, rule, (0, 0, 0), Blend.CONSTANT, 1, OutputKind.PROBABILITIES, Tta.NONE)


def _kwargs(**over: object) -> dict[str, object]:
    base = {"fixed_tile_shape": True, "tile_given": True, "batch_given": False, "auto_halo": True,
            "footprint": lambda: UNET, "memory_budget": None, "default_budget": lambda: 12 * GB}  # fmt: skip
    default_budget = over.pop("default_budget", None)
    if default_budget is not None:
        base["default_budget"] = lambda: default_budget
    return {**base, **over}


def test_a_given_tile_with_a_given_halo_is_kept_whatever_it_costs() -> None:
    sized = _size(_unet_spec(), MNI, given_halo_rule((40, 40, 40)), auto=False)
    assert sized.tile_source == "given" and sized.grid.n_tiles == 560


def test_a_default_tile_with_a_given_halo_grows() -> None:
    """The rule lives in the planner: a spec whose default halo eats its default tile is fixed too."""
    sized = _size(_unet_spec(), MNI, given_halo_rule((24, 24, 24)), auto=False, tile_given=False)
    assert sized.tile_source == "grown" and sized.grid.work <= WORK_TARGET


def test_a_tile_dependent_network_keeps_its_tile() -> None:
    spec = _unet_spec(halo=0, blend="gaussian", overlap=48)
    spec = spec.model_copy(update={"tile_dependent": True})
    sized = _size(spec, MNI, given_halo_rule((0, 0, 0)), auto=False, tile_given=False, budget=10 * GB)
    assert sized.tile == (96, 96, 96)


@pytest.mark.parametrize("budget_mb", [300, 600, 2000])
def test_the_fit_rule_keeps_within_the_budget_and_is_faster_with_more(budget_mb: int) -> None:
    spec = _unet_spec(halo=8)
    rule = given_halo_rule((8, 8, 8))
    sized = _size(spec, MNI, rule, budget=budget_mb * 2**20, tile_given=False, auto=False)
    plan = _plan(sized, MNI)
    assert sized.tile_source == "budget"
    assert peak_bytes(plan, 1, 2, UNET) <= budget_mb * 2**20
    tighter = _size(spec, MNI, rule, budget=budget_mb * 2**20 // 2, tile_given=False, auto=False)
    assert network_seconds(plan, UNET) <= network_seconds(_plan(tighter, MNI), UNET)


def test_the_fit_rule_picks_the_batch_when_the_tile_is_given() -> None:
    spec = _unet_spec(halo=8, batch_size=8)
    rule = given_halo_rule((8, 8, 8))
    one_tile = 300 * 96**3 + 8 * 2**20 + 2 * 4 * 96**3
    images = 4 * math.prod(MNI) * 3  # input, its float32 copy, two output channels
    budget = images + 4 * one_tile
    sized = _size(spec, MNI, rule, budget=budget, batch=8, auto=False)
    assert sized.tile == (96, 96, 96) and sized.batch_size in (2, 4)
    assert peak_bytes(_plan(sized, MNI), 1, 2, UNET) <= budget


def test_a_budget_that_cannot_be_met_never_buys_tiny_tiles() -> None:
    """Input and output alone over the budget: the least memory at no more work than the start."""
    spec = _unet_spec(halo=8)
    rule = given_halo_rule((8, 8, 8))
    start = _size(spec, MNI, rule, tile_given=False, auto=False)
    sized = _size(spec, MNI, rule, budget=10 * 2**20, tile_given=False, auto=False)
    assert sized.batch_size == 1 and sized.grid.work <= max(WORK_TARGET, start.grid.work)
    assert peak_bytes(_plan(sized, MNI), 1, 2, UNET) <= peak_bytes(_plan(start, MNI), 1, 2, UNET)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(*[st.integers(20, 420)] * 3),
    name=st.sampled_from(["gaussian-3d", "log-3d", "sobel-3d", "tissue-3d"]),
)
def test_every_3d_builtin_default_plan_keeps_work_at_most_2_4(shape: tuple[int, ...], name: str) -> None:
    model = _repository().get(name)
    plan = model.plan(shape, footprint=Footprint.estimate(1))
    assert plan.work <= WORK_TARGET, plan.header()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(*[st.integers(20, 3000)] * 2), name=st.sampled_from(["gaussian-2d", "log-2d", "sobel-2d"])
)
def test_every_2d_builtin_default_plan_keeps_work_at_most_2_4(shape: tuple[int, ...], name: str) -> None:
    model = _repository().get(name)
    plan = model.plan(shape, footprint=Footprint.estimate(1))
    assert plan.work <= WORK_TARGET, plan.header()


def test_model_plan_grows_a_default_tile_that_its_halo_eats() -> None:
    """A model whose spec says tile 32 and halo 12 (core 8: work 64 on a large image): the
    planner grows the tile; a request that gives the tile keeps it."""
    from models.backends import load_predictor
    from models.model import Model

    spec = spec_from_mapping(
        {"name": "small-tile-3d", "backend": "analytic", "architecture": "gaussian", "spatial_dims": 3,
         "in_channels": 1, "out_channels": 1, "defaults": {"tile": 32, "halo": 12}}
    )  # fmt: skip
    model = Model(spec, load_predictor(spec, "cpu"))
    plan = model.plan((150, 150, 150), footprint=Footprint.estimate(1))
    assert plan.tile_source == "grown" and plan.work <= WORK_TARGET and plan.halo == (12, 12, 12)
    given = model.plan((150, 150, 150), InferenceParams(tile=32), footprint=Footprint.estimate(1))
    assert given.tile_source == "given" and given.grid.used_tile_shape == (32, 32, 32)


def test_shrink_halves_the_batch_then_the_tile() -> None:
    model = _repository().get("gaussian-3d")
    plan = model.plan(
        (100, 100, 100), InferenceParams(tile=64, batch_size=4), footprint=Footprint.estimate(1)
    )
    steps = [plan]
    while (smaller := shrink_plan(steps[-1], model.spec)) is not None:
        steps.append(smaller)
    assert [p.batch_size for p in steps[:3]] == [4, 2, 1]
    tiles = [p.grid.used_tile_shape[0] for p in steps[2:]]
    assert tiles[0] > tiles[1] and all(a > b for a, b in zip(tiles, tiles[1:], strict=False))
    assert all(p.halo == plan.halo for p in steps)
    assert steps[-1].grid.used_tile_shape[0] >= 2 * 8 + 1


def test_shrink_tile_and_batch_options() -> None:
    assert shrink_tile((96, 96, 96), (8, 8, 8), (0, 0, 0), 16) == (48, 48, 48)
    assert shrink_tile((48, 32), (20, 8), (0, 0), 16) is None
    assert batch_options(8) == (8, 4, 2, 1) and batch_options(8, n_tiles_hint=3) == (2, 1)


def _plan(sized: object, shape: tuple[int, ...]) -> object:
    from models.planning.plan import RunPlan

    return RunPlan("unet-3d", shape, sized.tile, sized.halo, (0,) * len(shape), Blend.CONSTANT,
                   sized.batch_size, OutputKind.PROBABILITIES, "", sized.grid, Tta.NONE)  # fmt: skip


_REPO: list[ModelRepository] = []


def _repository() -> ModelRepository:
    if not _REPO:
        _REPO.append(ModelRepository("/nonexistent", device="cpu"))
    return _REPO[0]

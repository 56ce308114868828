"""One request's tile, halo, batch size and grid, sized by the rules of :mod:`models.planning.sizing`.

:meth:`models.Model.plan` resolves the parameters (the request's over the spec's defaults) and the
halo rule (a given halo, or ``auto``: the calibrated halo capped for each tile), then calls
:func:`size_plan`, which applies, in this order:

1. a tile-dependent network keeps its tile (its output depends on it); so does a tile given by the
   request with a given halo; a network of ``fixed_tile`` (a transformer) takes no other tile
   (:class:`~models.errors.ParamError` names it);
2. with ``TILEWISE_MEMORY_BUDGET`` and no tile in the request: the **fit** rule picks tile and batch
   (least predicted network time within the budget);
3. otherwise the **grow** rule: when the plan feeds more than ``WORK_TARGET`` (2.4) voxels through
   the network per input voxel, a larger tile within the budget (the default budget: half the
   memory of the machine or container, or of the GPU); then, with ``TILEWISE_MEMORY_BUDGET`` and no
   batch size in the request, the batch that fits;
4. what is left: the tile and batch as resolved.

``RunPlan.tile_source`` says which (``given``, ``default``, ``grown``, ``budget``). Plans of
``halo="auto"`` and of tile-dependent networks keep one tile shape (``fixed_tile_shape``): a
calibrated halo is an estimate from sampled tiles, and the fixed-shape plan keeps the margins it was
calibrated with (text-det-2d's calibrated halo 61 errs by 0.023 with tiles sized to the grid); a
tile-dependent network's output depends on the tile it sees, so its plans hold at the tile size they
were measured at (brain-mask-3d, 192^3 tiles over its 256^3 frame: Dice 0.98 against the whole
pass; sized to 160^3, 0.966), the patch shape it was trained on, as in nnU-Net's and MONAI's windows.
A device out of memory shrinks the plan and runs it again (:func:`retry_smaller`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from models.errors import DeviceOutOfMemoryError, ParamError
from models.execution.options import RunOptions
from models.measure.footprint import Footprint
from models.planning.cost import network_seconds, peak_bytes
from models.planning.params import Blend, OutputKind, Tta
from models.planning.plan import RunPlan
from models.planning.sizing import Candidate, Sizer, batch_options, shrink_tile
from models.spec import ModelSpec
from tiling import GridError, Placement, TileGrid, aligned_extent, cap_halo, fits_one_tile
from tiling.plan import per_axis

__all__ = [
    "HaloRule",
    "Sizing",
    "auto_halo_rule",
    "default_memory_budget",
    "given_halo_rule",
    "retry_smaller",
    "shrink_plan",
    "size_plan",
    "smaller_tiles",
]

T = TypeVar("T")

#: The halo a tile limit gets.
HaloRule = Callable[[tuple[int, ...]], tuple[int, ...]]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sizing:
    """The sized parts of a plan and where its tile came from."""

    tile: tuple[int, ...]
    halo: tuple[int, ...]
    batch_size: int
    grid: TileGrid
    tile_source: str
    #: The memory budget asked for and the predicted peak bytes of this plan, when no plan fits it.
    budget_unmet: tuple[int, int] | None = None


def given_halo_rule(halo: tuple[int, ...]) -> HaloRule:
    """Every tile gets ``halo``."""
    return lambda _tile: halo


def auto_halo_rule(
    want: tuple[int, ...], radius: tuple[int, ...], shape: tuple[int, ...], alignment: int | tuple[int, ...]
) -> HaloRule:
    """``halo="auto"``: ``want`` capped by the radius and by what the tile allows
    (:func:`tiling.cap_halo`); none when one tile covers the image (no seam to protect).

    >>> rule = auto_halo_rule((40, 40, 40), (63, 63, 63), (197, 233, 189), 16)
    >>> rule((96, 96, 96)), rule((144, 144, 144)), rule((208, 240, 192))
    ((40, 40, 40), (40, 40, 40), (0, 0, 0))
    """

    def rule(tile: tuple[int, ...]) -> tuple[int, ...]:
        if fits_one_tile(shape, tile, alignment):
            return (0,) * len(tile)
        return cap_halo(want, radius, tile, alignment)

    return rule


def shrink_plan(plan: RunPlan, spec: ModelSpec) -> RunPlan | None:
    """The plan to retry after the device ran out of memory: half the batch, else half the tile
    (same halo, overlap and options; :func:`models.planning.sizing.shrink_tile`); ``None`` when both are at
    their least."""
    batch = min(plan.batch_size, plan.grid.n_tiles)
    if batch > 1:
        return dataclasses.replace(plan, batch_size=batch // 2)
    smaller = shrink_tile(plan.grid.used_tile_shape, plan.halo, plan.overlap, spec.alignment_per_axis)
    if smaller is None:
        return None
    grid = TileGrid.plan(
        plan.spatial_shape, smaller, plan.halo, overlap=plan.overlap, alignment=spec.alignment_per_axis,
        scale=spec.scale, blend=plan.blend.value, fixed_tile_shape=plan.grid.fixed_tile_shape,
        placement=[a.placement for a in plan.grid.axes],
    )  # fmt: skip
    return dataclasses.replace(plan, tile=grid.tile_shape, grid=grid, batch_size=1)


def retry_smaller(
    run: Callable[[RunPlan, Any], T],
    plan: RunPlan,
    spec: ModelSpec,
    device: object,
    options: RunOptions | None = None,
) -> tuple[T, RunPlan]:
    """``run(plan, options.resume)``; when the device runs out of memory, again from the start
    with the next smaller plan (:func:`shrink_plan`: half the batch, then half the tile), until it
    fits or nothing shrinks (the error is raised). ``options.replanned`` is told each smaller plan;
    ``options.reuse``'s counts go back to where they were before each failed attempt.
    Returns the result and the plan that made it."""
    resume = None if options is None else options.resume
    replanned = None if options is None else options.replanned
    reuse = None if options is None else options.reuse
    counts = None if reuse is None else reuse.counts()  # a retry counts its tiles once
    while True:
        try:
            return run(plan, resume), plan
        except DeviceOutOfMemoryError as exc:
            if reuse is not None and counts is not None:
                reuse.rewind(counts)
            smaller = shrink_plan(plan, spec)
            if smaller is None:
                raise
            logger.warning(
                "model %s: out of memory with batch %d of %s tiles (%s); retrying with batch %d of %s tiles",
                spec.name,
                min(plan.batch_size, plan.grid.n_tiles),
                "x".join(map(str, plan.grid.used_tile_shape)),
                str(exc).splitlines()[0][:200],
                smaller.batch_size,
                "x".join(map(str, smaller.grid.used_tile_shape)),
            )
            if str(device).startswith("cuda"):
                import torch

                torch.cuda.empty_cache()  # the caching allocator's free blocks, before the retry
            plan, resume = smaller, None  # a resumed run's rows belong to the old grid
            if replanned is not None:
                replanned(plan)


#: A streamed plan takes one more tile on an axis when that makes its tiles smaller for at most
#: this fraction more voxels through the network along that axis (:func:`smaller_tiles`).
SMALLER_TILE_WORK = 0.02


def smaller_tiles(
    grid: TileGrid, plan: Callable[[tuple[int, ...]], TileGrid], alignment: tuple[int, ...] | None = None
) -> TileGrid:
    """The grid with, on each axis, one more tile when that costs at most :data:`SMALLER_TILE_WORK`
    more work on the axis (``plan(tile limit)`` plans a grid; tile limits step by ``alignment``,
    default 1).

    Tiles sized to the grid (:mod:`tiling.grid`) are the smallest that cover an axis with a given
    count, so their size depends on the image: a 512x512x400 CT gets 112 slices per tile from a
    limit of 128, the same CT with 800 slices 128, and a streamed run's peak memory follows the
    tile (1.16x). A streamed run (output on disk: memory is the tile's) takes the smaller tiles of
    one more tile per axis where they are nearly free: 114 slices for 800 (1.8 % more work on that
    axis); 112 stays for 400 (93 would cost 3.8 %), and 116 for 512 (99 would cost 2.4 %: measured,
    the 99^2 x 112 plan of 144 tiles peaked at 209 MiB against 131 MiB for 116^2 x 112, 100 tiles,
    although its forward pass holds less, 92 against 132 MiB).

    >>> g = TileGrid.plan((800,), 128, 8)
    >>> g.used_tile_shape, smaller_tiles(g, lambda t: TileGrid.plan((800,), t, 8)).used_tile_shape
    ((128,), (114,))
    >>> g = TileGrid.plan((400,), 128, 8)
    >>> smaller_tiles(g, lambda t: TileGrid.plan((400,), t, 8)).used_tile_shape
    (112,)
    """
    for axis, current in enumerate(grid.axes):
        if current.n_tiles < 2:
            continue  # one tile is the image: no smaller tile covers it with one more
        limit = list(grid.used_tile_shape)
        limit[axis] -= 1 if alignment is None else alignment[axis]  # sized tiles: one more tile
        try:
            smaller = plan(tuple(limit))
        except GridError:
            continue
        fed, now = smaller.axes[axis], current.n_tiles * current.tile
        if fed.tile < current.tile and fed.n_tiles * fed.tile <= now * (1 + SMALLER_TILE_WORK):
            grid = smaller
    return grid


def default_memory_budget(device: object = "cpu") -> int:
    """The budget the grow rule keeps within when ``TILEWISE_MEMORY_BUDGET`` is not set: half the
    memory of the GPU on CUDA, else half of the machine's or container's."""
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.device(str(device))).total_memory // 2)
    from models.measure.rss import memory_limit_bytes

    return memory_limit_bytes() // 2


def size_plan(
    spec: ModelSpec,
    shape: tuple[int, ...],
    tile: tuple[int, ...],
    halo_of: HaloRule,
    overlap: tuple[int, ...],
    blend: Blend,
    batch_size: int,
    output: OutputKind,
    tta: Tta,
    *,
    fixed_tile_shape: bool,
    tile_dependent: bool = False,
    tile_given: bool,
    batch_given: bool,
    auto_halo: bool,
    footprint: Callable[[], Footprint],
    memory_budget: int | None,
    default_budget: Callable[[], int],
    verify: Callable[[tuple[int, ...]], HaloRule | None] | None = None,
    input_bytes: int = 0,
    copies_input: bool = True,
    output_on_disk: bool = False,
) -> Sizing:
    """Apply the rules of the module docstring; ``halo_of(tile)`` is the halo a tile limit gets.

    ``footprint`` and ``default_budget`` are asked only when a rule has to cost plans (a plan of
    at most 2.4 voxels per input voxel without a budget needs neither). ``verify(tile)``, when
    given, checks a tile other than the starting one (``halo="auto"``: calibrated at that tile,
    some networks being exact only at some tile sizes) and returns the halo rule to plan it with,
    or ``None`` to keep the starting tile. ``input_bytes``, ``copies_input`` and
    ``output_on_disk`` are the request's own (:func:`models.planning.cost.peak_bytes`): a budget bounds the
    whole request.
    """
    window = spec.defaults.tile
    window_t = (window,) * len(shape) if isinstance(window, int) else tuple(window or ())
    if spec.fixed_tile and tile != window_t:
        fixed = ",".join(map(str, window_t))
        raise ParamError(
            f"tile={','.join(map(str, tile))}: model {spec.name!r} takes exactly tile={fixed} (a "
            "transformer's input size, fixed by its patch grid); leave tile unset"
        )
    rules = [halo_of]  # the rule in force: a verified tile may bring its own

    align = spec.alignment_per_axis
    window = spec.defaults.tile if spec.padding is not Placement.END else None
    assert not isinstance(window, int)  # the spec's defaults hold one tile size per axis

    def plan_grid(limit: tuple[int, ...]) -> tuple[TileGrid, tuple[int, ...]]:
        def grid_of(t: tuple[int, ...], fixed: bool) -> tuple[TileGrid, tuple[int, ...]]:
            place: tuple[Placement, ...] = (Placement.END,) * len(shape)
            if window is not None:  # an axis the framework's window covers: that window, centred
                t = tuple(w if s <= w < u else u for s, w, u in zip(shape, window, t, strict=True))
            halo = rules[-1](t)
            if window is not None:  # elsewhere the framework's windows, but a halo's exact tiles
                place = tuple(spec.padding if s <= w or h == 0 else Placement.END
                              for s, w, h in zip(shape, window, halo, strict=True))  # fmt: skip
            grid = TileGrid.plan(
                shape, t, halo, overlap=overlap, alignment=align, scale=spec.scale,
                blend=blend.value, fixed_tile_shape=fixed, placement=place,
            )  # fmt: skip
            # streamed: memory follows the tile; a given tile is a limit on the fewest tiles (kept)
            if output_on_disk and not fixed and window is None and not tile_given:
                grid = smaller_tiles(
                    grid, lambda u: TileGrid.plan(
                        shape, u, halo, overlap=overlap, alignment=align, scale=spec.scale,
                        blend=blend.value, placement=place,
                    ), per_axis(align, len(shape)),
                )  # fmt: skip
            return grid, halo

        if not fixed_tile_shape or limit == tile:
            return grid_of(limit, fixed_tile_shape)
        # a fixed-shape plan of another tile: the tightest tile of its count, not the limit itself
        sized, _ = grid_of(limit, False)
        return grid_of(sized.used_tile_shape, True)

    def cost(grid: TileGrid, batch: int) -> tuple[int, float]:
        plan = RunPlan(spec.name, shape, grid.tile_shape, grid.halo, overlap, blend, batch, output, "",
                       grid, tta)  # fmt: skip
        fp = footprint()
        peak = peak_bytes(plan, spec.in_channels, spec.out_channels, fp, input_bytes=input_bytes,
                          copies_input=copies_input, output_on_disk=output_on_disk)  # fmt: skip
        return peak, network_seconds(plan, fp)

    sizer = Sizer(tile, align, aligned_extent(shape, align), plan_grid, cost)
    keep_tile = tile_dependent or bool(spec.tile_dependent) or (tile_given and not auto_halo)
    choice: Candidate | None = None
    source = "given" if tile_given else "default"
    if memory_budget is not None and not keep_tile and not tile_given:
        batches = (batch_size,) if batch_given else batch_options(batch_size)
        choice, source = sizer.fit(batches, memory_budget, tile_fixed=False), "budget"
    else:
        if not keep_tile:
            grown = sizer.grow(batch_size, memory_budget or default_budget)
            if grown is not None:
                choice, source = grown, "grown"
                sizer = Sizer(grown.tile, align, sizer.extent, plan_grid, cost)
        if memory_budget is not None and not batch_given:
            fitted = sizer.fit(batch_options(batch_size), memory_budget, tile_fixed=True)
            choice = fitted if fitted is not None else choice
    if choice is not None and verify is not None and choice.grid.tile_shape != tile:
        rule = verify(choice.grid.tile_shape)
        verified = None
        if rule is not None:
            try:
                start_work = plan_grid(tile)[0].work  # under the starting tile's rule
            except GridError:
                start_work = math.inf
            rules.append(rule)
            verified = sizer.candidate(choice.grid.tile_shape, choice.batch_size)
            # a grown tile whose own halo makes more work than the starting plan is not worth it
            if verified is not None and source == "grown" and verified.work > start_work:
                verified = None
        if verified is None:
            del rules[1:]
            choice, source = None, "given" if tile_given else "default"
        else:
            choice = verified
    if choice is None:
        grid, halo = plan_grid(tile)
        return Sizing(grid.tile_shape, halo, batch_size, grid, source)
    if source != "given":
        logger.info(
            "model %s: tile %s -> %s (%s; work %.2f, predicted peak %.0f MiB)",
            spec.name,
            tile,
            choice.grid.used_tile_shape,
            source,
            choice.work,
            choice.peak_bytes / 2**20,
        )
    unmet = None
    if memory_budget is not None and choice.peak_bytes > memory_budget:
        unmet = (memory_budget, int(choice.peak_bytes))
        logger.warning(
            "model %s: no plan fits the memory budget of %.0f MiB; the smallest plan within the work "
            "bound predicts %.0f MiB", spec.name, memory_budget / 2**20, choice.peak_bytes / 2**20,
        )  # fmt: skip
    return Sizing(choice.grid.tile_shape, choice.halo, choice.batch_size, choice.grid, source, unmet)

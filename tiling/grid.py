"""Tile planning: pure integer arithmetic over shapes, no data and no weights.

Coordinates. Each spatial axis of length ``L`` is planned on a *virtual extent* ``E``: the image,
plus ``halo`` voxels on both sides when ``border="pad"``, rounded up to a multiple of the alignment.
Tiles are intervals ``[t, t + T)`` of that extent with ``t`` a multiple of the alignment (the
network's stride grid). The *region of interest* (roi) is where the real image lies; outputs are
written only there. Output coordinates are input coordinates times the per-axis ``scale``.

Tile count and size. With ``tile_shape`` ``T0``, ``core = T0 - 2 * halo`` and the stride
``s0 = (core - overlap)`` rounded down to the alignment, an axis needs ``n = ceil((E - T0) / s0) + 1``
tiles (never the tail-dropping ``(E - T0) // s0 + 1``). Two placements of those ``n`` tiles:

- *sized to the grid* (the default): every tile is the smallest multiple of the alignment
  ``T <= T0`` for which ``n`` tiles still cover ``E`` (``(n - 1) * stride(T) + T >= E``), and the
  origins are spread evenly from ``0`` to ``E - T`` on the alignment grid (neighbouring gaps differ
  by at most one alignment step). Same tile count, fewer voxels through the network.
- *fixed tile shape* (``fixed_tile_shape=True``, for engines compiled for one input shape, such as
  TensorRT): every tile is ``T0``; origins are ``0, s0, 2 * s0, ...`` and the last tile is shifted
  back to end at the extent edge.

Kept region. Neighbouring tiles ``i`` and ``i + 1`` may both keep the *overlap zone*
``[t[i+1] + halo, t[i] + T - halo)`` (each is at least ``halo`` from its own tile edge there). The
plan keeps ``overlap`` voxels of that zone, centred in it, so the slack left by the alignment (and by
the even spread) is split between both tiles instead of being spent on one side: with ``overlap=0``
the boundary is the zone's midpoint, each tile discarding at least ``halo`` voxels. The first and
the last tile keep everything up to the extent edge (nothing lies beyond). :attr:`TileGrid.work` is
the voxels fed to the network divided by the image's voxels.

Placement. The above is ``placement="end"``. The centred placements of
:class:`~tiling.geometry.Placement` reproduce MONAI's and nnU-Net's sliding windows instead: an axis
no longer than the tile is one tile with the image centred in it (``pad_lo = (T - L) // 2``, extent
``T``); a longer axis without a halo gets the framework's window origins over extent ``L`` (not on
the alignment grid: only the tile size must be aligned), each tile keeping its whole output, blended
over the whole tile (``flat`` never set); a longer axis with a halo keeps the ``end`` plan.

Blend windows and coverage (floating point) live in :mod:`tiling.blend`; this module only says, per
tile, which voxels are written and over which span the window lies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

from tiling.errors import CoverageError, GridError
from tiling.geometry import BlendMode, BorderMode, Placement, as_fractions, as_ints, parse_enum

__all__ = ["AxisPlan", "Tile", "TileGrid", "centred_starts"]

Span = tuple[int, int]


@dataclass(frozen=True, eq=False)
class AxisPlan:
    """The plan of one spatial axis (integers only).

    Attributes:
        length: image length ``L`` along this axis (voxels).
        extent: virtual extent ``E`` (voxels), a multiple of the alignment.
        pad_lo: virtual index of image voxel 0 (the halo for ``border="pad"``, else 0).
        tile: tile length ``T`` actually used (``<= tile_shape``; see the module docstring).
        stride: the largest distance between neighbouring tile origins (voxels; 0 for one tile).
        starts: tile origins in virtual coordinates.
        out_length: output length ``ceil(L * scale)``.
        out_tile: ``T * scale``, the length of one predictor output along this axis.
        crops: per tile, ``(lo, hi)`` of the predictor output that is written (output voxels).
        writes: per tile, ``(lo, hi)`` in the output array (output voxels).
        windows: per tile, ``(lo, hi)`` in output-array coordinates (may reach beyond the roi) over
            which the blend window lies (the kept region before clipping to the roi); written
            voxels outside it get weight 1.
        flat: per tile, whether the window is flat (weight 1) on its low and high side, because
            that side lies on the extent edge where no other tile contributes.
        blended: whether neighbouring writes overlap (``False``: the writes partition the output).
        placement: how this axis was placed (:class:`~tiling.geometry.Placement`; ``end`` also for
            an axis of a centred grid that kept tilewise's own plan).
    """

    length: int
    extent: int
    pad_lo: int
    tile: int
    stride: int
    starts: tuple[int, ...]
    out_length: int
    out_tile: int
    crops: tuple[Span, ...]
    writes: tuple[Span, ...]
    windows: tuple[Span, ...]
    flat: tuple[tuple[bool, bool], ...]
    blended: bool
    placement: Placement = Placement.END

    @property
    def n_tiles(self) -> int:
        """Number of tiles along this axis."""
        return len(self.starts)


@dataclass(frozen=True, eq=False)
class Tile:
    """One tile of a :class:`TileGrid`.

    Attributes:
        index: position in the grid, one int per axis.
        starts: virtual origin per axis (see :mod:`tiling.grid`); the tile spans ``starts + shape``.
        crop: slices of the predictor output ``(*out_tile)`` that are kept.
        write: slices of the output array ``(*out_shape)`` that the kept part goes to.
    """

    index: tuple[int, ...]
    starts: tuple[int, ...]
    crop: tuple[slice, ...]
    write: tuple[slice, ...]


@dataclass(frozen=True, eq=False)
class TileGrid:
    """A Cartesian grid of tiles covering an N-D image (use :meth:`plan`).

    >>> grid = TileGrid.plan((100,), tile_shape=32, halo=4)
    >>> grid.used_tile_shape, grid.axes[0].starts, grid.axes[0].writes
    ((31,), (0, 23, 46, 69), ((0, 27), (27, 50), (50, 73), (73, 100)))
    >>> round(grid.work, 2)
    1.24
    >>> fixed = TileGrid.plan((100,), tile_shape=32, halo=4, fixed_tile_shape=True)
    >>> fixed.used_tile_shape, fixed.axes[0].starts, round(fixed.work, 2)
    ((32,), (0, 24, 48, 68), 1.28)
    """

    spatial_shape: tuple[int, ...]
    tile_shape: tuple[int, ...]
    halo: tuple[int, ...]
    overlap: tuple[int, ...]
    alignment: tuple[int, ...]
    scale: tuple[Fraction, ...]
    border: BorderMode
    blend: BlendMode
    axes: tuple[AxisPlan, ...]
    fixed_tile_shape: bool = False
    placement: Placement = Placement.END

    @classmethod
    def plan(
        cls,
        spatial_shape: Sequence[int],
        tile_shape: int | Sequence[int],
        halo: int | Sequence[int] = 0,
        *,
        overlap: int | Sequence[int] = 0,
        alignment: int | Sequence[int] = 1,
        scale: float | Fraction | Sequence[float | Fraction] = 1,
        border: str | BorderMode = "clip",
        blend: str | BlendMode = "constant",
        fixed_tile_shape: bool = False,
        placement: str | Placement | Sequence[str | Placement] = "end",
    ) -> TileGrid:
        """Plan tiles for an image of ``spatial_shape`` voxels.

        Args:
            spatial_shape: image size per spatial axis (voxels), array-axis order.
            tile_shape: network input size per axis (voxels), a multiple of ``alignment`` unless
                the tile covers the whole (aligned) image.
            halo: margin discarded on each side of a tile's output (voxels), ``>= 0``; set it to at
                least the network's receptive-field radius for whole-image equivalence.
            overlap: voxels shared by neighbouring cores (``0``: cores abut, no accumulator).
            alignment: tile origins and shapes are multiples of it (the network's total stride).
            scale: output voxels per input voxel (2 for 2x upsampling, 0.25 for a stride-4 head).
            border: ``"clip"`` or ``"pad"`` (see :class:`~tiling.geometry.BorderMode`).
            blend: window for overlapping cores (see :class:`~tiling.geometry.BlendMode`).
            fixed_tile_shape: keep every tile at ``tile_shape`` (origins ``0, s, 2s, ...``, the last
                one shifted back to the edge) for engines built for one input shape (TensorRT);
                by default tiles are sized to the grid (same count, smallest aligned size that
                covers, origins spread evenly). Either way tiles exceed the image only when
                ``tile_shape`` does, and then shrink to the aligned image.
            placement: ``"end"`` (tilewise's grid), ``"centred-monai"`` or ``"centred-nnunet"``
                (the source framework's windows and padding; see the module docstring); one, or
                one per axis.

        Raises:
            GridError: a parameter with the wrong number of axes or an invalid value, a halo that
                leaves an empty core, an overlap that leaves no positive stride, a tile that is not
                a multiple of the alignment, or a scale that maps tile edges off the output grid.
        """
        shape = tuple(int(s) for s in spatial_shape)
        ndim = len(shape)
        if ndim == 0:
            raise GridError("the input has no spatial axes")
        for axis, s in enumerate(shape):
            if s < 1:
                raise GridError(f"spatial_shape[{axis}]={s} must be >= 1")
        tiles = as_ints(tile_shape, ndim, "tile_shape", minimum=1)
        halos = as_ints(halo, ndim, "halo", minimum=0)
        overlaps = as_ints(overlap, ndim, "overlap", minimum=0)
        aligns = as_ints(alignment, ndim, "alignment", minimum=1)
        scales = as_fractions(scale, ndim, "scale")
        border_mode = BorderMode(parse_enum(BorderMode, border, "border"))
        blend_mode = BlendMode(parse_enum(BlendMode, blend, "blend"))
        places = [
            Placement(parse_enum(Placement, p, "placement"))
            for p in ((placement,) * ndim if isinstance(placement, str) else placement)
        ]
        if len(places) != ndim:
            raise GridError(f"placement={tuple(placement)} has {len(places)} axes but the input has {ndim}")
        axes = tuple(
            _plan_centred(axis, shape[axis], tiles[axis], overlaps[axis], aligns[axis], scales[axis],
                          places[axis])
            if places[axis] is not Placement.END and (shape[axis] <= tiles[axis] or halos[axis] == 0)
            else _plan_axis(axis, shape[axis], tiles[axis], halos[axis], overlaps[axis], aligns[axis],
                            scales[axis], border_mode, bool(fixed_tile_shape))
            for axis in range(ndim)
        )  # fmt: skip
        place = next((p for p in places if p is not Placement.END), Placement.END)
        return cls(shape, tiles, halos, overlaps, aligns, scales, border_mode, blend_mode, axes,
                   bool(fixed_tile_shape), place)  # fmt: skip

    @property
    def ndim(self) -> int:
        """Number of spatial axes."""
        return len(self.spatial_shape)

    @property
    def n_tiles(self) -> int:
        """Total number of tiles (forward-pass inputs)."""
        return math.prod(a.n_tiles for a in self.axes)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Number of tiles per axis."""
        return tuple(a.n_tiles for a in self.axes)

    @property
    def stride(self) -> tuple[int, ...]:
        """Distance between tile origins per axis (voxels; 0 on axes with one tile)."""
        return tuple(a.stride for a in self.axes)

    @property
    def used_tile_shape(self) -> tuple[int, ...]:
        """Tile shape actually fed to the predictor (at most ``tile_shape``; see the module docstring)."""
        return tuple(a.tile for a in self.axes)

    @property
    def work(self) -> float:
        """Voxels fed to the network divided by the image's voxels (1.0: no redundant work)."""
        fed = self.n_tiles * math.prod(self.used_tile_shape)
        return fed / math.prod(self.spatial_shape)

    @property
    def out_tile_shape(self) -> tuple[int, ...]:
        """Spatial shape of one predictor output, ``used_tile_shape * scale``."""
        return tuple(a.out_tile for a in self.axes)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Spatial shape of the output, ``ceil(spatial_shape * scale)``."""
        return tuple(a.out_length for a in self.axes)

    @property
    def blended(self) -> bool:
        """Whether cores overlap on some axis, so an accumulator and coverage are needed."""
        return any(a.blended for a in self.axes)

    def tiles(self) -> Iterator[Tile]:
        """Yield every tile in C order (axis 0 slowest), deterministically."""
        for index in itertools.product(*(range(a.n_tiles) for a in self.axes)):
            yield Tile(
                index=index,
                starts=tuple(a.starts[i] for a, i in zip(self.axes, index, strict=True)),
                crop=tuple(slice(*a.crops[i]) for a, i in zip(self.axes, index, strict=True)),
                write=tuple(slice(*a.writes[i]) for a, i in zip(self.axes, index, strict=True)),
            )

    def summary(self) -> str:
        """One line for the log: tile count, tile shape, halo, stride and blend."""
        return (
            f"n_tiles={self.n_tiles} grid={self.grid_shape} tile_shape={self.used_tile_shape} "
            f"halo={self.halo} stride={self.stride} overlap={self.overlap} blend={self.blend.value} "
            f"border={self.border.value} work={self.work:.2f}"
            + (" fixed_tile_shape" if self.fixed_tile_shape else "")
            + (f" placement={self.placement.value}" if self.placement is not Placement.END else "")
        )


def _scaled(value: int, scale: Fraction, what: str, axis: int) -> int:
    out = value * scale
    if out.denominator != 1:
        raise GridError(
            f"{what}[{axis}]={value} times scale[{axis}]={scale} = {float(out)} is not a whole "
            "number of output voxels; choose tile, halo and alignment divisible by 1/scale"
        )
    return int(out)


def _place_tiles(
    axis: int, extent: int, tile: int, halo: int, overlap: int, alignment: int, sized: bool
) -> tuple[int, list[int]]:
    """Return ``(used tile, starts)`` for one axis (virtual coordinates); see the module docstring."""
    if tile >= extent:
        return extent, [0]
    if tile % alignment:
        raise GridError(f"tile_shape[{axis}]={tile} is not a multiple of alignment[{axis}]={alignment}")
    core = tile - 2 * halo
    # the smallest tile with a stride of one alignment step: what to ask for instead
    smallest = -(-(2 * halo + overlap + alignment) // alignment) * alignment
    fix = f"; the smallest tile_shape[{axis}] for this halo and overlap is {smallest} (or lower them)"
    if core <= 0:
        raise GridError(
            f"halo[{axis}]={halo} leaves an empty core for tile_shape[{axis}]={tile} "
            f"(core = tile - 2 * halo = {core}){fix}"
        )

    def stride_of(t: int) -> int:
        return (t - 2 * halo - overlap) // alignment * alignment

    stride = stride_of(tile)
    if stride <= 0:
        raise GridError(
            f"overlap[{axis}]={overlap} leaves no positive stride for core {core} "
            f"(tile_shape[{axis}]={tile}, halo[{axis}]={halo}, alignment[{axis}]={alignment}){fix}"
        )
    n = -(-(extent - tile) // stride) + 1
    if not sized:
        return tile, [min(i * stride, extent - tile) for i in range(n)]
    used = tile
    while used > alignment and stride_of(used - alignment) > 0:
        if (n - 1) * stride_of(used - alignment) + used - alignment < extent:
            break
        used -= alignment
    units = (extent - used) // alignment  # spread n - 1 gaps of whole alignment steps evenly
    return used, [i * units // (n - 1) * alignment for i in range(n)]


def _kept_regions(
    starts: Sequence[int], tile: int, halo: int, overlap: int, extent: int, quantum: int
) -> list[Span]:
    """Per tile, the virtual interval whose output it keeps (before clipping to the roi).

    Between tiles ``i`` and ``i + 1`` the kept regions share ``overlap`` voxels (0: they abut) centred
    in the zone both may keep, with boundaries on multiples of ``quantum`` (one output voxel).
    """
    n = len(starts)
    bounds: list[Span] = []
    for t0, t1 in itertools.pairwise(starts):
        zone_lo, zone_hi = t1 + halo, t0 + tile - halo
        keep = min(overlap, zone_hi - zone_lo)
        lo = (zone_lo + (zone_hi - zone_lo - keep) // 2) // quantum * quantum
        hi = min(zone_hi, -(-(lo + keep) // quantum) * quantum)
        bounds.append((max(lo, zone_lo), hi))
    return [(0 if i == 0 else bounds[i - 1][0], extent if i == n - 1 else bounds[i][1]) for i in range(n)]


def _plan_axis(
    axis: int,
    length: int,
    tile: int,
    halo: int,
    overlap: int,
    alignment: int,
    scale: Fraction,
    border: BorderMode,
    fixed: bool,
) -> AxisPlan:
    pad_lo = halo if border is BorderMode.PAD else 0
    extent = -(-(length + 2 * pad_lo) // alignment) * alignment
    # Sizing tiles to the grid moves origins and sizes by alignment steps: only where one alignment
    # step is a whole number of output voxels (otherwise tile edges could fall off the output grid).
    sized = not fixed and (alignment * scale).denominator == 1
    used, starts = _place_tiles(axis, extent, tile, halo, overlap, alignment, sized)
    n = len(starts)
    if n > 1:
        _scaled(halo, scale, "halo", axis)
    kept = _kept_regions(starts, used, halo, overlap, extent, scale.denominator)
    blended = overlap > 0 and n > 1

    out_lo = _scaled(pad_lo, scale, "halo", axis)
    out_length = math.ceil(length * scale)
    out_tile = _scaled(used, scale, "tile_shape", axis)
    kept_starts: list[int] = []
    crops: list[Span] = []
    writes: list[Span] = []
    windows: list[Span] = []
    flat: list[tuple[bool, bool]] = []
    for i, (t, (k_lo, k_hi)) in enumerate(zip(starts, kept, strict=True)):
        t_out = _scaled(t, scale, "tile origin", axis)
        k_lo_out = _scaled(k_lo, scale, "halo", axis)
        k_hi_out = _scaled(k_hi, scale, "halo", axis)
        lo, hi = max(k_lo_out, out_lo), min(k_hi_out, out_lo + out_length)  # clip to the roi
        if hi <= lo:
            continue
        kept_starts.append(t)
        crops.append((lo - t_out, hi - t_out))
        writes.append((lo - out_lo, hi - out_lo))
        windows.append((k_lo_out - out_lo, k_hi_out - out_lo))
        flat.append((i == 0, i == n - 1))
    gaps = [b - a for a, b in itertools.pairwise(kept_starts)]
    _check_cover(axis, writes, out_length, blended, f"length={length}, tile={used}, halo={halo}")
    return AxisPlan(
        length=length,
        extent=extent,
        pad_lo=pad_lo,
        tile=used,
        stride=max(gaps, default=0),
        starts=tuple(kept_starts),
        out_length=out_length,
        out_tile=out_tile,
        crops=tuple(crops),
        writes=tuple(writes),
        windows=tuple(windows),
        flat=tuple(flat),
        blended=blended,
    )


def centred_starts(length: int, tile: int, overlap: int, placement: Placement) -> list[int]:
    """Window origins of MONAI's or nnU-Net's sliding window along one axis (``length > tile``).

    >>> centred_starts(100, 64, 16, Placement.CENTRED_MONAI)  # interval 48, the last one shifted back
    [0, 36]
    >>> centred_starts(110, 64, 32, Placement.CENTRED_NNUNET)  # nnU-Net's own example
    [0, 23, 46]
    >>> centred_starts(20, 13, 6, Placement.CENTRED_NNUNET)  # an odd tile: steps of 6.5 at most
    [0, 4, 7]
    """
    step = tile - overlap
    if placement is Placement.CENTRED_MONAI:  # monai.data.utils.dense_patch_slices
        n = next(d for d in range(-(-length // step)) if d * step + tile >= length) + 1
        return [i * step - max(i * step + tile - length, 0) for i in range(n)]
    # nnunetv2.inference.sliding_window_prediction.compute_steps_for_sliding_window; its default
    # tile_step_size 0.5 is overlap = tile // 2, a target step of tile / 2 (a half voxel for odd tiles)
    target = tile / 2 if overlap == tile // 2 else step
    n = math.ceil((length - tile) / target) + 1
    actual = (length - tile) / (n - 1)
    return [round(actual * i) for i in range(n)]


def _plan_centred(
    axis: int, length: int, tile: int, overlap: int, alignment: int, scale: Fraction, placement: Placement
) -> AxisPlan:
    """One axis of a centred placement (see the module docstring)."""
    if tile % alignment:
        raise GridError(f"tile_shape[{axis}]={tile} is not a multiple of alignment[{axis}]={alignment}")
    if length <= tile:
        pad_lo, extent, starts = (tile - length) // 2, tile, [0]
    else:
        if tile - overlap <= 0:
            raise GridError(
                f"overlap[{axis}]={overlap} leaves no positive stride for tile_shape[{axis}]={tile}"
            )
        pad_lo, extent, starts = 0, length, centred_starts(length, tile, overlap, placement)
    out_lo = _scaled(pad_lo, scale, "padding", axis)
    out_length = math.ceil(length * scale)
    out_tile = _scaled(tile, scale, "tile_shape", axis)
    crops, writes, windows = [], [], []
    for t in starts:
        t_out = _scaled(t, scale, "tile origin", axis)
        lo, hi = max(t_out, out_lo), min(t_out + out_tile, out_lo + out_length)
        crops.append((lo - t_out, hi - t_out))
        writes.append((lo - out_lo, hi - out_lo))
        windows.append((t_out - out_lo, t_out + out_tile - out_lo))
    blended = len(starts) > 1
    _check_cover(axis, writes, out_length, blended, f"length={length}, tile={tile}, {placement.value}")
    return AxisPlan(
        length=length,
        extent=extent,
        pad_lo=pad_lo,
        tile=tile,
        stride=max((b - a for a, b in itertools.pairwise(starts)), default=0),
        starts=tuple(starts),
        out_length=out_length,
        out_tile=out_tile,
        crops=tuple(crops),
        writes=tuple(writes),
        windows=tuple(windows),
        flat=tuple((False, False) for _ in starts),
        blended=blended,
        placement=placement,
    )


def _check_cover(axis: int, writes: Sequence[Span], out_length: int, blended: bool, what: str) -> None:
    """Every output voxel is written (exactly once when the writes must partition the output)."""
    covered = 0  # writes are sorted by start; everything below ``covered`` is written
    for lo, hi in writes:
        if lo > covered or (not blended and lo != covered):
            break
        covered = max(covered, hi)
    else:
        if covered == out_length:
            return
    raise CoverageError(  # pragma: no cover - an engine bug, never a user error
        f"axis {axis}: the plan does not cover output voxels {covered}.. exactly once "
        f"(writes {list(writes)[:8]}, out_length={out_length}, {what})"
    )

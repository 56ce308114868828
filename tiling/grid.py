"""Tile planning: pure integer arithmetic over shapes, no data and no weights.

Coordinates. Each spatial axis of length ``L`` is planned on a *virtual extent* ``E``: the image,
plus ``halo`` voxels on both sides when ``border="pad"``, rounded up to a multiple of the alignment.
Tiles are intervals ``[t, t + T)`` of that extent with ``t`` a multiple of the alignment (the
network's stride grid). The *core* of a tile is ``[t + halo, t + T - halo)``, extended to the extent
edge for the first and the last tile (nothing lies beyond, so no output is discarded there). The
last tile is shifted back to end at the extent edge, so no tail is ever dropped (cf. the
``(L - k) // s + 1`` window count, which drops it). The *region of interest* (roi) is where the real
image lies; outputs are written only there. Output coordinates are input coordinates times the
per-axis ``scale``.

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
from tiling.geometry import BlendMode, BorderMode, as_fractions, as_ints, parse_enum

__all__ = ["AxisPlan", "Tile", "TileGrid"]

Span = tuple[int, int]


@dataclass(frozen=True, eq=False)
class AxisPlan:
    """The plan of one spatial axis (integers only).

    Attributes:
        length: image length ``L`` along this axis (voxels).
        extent: virtual extent ``E`` (voxels), a multiple of the alignment.
        pad_lo: virtual index of image voxel 0 (the halo for ``border="pad"``, else 0).
        tile: tile length ``T`` actually used (``<= tile_shape``; smaller only if the image is).
        stride: distance between tile origins (voxels; 0 when there is one tile).
        starts: tile origins in virtual coordinates.
        out_length: output length ``ceil(L * scale)``.
        out_tile: ``T * scale``, the length of one predictor output along this axis.
        crops: per tile, ``(lo, hi)`` of the predictor output that is written (output voxels).
        writes: per tile, ``(lo, hi)`` in the output array (output voxels).
        windows: per tile, ``(lo, hi)`` in output-array coordinates (may reach beyond the roi) over
            which the blend window lies; written voxels outside it get weight 1.
        flat: per tile, whether the window is flat (weight 1) on its low and high side, because
            that side lies on the extent edge where no other tile contributes.
        blended: whether neighbouring writes overlap (``False``: the writes partition the output).
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
    >>> grid.axes[0].starts, grid.stride
    ((0, 24, 48, 68), (24,))
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
        axes = tuple(
            _plan_axis(axis, shape[axis], tiles[axis], halos[axis], overlaps[axis], aligns[axis],
                       scales[axis], border_mode)
            for axis in range(ndim)
        )  # fmt: skip
        return cls(shape, tiles, halos, overlaps, aligns, scales, border_mode, blend_mode, axes)

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
        """Tile shape actually fed to the predictor (smaller than asked only for small images)."""
        return tuple(a.tile for a in self.axes)

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
            f"border={self.border.value}"
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
    axis: int, extent: int, tile: int, halo: int, overlap: int, alignment: int
) -> tuple[int, int, list[int]]:
    """Return ``(used tile, stride, starts)`` for one axis (virtual coordinates)."""
    if tile >= extent:
        return extent, 0, [0]
    if tile % alignment:
        raise GridError(f"tile_shape[{axis}]={tile} is not a multiple of alignment[{axis}]={alignment}")
    core = tile - 2 * halo
    if core <= 0:
        raise GridError(
            f"halo[{axis}]={halo} leaves an empty core for tile_shape[{axis}]={tile} "
            f"(core = tile - 2 * halo = {core})"
        )
    stride = (core - overlap) // alignment * alignment
    if stride <= 0:
        raise GridError(
            f"overlap[{axis}]={overlap} leaves no positive stride for core {core} "
            f"(tile_shape[{axis}]={tile}, halo[{axis}]={halo}, alignment[{axis}]={alignment})"
        )
    n = -(-(extent - tile) // stride) + 1
    return tile, stride, [min(i * stride, extent - tile) for i in range(n)]


def _kept_regions(starts: Sequence[int], tile: int, halo: int, extent: int, blended: bool) -> list[Span]:
    """Per tile, the virtual interval whose output it contributes (before clipping to the roi)."""
    n = len(starts)
    kept: list[Span] = []
    prev_hi = 0
    for i, t in enumerate(starts):
        lo = 0 if i == 0 else t + halo
        hi = extent if i == n - 1 else t + tile - halo
        kept.append((lo if blended else max(lo, prev_hi), hi))
        prev_hi = hi
    return kept


def _plan_axis(
    axis: int,
    length: int,
    tile: int,
    halo: int,
    overlap: int,
    alignment: int,
    scale: Fraction,
    border: BorderMode,
) -> AxisPlan:
    pad_lo = halo if border is BorderMode.PAD else 0
    extent = -(-(length + 2 * pad_lo) // alignment) * alignment
    used, stride, starts = _place_tiles(axis, extent, tile, halo, overlap, alignment)
    n = len(starts)
    blended = overlap > 0 and n > 1
    kept = _kept_regions(starts, used, halo, extent, blended)

    out_lo = _scaled(pad_lo, scale, "halo", axis)
    out_length = math.ceil(length * scale)
    out_tile = _scaled(used, scale, "tile_shape", axis)
    out_halo = _scaled(halo, scale, "halo", axis)
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
        # The window spans the nominal core [t + halo, t + T - halo); a core extended to the
        # extent edge gets weight 1 there (no other tile covers it).
        windows.append((t_out + out_halo - out_lo, t_out + out_tile - out_halo - out_lo))
        flat.append((i == 0, i == n - 1))
    _check_cover(axis, writes, out_length, blended, f"length={length}, tile={used}, halo={halo}")
    return AxisPlan(
        length=length,
        extent=extent,
        pad_lo=pad_lo,
        tile=used,
        stride=stride,
        starts=tuple(kept_starts),
        out_length=out_length,
        out_tile=out_tile,
        crops=tuple(crops),
        writes=tuple(writes),
        windows=tuple(windows),
        flat=tuple(flat),
        blended=blended,
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

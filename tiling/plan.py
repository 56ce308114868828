"""Halo caps and alignment rules: pure integer arithmetic over per-axis tuples (voxels).

A worked 1-D example (alignment 32, tile 256, receptive-field radius 188)::

    image 300 ──► aligned extent 320 (round_up(300, 32)): more than one tile of 256
    calibrated halo 140 ──► cap_halo: min(140, radius 188, (256 - 32) // 2 = 112) = 112
                            core = 256 - 2 * 112 = 32 >= one alignment step, so the grid has a stride

Used by :mod:`models` to turn a requested or calibrated halo into one that ``TileGrid.plan`` accepts.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "aligned_extent",
    "calibration_margin",
    "cap_halo",
    "context_halo",
    "fits_one_tile",
    "per_axis",
    "round_up",
]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``.

    >>> round_up(300, 32), round_up(320, 32)
    (320, 320)
    """
    return -(-int(value) // int(multiple)) * int(multiple)


def per_axis(alignment: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """``alignment`` as one int per axis (one int broadcast; a sequence of ``ndim`` ints kept).

    >>> per_axis(8, 3), per_axis((2, 8, 8), 3)
    ((8, 8, 8), (2, 8, 8))
    """
    if isinstance(alignment, Sequence):
        if len(alignment) != ndim:
            raise ValueError(f"alignment {tuple(alignment)} for {ndim} axes")
        return tuple(int(a) for a in alignment)
    return (int(alignment),) * ndim


def aligned_extent(spatial_shape: Sequence[int], alignment: int | Sequence[int]) -> tuple[int, ...]:
    """Each axis rounded up to the alignment (one, or one per axis): what a whole-image pass (and
    the grid) covers.

    >>> aligned_extent((90, 300), 32), aligned_extent((90, 300), (2, 32))
    ((96, 320), (90, 320))
    """
    aligns = per_axis(alignment, len(spatial_shape))
    return tuple(round_up(s, a) for s, a in zip(spatial_shape, aligns, strict=True))


def fits_one_tile(
    spatial_shape: Sequence[int], tile_shape: Sequence[int], alignment: int | Sequence[int]
) -> bool:
    """Whether one tile covers the aligned image (then no seam exists and no halo is needed).

    >>> fits_one_tile((90, 300), (256, 256), 32), fits_one_tile((90, 250), (256, 256), 32)
    (False, True)
    """
    extent = aligned_extent(spatial_shape, alignment)
    return all(e <= t for e, t in zip(extent, tile_shape, strict=True))


def cap_halo(
    halo: Sequence[int], radius: Sequence[int], tile_shape: Sequence[int], alignment: int | Sequence[int]
) -> tuple[int, ...]:
    """Per axis ``min(halo, radius, (tile - alignment) // 2)``, never below 0.

    A halo beyond the receptive-field radius buys nothing, and the core ``tile - 2 * halo`` must
    keep at least one alignment step so that tiles can advance.

    >>> cap_halo((140, 140), (188, 20), (256, 256), 32)
    (112, 20)
    """
    aligns = per_axis(alignment, len(tile_shape))
    return tuple(
        max(0, min(int(h), int(r), (int(t) - a) // 2))
        for h, r, t, a in zip(halo, radius, tile_shape, aligns, strict=True)
    )


def calibration_margin(radius: Sequence[int], tile_shape: Sequence[int]) -> int:
    """Largest halo worth calibrating: the largest radius, at most half the smallest tile minus one.

    >>> calibration_margin((188, 188), (256, 1024))
    127
    """
    return max(0, min(max(int(r) for r in radius), min(int(t) for t in tile_shape) // 2 - 1))


def context_halo(halo: Sequence[int], radius: Sequence[int], tile_shape: Sequence[int]) -> tuple[int, ...]:
    """Per axis ``max(halo, min(radius, tile // 2 - 1))``: the halo of whole-image statistics passes.

    >>> context_halo((8, 8), (188, 4), (256, 256))
    (127, 8)
    """
    return tuple(
        max(int(h), min(int(r), int(t) // 2 - 1)) for h, r, t in zip(halo, radius, tile_shape, strict=True)
    )

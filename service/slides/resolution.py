"""Resolution: the pyramid level a slide is read at and its resampling (issue 21 item 2).

Shapes: ``(H, W)`` at the resolution read.

:func:`choose_resolution`: the spec's ``mpp`` (microns per pixel the network was trained at) or
the request's ``mpp`` picks the nearest level at or finer than the target, resampled per region to
it (bilinear on pixel centres: output pixel ``i`` samples the level at ``(i + 0.5) * f - 0.5``,
``f = target / level mpp``, the same value whichever region asks, so tiled reads equal one whole
read; ``f = 2`` is the 2x2 box mean; :class:`service.slides.SlideRegions` reads it); ``level``
reads a level as it is. A target finer than half the slide's level-0 mpp (:data:`MIN_MPP_RATIO`)
is refused (422), so the read shape is at most twice level 0 per side; the output's disk estimate
is of that shape. A slide whose mpp is missing or implausible (outside
:data:`service.slides.MPP_RANGE`) is never guessed: a model with an ``mpp`` then needs
``level=N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.errors import UnusableInputError
from service.slides.readers import SlideInfo

__all__ = ["MIN_MPP_RATIO", "MPP_SAME", "Resolution", "choose_resolution"]

#: A level whose mpp is within this relative difference of the target is read as it is.
MPP_SAME = 0.01
#: The finest target mpp a slide is read at, as a share of its level-0 mpp (an upsampling by 2
#: at most: a target of 1e-6 um/px would make a slide of 1e10 x 1e10 pixels).
MIN_MPP_RATIO = 0.5


@dataclass(frozen=True)
class Resolution:
    """Where a slide is read: ``level``, resampled by ``factor`` (target mpp / level mpp; 1: as it
    is), giving ``shape`` ``(H, W)`` at ``mpp`` microns per pixel (``None`` when unknown)."""

    level: int
    factor: float
    shape: tuple[int, int]
    mpp: float | None
    note: str | None = None


def choose_resolution(info: SlideInfo, spec_mpp: float | None, mpp: Any, level: int | None) -> Resolution:
    """The level and resampling of a request (see the module docstring).

    Args:
        info: the slide.
        spec_mpp: the model's trained mpp (the spec's ``mpp``), or ``None``.
        mpp: the request's ``mpp``: ``None`` or ``"model"`` (the spec's), or a number.
        level: the request's ``level`` (excludes ``mpp``).

    Raises:
        UnusableInputError: a level the slide lacks; a target mpp on a slide without a plausible
            one (the message says to give ``level``); a target finer than :data:`MIN_MPP_RATIO`
            times the slide's level-0 mpp (the read shape is thus at most twice level 0 per side).
    """
    if level is not None:
        if not 0 <= level < len(info.levels):
            raise UnusableInputError(f"level={level}: the slide has levels 0-{len(info.levels) - 1}")
        w, h, d = info.levels[level]
        return Resolution(level, 1.0, (h, w), None if info.mpp is None else info.mpp * d)
    target = spec_mpp if mpp is None or str(mpp) == "model" else float(mpp)
    w0, h0, _ = info.levels[0]
    if target is None:
        return Resolution(0, 1.0, (h0, w0), info.mpp, info.mpp_note)
    if info.mpp is None:
        why = "the model's" if mpp is None or str(mpp) == "model" else "the requested"
        raise UnusableInputError(
            f"{info.mpp_note}; {why} mpp {target:g} um/px cannot be matched without guessing: give level=N "
            f"(levels: {', '.join(f'{k}: {w}x{h}' for k, (w, h, _) in enumerate(info.levels))})"
        )
    if not math.isfinite(target) or target < info.mpp * MIN_MPP_RATIO:
        why = "the model's" if mpp is None or str(mpp) == "model" else "the requested"
        raise UnusableInputError(
            f"{why} mpp {target:g} um/px is finer than this slide holds: level 0 is {info.mpp:g} um/px, "
            f"and a slide is upsampled at most {1 / MIN_MPP_RATIO:g}x (mpp >= {info.mpp * MIN_MPP_RATIO:g}); "
            "ask for a coarser mpp or a level"
        )
    fine = [k for k, (_, _, d) in enumerate(info.levels) if info.mpp * d <= target * (1 + MPP_SAME)]
    k = max(fine, key=lambda j: info.levels[j][2]) if fine else 0
    w, h, d = info.levels[k]
    factor = target / (info.mpp * d)
    if abs(factor - 1) <= MPP_SAME:
        return Resolution(k, 1.0, (h, w), info.mpp * d)
    shape = (max(1, round(h / factor)), max(1, round(w / factor)))
    return Resolution(k, factor, shape, target)

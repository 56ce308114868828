"""Per-axis parameters: broadcasting of ints and tuples, and their validation.

Every spatial parameter of :func:`tiling.tiled_inference` is either one value for all spatial axes
or a tuple with one value per axis, in array-axis order.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from fractions import Fraction

from tiling.errors import GridError

__all__ = ["BlendMode", "BorderMode", "PaddingMode", "Placement", "as_fractions", "as_ints", "parse_enum"]


class BlendMode(str, enum.Enum):
    """Blend window applied to each tile's core before overlap-add."""

    CONSTANT = "constant"
    GAUSSIAN = "gaussian"
    HANN = "hann"
    TRIANGULAR = "triangular"


class BorderMode(str, enum.Enum):
    """What a tile sees beyond the image edge.

    ``clip``: tiles stop at the edge; the network pads as it would on the whole image.
    ``pad``: the image is padded by the halo (``padding_mode``) so every voxel has full context.
    """

    CLIP = "clip"
    PAD = "pad"


class Placement(str, enum.Enum):
    """Where tiles lie on the image, and where an image smaller than a tile lies inside it.

    ``end``: tilewise's own grid (:mod:`tiling.grid`): the image at the tile origin, rounded up to the
    alignment at its end, tiles on the alignment grid. ``centred-monai``: MONAI's
    ``sliding_window_inference`` (monai 1.6 ``monai/inferers/utils.py``): an axis shorter than the
    tile is zero-padded to it, ``(T - L) // 2`` before and the rest after; a longer one gets windows
    ``0, s, 2s, ...`` (``s = T - overlap``), the last one shifted back to end at the image edge
    (``dense_patch_slices``). ``centred-nnunet``: nnU-Net v2's predictor: the same padding
    (``pad_nd_image``), windows spread evenly, ``round(i * (L - T) / (n - 1))`` with
    ``n = ceil((L - T) / (T - overlap)) + 1`` (``compute_steps_for_sliding_window``; ``overlap =
    T // 2`` is its ``tile_step_size=0.5``, a target step of ``T / 2`` also for odd ``T``). With either
    centred placement every window's whole output is blended (``constant``: their mean;
    ``gaussian``: sigma ``T / 8`` centred as the framework centres it), and an axis longer than the
    tile with a halo keeps the ``end`` placement (exact tiles of a local network).
    """

    END = "end"
    CENTRED_MONAI = "centred-monai"
    CENTRED_NNUNET = "centred-nnunet"


class PaddingMode(str, enum.Enum):
    """Padding for ``border="pad"`` and for rounding up to the alignment (numpy ``np.pad`` names)."""

    CONSTANT = "constant"
    REFLECT = "reflect"
    REPLICATE = "replicate"


def parse_enum(kind: type[enum.Enum], value: object, name: str) -> enum.Enum:
    """Return ``kind(value)`` or raise :class:`GridError` listing the allowed values."""
    try:
        return kind(value)
    except ValueError:
        allowed = [m.value for m in kind]
        raise GridError(f"{name}={value!r} is not one of {allowed}") from None


def as_ints(value: int | Sequence[int], ndim: int, name: str, *, minimum: int) -> tuple[int, ...]:
    """Broadcast ``value`` to ``ndim`` ints and check each is ``>= minimum``.

    Raises:
        GridError: wrong number of axes, a non-integer, or a value below ``minimum``.
    """
    values = _broadcast(value, ndim, name)
    out = []
    for axis, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) and not hasattr(v, "__index__"):
            raise GridError(f"{name}[{axis}]={v!r} must be an integer (voxels)")
        v = int(v)
        if v < minimum:
            raise GridError(f"{name}[{axis}]={v} must be >= {minimum}")
        out.append(v)
    return tuple(out)


def as_fractions(
    value: float | Fraction | Sequence[float | Fraction], ndim: int, name: str
) -> tuple[Fraction, ...]:
    """Broadcast a positive scale factor to ``ndim`` exact fractions (``0.25`` -> ``1/4``).

    Raises:
        GridError: wrong number of axes or a non-positive value.
    """
    values = _broadcast(value, ndim, name)
    out = []
    for axis, v in enumerate(values):
        if not isinstance(v, (int, float, Fraction)):
            raise GridError(f"{name}[{axis}]={v!r} must be a number")
        f = Fraction(v).limit_denominator(1024)
        if f <= 0:
            raise GridError(f"{name}[{axis}]={v} must be > 0")
        out.append(f)
    return tuple(out)


def _broadcast(value: object, ndim: int, name: str) -> tuple[object, ...]:
    if isinstance(value, (str, bytes)):
        raise GridError(f"{name}={value!r} must be a number or a tuple of {ndim} numbers")
    if isinstance(value, Sequence):
        if len(value) != ndim:
            raise GridError(
                f"{name}={tuple(value)} has {len(value)} axes but the input has {ndim} spatial axes"
            )
        return tuple(value)
    return (value,) * ndim

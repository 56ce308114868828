"""Tile-dependence probe: does a tile's output change with input far outside the receptive field?

Shapes: ``B`` batch, ``C_in`` / ``C_out`` channels, ``T`` the tile's spatial shape.

A *local* network (convolutions, eval-mode batch norm, any dilation) computes each output voxel from
the input within its receptive-field radius ``r``: tiles with a halo ``>= r`` reproduce whole-image
inference. A *tile-dependent* one (instance norm, attention, global pooling, train-mode batch norm)
also uses statistics of the whole tile, so no halo does (DESIGN.md, "tile-dependent networks").

The probe runs one random tile ``x`` and a copy ``x'`` whose voxels farther than ``r`` (per axis,
Chebyshev) from a central box are scaled and shifted (``3 x + 2``), and compares the outputs on the
central box. A local network gives the same outputs up to float rounding (usually bit-identical);
a tile-dependent one changes them by a sizeable fraction of their magnitude.

Where ``r`` comes from, in order: the ``radius`` argument (e.g. the spec's ``receptive_field``);
else the impulse probe :func:`models.measure.receptive.probe_receptive_field` run on a random input of the
tile's shape, when it is *bounded* (no change reached the tile's edge); else (the changes reached the
edge: a global operation, or a receptive field wider than half the tile) ``r = T // 4`` is assumed.
With the assumed radius a local network whose influence at ``T / 4`` voxels still exceeds the
tolerance is reported tile-dependent: at this tile shape no halo inside the tile could make it
exact, which is what the verdict is for. :attr:`TileDependence.radius_source` says which case held.

Cost: two forward passes at batch 1 (``x`` and ``x'``, in separate calls so that batch statistics
cannot hide the change), plus the impulse probe's calls (two at batch 3 with ``alignment`` 1) when
the radius is measured.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from models.errors import InputError
from models.measure.receptive import probe_receptive_field

__all__ = ["DEFAULT_TOLERANCE", "ProbeError", "TileDependence", "probe_tile_dependence"]

logger = logging.getLogger(__name__)

#: Default tolerance on the relative change of the central outputs (float32 rounding is ~1e-7).
DEFAULT_TOLERANCE = 1e-4


class ProbeError(InputError):
    """The probe cannot run: a tile too small for the radius, or a predictor output of the wrong shape."""


@dataclass(frozen=True, slots=True)
class TileDependence:
    """Verdict of :func:`probe_tile_dependence`.

    Attributes:
        tile_dependent: ``relative_change > tolerance``.
        max_change: max abs change of the central outputs (output units).
        relative_change: ``max_change`` divided by the max abs central output of the unchanged tile.
        tolerance: the threshold on ``relative_change``.
        radius: receptive-field radius used per axis (voxels).
        radius_source: ``"given"``, ``"measured"`` (impulse probe) or ``"assumed"`` (``T // 4``).
        tile_shape: ``T``.
        central_box: per axis ``(start, stop)`` of the compared outputs (voxels).
        n_far: number of input voxels changed (per channel).
        n_calls: predictor calls made (the impulse probe's included).
        seconds: wall time.
    """

    tile_dependent: bool
    max_change: float
    relative_change: float
    tolerance: float
    radius: tuple[int, ...]
    radius_source: str
    tile_shape: tuple[int, ...]
    central_box: tuple[tuple[int, int], ...]
    n_far: int
    n_calls: int
    seconds: float


class _Counted:
    """A predictor with the metadata :func:`probe_receptive_field` reads, counting calls."""

    def __init__(
        self,
        predictor: Callable[[torch.Tensor], torch.Tensor],
        spatial_dims: int,
        in_channels: int,
        alignment: int,
    ) -> None:
        self.predictor = predictor
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.alignment = alignment
        self.scale = 1
        self.calls = 0

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.predictor(batch)


def _central_box(tile: tuple[int, ...], radius: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Per axis, a centred box of ``max(1, (T - 2 r) // 2)`` voxels."""
    box = []
    for t, r in zip(tile, radius, strict=True):
        size = max(1, (t - 2 * r) // 2)
        start = (t - size) // 2
        box.append((start, start + size))
    return tuple(box)


def _far_mask(
    tile: tuple[int, ...], radius: tuple[int, ...], box: tuple[tuple[int, int], ...]
) -> npt.NDArray[np.bool_]:
    """Voxels farther than ``radius`` from ``box`` along at least one axis."""
    far = np.zeros(tile, dtype=bool)
    for axis, (t, r, (lo, hi)) in enumerate(zip(tile, radius, box, strict=True)):
        idx = np.arange(t)
        outside = (idx < lo - r) | (idx >= hi + r)
        far |= outside.reshape([-1 if a == axis else 1 for a in range(len(tile))])
    return far


def _forward(
    predictor: _Counted, x: npt.NDArray[np.float32], device: torch.device | None, tile: tuple[int, ...]
) -> npt.NDArray[np.float32]:
    with torch.inference_mode():
        batch = torch.from_numpy(x[None])
        y = predictor(batch.to(device) if device is not None else batch)
    if y.ndim != len(tile) + 2 or y.shape[0] != 1 or tuple(y.shape[2:]) != tile:
        raise ProbeError(
            f"predictor returned shape {tuple(y.shape)} for input {tuple(batch.shape)}; "
            f"expected (1, C_out, *{tile})"
        )
    out: npt.NDArray[np.float32] = y.detach().float().cpu().numpy()[0]
    return out


def probe_tile_dependence(
    predictor: Callable[[torch.Tensor], torch.Tensor],
    *,
    spatial_dims: int,
    in_channels: int,
    tile_shape: int | Sequence[int],
    radius: int | Sequence[int] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    alignment: int = 1,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> TileDependence:
    """Decide whether ``predictor`` is tile-dependent at ``tile_shape``.

    Args:
        predictor: maps ``(B, C_in, *T)`` float32 to ``(B, C_out, *T)`` (any backend; modules in
            eval mode).
        spatial_dims: number of spatial axes (1 to 3).
        in_channels: ``C_in``.
        tile_shape: ``T`` (voxels; an int is broadcast), as the network will see it (multiples of
            ``alignment``).
        radius: receptive-field radius per axis (voxels), e.g. the spec's; ``None`` measures it
            with the impulse probe, or assumes ``T // 4`` (module docstring).
        tolerance: largest relative change of the central outputs still called local.
        alignment: the network's total stride (phases of the impulse probe).
        device: where the predictor's inputs go (``None``: CPU tensors).
        seed: seed of the random tile (standard normal).

    Returns:
        The :class:`TileDependence`.

    Raises:
        ProbeError: ``tile_shape`` or ``radius`` has the wrong length or a negative or zero value,
            no voxel lies farther than ``radius`` from the central box (``T <= 2 r + 1`` on every
            axis), or the predictor's output is not ``(1, C_out, *T)``.

    Notes:
        Memory: two tiles of input and output on the host, ``8 * (C_in + C_out) * prod(T)`` bytes,
        plus what the predictor needs for batch 1 (batch 3 for the impulse probe).

    Source:
        none (original). The impulse probe: :mod:`models.measure.receptive`.
    """
    start = time.perf_counter()
    if spatial_dims not in (1, 2, 3):
        raise ProbeError(f"spatial_dims={spatial_dims}: expected 1, 2 or 3")
    tile = (
        (int(tile_shape),) * spatial_dims
        if isinstance(tile_shape, int)
        else tuple(int(t) for t in tile_shape)
    )
    if len(tile) != spatial_dims or any(t < 1 for t in tile):
        raise ProbeError(f"tile_shape={tile}: expected {spatial_dims} positive sizes")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ProbeError(f"tolerance={tolerance}: expected a finite number >= 0")
    dev = torch.device(device) if device is not None else None
    counted = _Counted(predictor, spatial_dims, in_channels, max(1, int(alignment)))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((in_channels, *tile)).astype(np.float32)

    source = "given"
    if radius is None:
        field = probe_receptive_field(counted, base=x[None], seed=seed, quiet=True)
        if field.bounded:
            r, source = field.radius, "measured"
        else:
            r, source = tuple(t // 4 for t in tile), "assumed"
    else:
        r = (int(radius),) * spatial_dims if isinstance(radius, int) else tuple(int(v) for v in radius)
    if len(r) != spatial_dims or any(v < 0 for v in r):
        raise ProbeError(f"radius={r}: expected {spatial_dims} sizes >= 0")

    box = _central_box(tile, r)
    far = _far_mask(tile, r, box)
    n_far = int(far.sum())
    if n_far == 0:
        raise ProbeError(
            f"tile_shape={tile} has no voxel farther than radius={r} from its centre "
            f"(needs tile > 2 * radius + 1 on some axis); probe with a larger tile"
        )
    x_far = x.copy()
    x_far[:, far] = 3.0 * x[:, far] + 2.0

    y = _forward(counted, x, dev, tile)
    y_far = _forward(counted, x_far, dev, tile)
    centre = (slice(None), *(slice(lo, hi) for lo, hi in box))
    ref, got = y[centre].astype(np.float64), y_far[centre].astype(np.float64)
    max_change = float(np.abs(got - ref).max())
    scale = float(np.abs(ref).max())
    relative = max_change / scale if scale > 0 else (math.inf if max_change > 0 else 0.0)
    result = TileDependence(
        tile_dependent=bool(relative > tolerance),
        max_change=max_change,
        relative_change=relative,
        tolerance=tolerance,
        radius=tuple(r),
        radius_source=source,
        tile_shape=tile,
        central_box=box,
        n_far=n_far,
        n_calls=counted.calls,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "tile dependence at %s: %s (relative change %.3g, tolerance %g, radius %s %s, %d calls, %.2f s)",
        tile,
        result.tile_dependent,
        relative,
        tolerance,
        result.radius,
        source,
        result.n_calls,
        result.seconds,
    )
    return result

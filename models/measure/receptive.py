"""Receptive field, measured: the impulse probe and the calibrated halo.

- :func:`probe_receptive_field` (theoretical radius): perturb single input voxels of a random
  input and find which outputs change. Exact for conv stacks (zero padding, any dilation or
  stride) when the probe input is larger than twice the radius; probes several phases modulo the
  alignment, because a strided network's reach depends on the phase.
- :func:`calibrate_halo`: run tiles with their full halo and, around each, a much larger context;
  the error of a halo ``h`` is the max abs difference on the part of the tile at least ``h`` voxels
  from its edges. One forward pass per tile gives the error for every ``h``; the smallest ``h``
  within the tolerance is the calibrated halo.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "HaloCalibration",
    "ROUNDING_ULPS",
    "ReceptiveField",
    "calibrate_halo",
    "probe_input",
    "probe_receptive_field",
]

logger = logging.getLogger(__name__)

_DEFAULT_PROBE = {1: 1024, 2: 128, 3: 40}
#: Units in the last place (float32) of the output's largest value that count as rounding
#: (:attr:`HaloCalibration.floor`).
ROUNDING_ULPS = 4


@dataclass(frozen=True, slots=True)
class ReceptiveField:
    """Result of the impulse probe.

    Attributes:
        radius: per axis, the farthest distance (input voxels) at which a perturbation changed an
            output.
        probe_shape: spatial shape of the probe input.
        bounded: ``False`` when a change reached the probe's edge (``radius`` is a lower bound).
        seconds: wall time of the probe.
    """

    radius: tuple[int, ...]
    probe_shape: tuple[int, ...]
    bounded: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class HaloCalibration:
    """Result of :func:`calibrate_halo`: the chosen ``halo``, its ``error`` and the error per halo.

    ``sample`` says what the halo was calibrated on (``"synthetic sample"``, or ``"sample
    <shape>-<fingerprint>"`` when :meth:`models.Model.calibrate` got real data). ``floor`` is
    float32 rounding at this output's scale (:data:`ROUNDING_ULPS` units in the last place of its
    largest absolute value): a tile and the whole pass add in another order, so errors up to it
    are the arithmetic's, whatever the halo (the benchmarks' U-Net, outputs up to about 2: 1.5e-8
    to 4.5e-8 at halos beyond its radius).
    """

    halo: int
    error: float
    tolerance: float
    errors: dict[int, float]
    met: bool
    seconds: float
    sample: str = "synthetic sample"
    floor: float = 0.0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _run(predictor: Callable[[torch.Tensor], torch.Tensor], x: npt.NDArray[np.float32], batch: int) -> Any:
    outs = []
    for i in range(0, x.shape[0], batch):
        with torch.inference_mode():
            y = predictor(torch.from_numpy(np.ascontiguousarray(x[i : i + batch])))
        outs.append(np.asarray(y.detach().cpu().float().numpy()))
    return np.concatenate(outs)


def probe_input(predictor: Any, shape: Sequence[int], seed: int = 0) -> npt.NDArray[np.float32]:
    """The random probe input ``(1, C_in, *shape)`` (standard normal, seeded)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, int(predictor.in_channels), *shape)).astype(np.float32)


def probe_receptive_field(
    predictor: Any,
    *,
    probe_shape: int | Sequence[int] | None = None,
    phases: Sequence[int] | None = None,
    delta: float = 1.0,
    atol: float = 0.0,
    batch_size: int = 3,
    seed: int = 0,
    base: npt.NDArray[np.float32] | None = None,
    quiet: bool = False,
) -> ReceptiveField:
    """Measure the receptive-field radius per axis with single-voxel perturbations.

    Args:
        predictor: a :class:`~models.Predictor` (``spatial_dims``, ``in_channels``, ``alignment``
            and ``scale`` are read from it).
        probe_shape: spatial shape of the random probe input (rounded up to the alignment);
            default 1024 / 128 / 40 voxels for 1-D / 2-D / 3-D. It must exceed twice the radius
            for an exact answer; otherwise ``bounded`` is ``False``.
        phases: offsets (added on every axis) of the perturbed voxels from an aligned centre;
            default ``{0, 1, alignment // 2, alignment - 1}``.
        delta: perturbation added to every channel of the voxel.
        atol: an output counts as changed when it moves by more than this.
        batch_size: inputs per predictor call (the unperturbed one included).
        seed: seed of the random probe input.
        base: the probe input ``(1, C_in, *probe_shape)`` itself, instead of a random one.
        quiet: log at DEBUG only (for callers that probe repeatedly).

    Returns:
        The measured :class:`ReceptiveField`.
    """
    start = time.perf_counter()
    ndim = int(predictor.spatial_dims)
    align = int(getattr(predictor, "alignment", 1))
    scale = int(getattr(predictor, "scale", 1))
    if probe_shape is None:
        probe_shape = _DEFAULT_PROBE[ndim]
    shape = tuple(probe_shape) if isinstance(probe_shape, Sequence) else (int(probe_shape),) * ndim
    shape = tuple(_round_up(int(s), align) for s in shape)
    offsets = sorted({p % align for p in (phases if phases is not None else (0, 1, align // 2, align - 1))})
    if base is None:
        base = probe_input(predictor, shape, seed)
    shape = tuple(base.shape[2:])
    centre = [s // 2 // align * align for s in shape]
    points = [tuple(c + k for c in centre) for k in offsets]
    radius = [0] * ndim
    bounded = True
    per_call = max(1, batch_size - 1)
    for first in range(0, len(points), per_call):
        chunk = points[first : first + per_call]
        # The unperturbed input rides in every call: batch composition can change the conv
        # algorithm, hence the rounding, so comparisons stay within one call.
        batch = np.repeat(base, len(chunk) + 1, axis=0)
        for i, p in enumerate(chunk, start=1):
            where: tuple[Any, ...] = (i, slice(None), *p)
            batch[where] += delta
        out = _run(predictor, batch, len(chunk) + 1)
        for i, p in enumerate(chunk, start=1):
            changed = np.abs(out[i] - out[0]).max(axis=0) > atol
            idx = np.argwhere(changed)
            if idx.size == 0:
                continue
            for a in range(ndim):
                lo = int(idx[:, a].min()) // scale
                hi = int(idx[:, a].max()) // scale
                radius[a] = max(radius[a], p[a] - lo, hi - p[a])
                if lo == 0 or hi >= shape[a] - 1:
                    bounded = False
    result = ReceptiveField(tuple(radius), shape, bounded, time.perf_counter() - start)
    level = logging.DEBUG if quiet else logging.INFO
    if not bounded:
        logger.log(
            level, "receptive-field probe reached the edge of %s: radius %s is a lower bound", shape, radius
        )
    logger.log(level, "receptive field radius %s (probe %s, %.2f s)", result.radius, shape, result.seconds)
    return result


def _synthetic_sample(shape: tuple[int, ...], channels: int, seed: int) -> npt.NDArray[np.float32]:
    """Smooth random structure plus noise, in roughly unit range: a stand-in for real data."""
    rng = np.random.default_rng(seed)
    coarse = rng.standard_normal((channels, *[max(2, s // 8) for s in shape])).astype(np.float32)
    x = torch.nn.functional.interpolate(
        torch.from_numpy(coarse)[None],
        size=shape,
        mode="linear" if len(shape) == 1 else ("bilinear" if len(shape) == 2 else "trilinear"),
        align_corners=False,
    )[0].numpy()
    noisy: npt.NDArray[np.float32] = (x + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
    return noisy


def calibrate_halo(
    predictor: Any,
    tile_shape: Sequence[int],
    *,
    tolerance: float = 1e-4,
    sample: npt.NDArray[np.float32] | None = None,
    max_halo: int | None = None,
    n_tiles: int = 2,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    seed: int = 0,
) -> HaloCalibration:
    """The smallest halo whose truncation error on a tile's core is within ``tolerance``.

    The whole sample runs once (it is the context: pass one about ``tile + 2 * max_halo`` per
    axis; larger costs more); tiles of ``tile_shape`` placed in it (the centre first, then at
    random aligned origins) run alone. For every candidate ``h`` the error is the max abs
    difference on ``tile[h : T - h]`` (all axes).

    Args:
        predictor: a :class:`~models.Predictor`.
        tile_shape: the tile shape (voxels per axis, multiples of the alignment).
        tolerance: accepted max abs truncation error (after ``activation``).
        sample: preprocessed ``(C_in, *spatial)`` float32 data, at least ``tile_shape``; default a
            synthetic sample of ``tile + 2 * max_halo`` (rounded up to the alignment).
        max_halo: largest halo considered and the context margin (default: half the smallest
            tile side, minus one).
        n_tiles: tile placements sampled.
        activation: applied to outputs before comparing (e.g. sigmoid).
        seed: seed for the synthetic sample and the placements.

    Returns:
        The :class:`HaloCalibration`; ``met`` is ``False`` (and ``halo`` the largest candidate) when
        no candidate is within the tolerance.
    """
    start = time.perf_counter()
    tile = tuple(int(t) for t in tile_shape)
    ndim = len(tile)
    align = int(getattr(predictor, "alignment", 1))
    scale = int(getattr(predictor, "scale", 1))
    limit = min(tile) // 2 - 1
    margin = limit if max_halo is None else max(0, min(int(max_halo), limit))
    margin_al = _round_up(margin, align)
    synthetic = sample is None
    if sample is None:
        sample = _synthetic_sample(tuple(t + 2 * margin_al for t in tile), int(predictor.in_channels), seed)
    spatial = tuple(_round_up(s, align) for s in sample.shape[1:])
    padded = _window(sample, [0] * ndim, spatial)
    ref_all = _run(predictor, padded[None], 1)[0]  # the sample is the context of every tile
    if activation is not None:
        ref_all = activation(torch.from_numpy(ref_all)).numpy()
    rng = np.random.default_rng(seed)
    errors = np.zeros(margin + 1)
    for k in range(n_tiles):
        origin = []
        for a in range(ndim):
            free = max(0, spatial[a] - tile[a])
            # first the centre (context on every side), then random aligned placements
            pick = free // 2 if k == 0 else int(rng.integers(0, free + 1))
            origin.append(pick // align * align)
        alone = _window(padded, origin, [o + t for o, t in zip(origin, tile, strict=True)])
        got = _run(predictor, alone[None], 1)[0]
        if activation is not None:
            got = activation(torch.from_numpy(got)).numpy()
        inner = tuple(slice(o * scale, (o + t) * scale) for o, t in zip(origin, tile, strict=True))
        ref = ref_all
        diff = np.abs(got - ref[(slice(None), *inner)]).max(axis=0)
        # distance (input voxels) of every output voxel to the nearest tile edge
        dist = np.full(diff.shape, np.iinfo(np.int64).max, dtype=np.int64)
        for a, t in enumerate(tile):
            idx = np.arange(t * scale) // scale
            d = np.minimum(idx, t - 1 - idx).reshape([-1 if b == a else 1 for b in range(ndim)])
            dist = np.minimum(dist, d)
        by_distance = np.zeros(margin + 1)
        np.maximum.at(by_distance, np.minimum(dist, margin).ravel(), diff.ravel())
        # error of halo h: max over voxels at distance >= h
        errors = np.maximum(errors, np.maximum.accumulate(by_distance[::-1])[::-1])
    ok = np.flatnonzero(errors <= tolerance)
    met = ok.size > 0
    halo = int(ok[0]) if met else margin
    result = HaloCalibration(
        halo,
        float(errors[halo]),
        tolerance,
        {h: float(e) for h, e in enumerate(errors)},
        met,
        time.perf_counter() - start,
        "synthetic sample" if synthetic else "given sample",
        ROUNDING_ULPS * float(np.finfo(np.float32).eps) * float(np.abs(ref_all).max(initial=0.0)),
    )
    if not met:
        logger.warning("no halo up to %d meets tolerance %g (error %g)", margin, tolerance, errors[halo])
    logger.info(
        "calibrated halo %d (error %.3g <= %g: %s, %.2f s)",
        halo,
        errors[halo],
        tolerance,
        met,
        result.seconds,
    )
    return result


def _window(x: npt.NDArray[np.float32], lo: Sequence[int], hi: Sequence[int]) -> npt.NDArray[np.float32]:
    """``x[:, lo:hi]`` with zero padding where ``hi`` exceeds the array (alignment rounding)."""
    region = x[(slice(None), *(slice(a, b) for a, b in zip(lo, hi, strict=False)))]
    want = [b - a for a, b in zip(lo, hi, strict=False)]
    if list(region.shape[1:]) == want:
        return np.ascontiguousarray(region, dtype=np.float32)
    out = np.zeros((x.shape[0], *want), dtype=np.float32)
    out[(slice(None), *(slice(0, s) for s in region.shape[1:]))] = region
    return out

"""A model's receptive field (probed once) and its calibrated halos (cached per tile and sample).

:class:`HaloCalibrator` owns both caches of one loaded model; :class:`~models.Model` asks it for the
radius and for ``halo="auto"``. The arithmetic of caps and alignment is :mod:`tiling.plan`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from models.backends import BasePredictor, PoolingContext
from models.errors import InputError
from models.measure.receptive import (
    HaloCalibration,
    ReceptiveField,
    calibrate_halo,
    probe_input,
    probe_receptive_field,
)
from models.planning.planner import HaloRule, auto_halo_rule
from models.spec import ModelSpec
from models.transforms.preprocess import make_reduce
from tiling.plan import calibration_margin, fits_one_tile, round_up

__all__ = ["AutoHalo", "HaloCalibrator", "sample_fingerprint"]

logger = logging.getLogger(__name__)

#: First probe size per spatial_dims, and the largest when the field keeps reaching the edge.
_FIRST_PROBE = {1: 1024, 2: 128, 3: 40}
_MAX_PROBE = {1: 8192, 2: 1024, 3: 96}
#: Calibrated halos kept per model (one per tile, tolerance and sample fingerprint), LRU.
_HALO_CACHE_SIZE = 64
#: Points per axis of the strided subsample that a sample's fingerprint hashes.
_FINGERPRINT_POINTS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class AutoHalo:
    """``halo="auto"`` for one tile: the halo wanted, the radius, what it came from, and the
    calibration's verdict (``None`` when nothing was calibrated: one tile, or a dry run)."""

    want: tuple[int, ...]
    radius: tuple[int, ...]
    source: str
    calibration: HaloCalibration | None = None

    def halo_no_worse_than(self, other: AutoHalo) -> tuple[int, ...] | None:
        """The halo this tile gets when it replaces ``other``'s tile (a tile grown for the halo),
        or ``None`` when it errs more at every halo.

        When ``other`` met the tolerance, this tile's calibrated halo if it meets it too. When
        neither could (a tolerance below what any halo reaches), the smallest halo of this tile
        whose error is within ``other``'s, or within float32 rounding
        (:attr:`~models.measure.receptive.HaloCalibration.floor`): comparing two errors at the rounding
        level compares noise (the benchmarks' U-Net at 1e-12: 1.5e-8 on 96^3 tiles, 4.5e-8 on a
        tile grown to 208x176x192, both within a few units in the last place), and the largest
        halo of the larger tile would eat it again (halo 63 on 176: five tiles along that axis
        where halo 47 made two). Unknown (nothing calibrated) counts as fine: the wanted halo.
        """
        mine, theirs = self.calibration, other.calibration
        if mine is None or mine.met:
            return self.want
        if theirs is None or theirs.met:
            return None
        within = max(theirs.error, theirs.floor, mine.floor)
        fine = [h for h, error in sorted(mine.errors.items()) if error <= within]
        return (fine[0],) * len(self.want) if fine else None


def sample_fingerprint(x: npt.NDArray[Any]) -> str:
    """A cheap fingerprint of a ``(C, *spatial)`` sample: shape, whole sum, strided subsample hash.

    The subsample takes about 64 points per axis; the float64 sum reads every value once, so two
    images that differ anywhere almost surely differ here (cost: one pass, far below a forward).
    """
    steps = [max(1, s // _FINGERPRINT_POINTS) for s in x.shape[1:]]
    sub = np.ascontiguousarray(x[(slice(None), *(slice(None, None, k) for k in steps))], dtype=np.float32)
    digest = hashlib.blake2b(sub.tobytes(), digest_size=8)
    digest.update(repr((x.shape, float(np.sum(x, dtype=np.float64)))).encode())
    return f"{'x'.join(str(s) for s in x.shape)}-{digest.hexdigest()}"


def _central_crop(
    x: npt.NDArray[np.float32], shape: Sequence[int], alignment: int
) -> npt.NDArray[np.float32]:
    """The centre of ``x`` ``(C, *spatial)``, at most ``shape`` (rounded up to ``alignment``)."""
    cut = []
    for s, want in zip(x.shape[1:], shape, strict=False):
        want = round_up(want, alignment)
        if want >= s:
            cut.append(slice(None))
        else:
            lo = (s - want) // 2 // alignment * alignment
            cut.append(slice(lo, lo + want))
    return np.ascontiguousarray(x[(slice(None), *cut)])


class HaloCalibrator:
    """Receptive-field probe and calibrated halos of one model (thread-safe, cached).

    Args:
        spec: the model's spec.
        predictor: its predictor; a :class:`~models.backends.PoolingContext` one runs probes and
            calibrations with the whole-sample pool means (as a whole-image pass would).
    """

    #: The calibrated halo must meet ``tolerance * SAFETY`` on the sample tiles: the sample covers a
    #: few tile placements, a whole image has seams everywhere.
    SAFETY = 0.25

    def __init__(self, spec: ModelSpec, predictor: BasePredictor) -> None:
        self.spec = spec
        self.predictor = predictor
        self._lock = threading.Lock()
        self._probe: ReceptiveField | None = None
        self._halos: OrderedDict[tuple[tuple[int, ...], float, str], HaloCalibration] = OrderedDict()

    @contextlib.contextmanager
    def _context(self, sample: npt.NDArray[np.float32] | None) -> Iterator[Any]:
        """The predictor to probe, with the pool means of ``sample`` held for global-pooling models."""
        if sample is None or not isinstance(self.predictor, PoolingContext):
            yield self.predictor
            return
        with self.predictor.frozen_context(sample):
            yield self.predictor

    @property
    def known_radius(self) -> tuple[int, ...] | None:
        """The radius per axis when known (spec, analytic net or a probe already run), else ``None``."""
        if self.predictor.receptive_field is not None:
            return tuple(int(r) for r in self.predictor.receptive_field)
        with self._lock:
            return None if self._probe is None else self._probe.radius

    def measured(self) -> tuple[ReceptiveField | None, list[tuple[tuple[Any, ...], HaloCalibration]]]:
        """The probe's result (``None`` before it ran) and the calibrated halos, oldest first
        (:mod:`models.measure.measured` stores them)."""
        with self._lock:
            return self._probe, list(self._halos.items())

    def restore(
        self, probe: ReceptiveField | None, halos: list[tuple[tuple[Any, ...], HaloCalibration]]
    ) -> None:
        """Take stored measurements (:meth:`measured` of an earlier process) as if run here."""
        with self._lock:
            if probe is not None and self._probe is None:
                self._probe = probe
            for key, calibration in halos:
                tile, tolerance, source = key
                self._halos.setdefault((tuple(tile), float(tolerance), str(source)), calibration)
            while len(self._halos) > _HALO_CACHE_SIZE:
                self._halos.popitem(last=False)

    def receptive_field(self) -> tuple[int, ...]:
        """Theoretical receptive-field radius per axis (voxels): from the spec, else probed once.

        The probe grows its input while the response reaches the probe's edge, up to 1024 voxels
        per axis in 2-D (96 in 3-D); a network with global pooling reports that bound.
        """
        if self.predictor.receptive_field is not None:
            return tuple(int(r) for r in self.predictor.receptive_field)
        with self._lock:
            if self._probe is None:
                ndim = self.spec.spatial_dims
                size = _FIRST_PROBE[ndim]
                while True:
                    self._probe = self._probe_once(size)
                    if self._probe.bounded or size >= _MAX_PROBE[ndim]:
                        break
                    size = min(2 * size, _MAX_PROBE[ndim])
                logger.info(
                    "model %s: receptive field %s (bounded %s)",
                    self.spec.name,
                    self._probe.radius,
                    self._probe.bounded,
                )
            return self._probe.radius

    def _probe_once(self, size: int) -> ReceptiveField:
        """Probe each axis with an input long on it (``size``) and narrow on the others.

        A conv stack's reach along one axis does not need width on the others (the straight
        path exists), so a band costs a fraction of a square probe; in 3-D, far less.
        """
        ndim, align = self.spec.spatial_dims, self.spec.alignment_lcm
        long = round_up(size, align)
        narrow = round_up(min(size, max(32, 4 * align)), align)
        radius, bounded, seconds = [], True, 0.0
        for axis in range(ndim):
            shape = [long if a == axis else narrow for a in range(ndim)]
            base = probe_input(self.predictor, shape)
            with self._context(base[0]) as predictor:
                target = predictor.logit_view() if isinstance(predictor, PoolingContext) else predictor
                result = probe_receptive_field(target, base=base, batch_size=5, quiet=True)
            radius.append(result.radius[axis])
            # the band's own narrow axes always look unbounded; only the long axis counts
            bounded = bounded and result.radius[axis] < min(shape[axis] // 2 - 1, size // 2 - 1)
            seconds += result.seconds
        return ReceptiveField(tuple(radius), (long,) * ndim, bounded, seconds)

    def auto_halo(
        self,
        shape: tuple[int, ...],
        tile: tuple[int, ...],
        tolerance: float,
        sample: npt.NDArray[np.float32] | None,
        calibrate: bool = True,
    ) -> AutoHalo:
        """``halo="auto"`` for tiles of ``tile`` on an image of ``shape``.

        Each tile gets the wanted halo capped by the radius and by what the tile allows
        (:func:`models.planning.planner.auto_halo_rule`). The wanted halo is the one calibrated on
        ``sample`` (the preprocessed ``(C_in, *shape)`` image) for ``tile``: the smallest within
        the tolerance, else the largest the calibration could try (about half the tile; a larger
        tile grown for it keeps that halo rather than the whole radius, which would eat it again).
        Without ``calibrate`` (a dry run: no forward pass), the halo last calibrated for this tile
        and tolerance on any sample, else the known radius, else 0.

        Raises:
            InputError: ``sample`` is not the preprocessed image.
        """
        ndim = len(tile)
        if fits_one_tile(shape, tile, self.spec.alignment_per_axis):
            return AutoHalo((0,) * ndim, self.known_radius or (0,) * ndim, "one tile")
        if not calibrate:
            radius = self.known_radius
            cached = self.cached(tile, tolerance)
            if cached is not None and radius is not None:
                return AutoHalo((cached.halo,) * ndim, radius, f"dry run: {cached.sample}", cached)
            if radius is not None:
                return AutoHalo(radius, radius, "dry run: receptive field (not calibrated)")
            return AutoHalo((0,) * ndim, (0,) * ndim, "dry run: unknown receptive field")
        if sample is not None:
            if sample.shape[0] != self.spec.in_channels or tuple(sample.shape[1:]) != shape:
                raise InputError(
                    f"model {self.spec.name!r}: the calibration sample must be the preprocessed "
                    f"({self.spec.in_channels}, *{shape}) image, got {tuple(sample.shape)}"
                )
            # the image itself is the sample, zero-padded (as tiling pads) where smaller than a tile
            grow = [(0, 0)] + [(0, max(0, t - s)) for s, t in zip(shape, tile, strict=True)]
            sample = np.pad(sample, grow) if any(g[1] for g in grow) else sample
        calibration = self.calibrate(tile, tolerance, sample)
        return AutoHalo((calibration.halo,) * ndim, self.receptive_field(), calibration.sample, calibration)

    def auto_rules(
        self,
        shape: tuple[int, ...],
        tile: tuple[int, ...],
        tolerance: float,
        sample: npt.NDArray[np.float32] | None,
        calibrate: bool = True,
    ) -> tuple[HaloRule, Callable[[tuple[int, ...]], HaloRule | None], str]:
        """``halo="auto"`` for the planner: the halo rule of ``tile``, a check of another tile
        (calibrated there too, and kept only if it errs no more than ``tile``: some networks are
        exact only at some tile sizes), and where the halo came from."""
        align = self.spec.alignment_per_axis
        start = self.auto_halo(shape, tile, tolerance, sample, calibrate)

        def verify(other: tuple[int, ...]) -> HaloRule | None:
            grown = self.auto_halo(shape, other, tolerance, sample, calibrate)
            want = grown.halo_no_worse_than(start)
            if want is None:
                logger.info("model %s: tile %s errs more than %s at its halo", self.spec.name, other, tile)
                return None
            if want != grown.want:
                logger.info("model %s: tile %s gets halo %s (no worse than %s at halo %s)",
                            self.spec.name, other, want, tile, start.want)  # fmt: skip
            return auto_halo_rule(want, grown.radius, shape, align)

        return auto_halo_rule(start.want, start.radius, shape, align), verify, start.source

    def cached(self, tile: Sequence[int], tolerance: float) -> HaloCalibration | None:
        """The halo most recently calibrated for ``tile`` and ``tolerance`` on any sample, or
        ``None`` (what a dry run reports without running the network)."""
        tile_t = tuple(int(t) for t in tile)
        with self._lock:
            for (t, tol, _), result in reversed(self._halos.items()):
                if t == tile_t and tol == float(tolerance):
                    return result
        return None

    def calibrate(
        self, tile: Sequence[int], tolerance: float, sample: npt.NDArray[np.float32] | None = None
    ) -> HaloCalibration:
        """Calibrated halo for ``tile`` and ``tolerance`` on ``sample``.

        Results are cached per tile, tolerance and sample: the sample (its central crop of about
        ``tile + 2 * radius``, what calibration reads) is identified by :func:`sample_fingerprint`,
        so a new image calibrates anew and the same image reuses its halo. The result's
        ``sample`` names the sample it came from.

        Args:
            tile: tile shape per axis (voxels).
            tolerance: max abs truncation error accepted, after the output activation.
            sample: preprocessed ``(C_in, *spatial)`` data; default a synthetic sample.
        """
        tile_t = tuple(int(t) for t in tile)
        max_halo = calibration_margin(self.receptive_field(), tile_t)
        if sample is not None:
            sample = _central_crop(sample, [t + 2 * max_halo for t in tile_t], self.spec.alignment_lcm)
            source = f"sample {sample_fingerprint(sample)}"
        else:
            source = "synthetic sample"
        key = (tile_t, float(tolerance), source)
        with self._lock:
            cached = self._halos.get(key)
            if cached is not None:
                self._halos.move_to_end(key)
        if cached is not None:
            logger.debug("model %s: cached halo %d (%s)", self.spec.name, cached.halo, source)
            return cached
        activation = make_reduce(self.spec.activation, "probabilities")
        with self._context(sample) as predictor:
            result = calibrate_halo(
                predictor,
                tile_t,
                tolerance=tolerance * self.SAFETY,
                sample=sample,
                max_halo=max_halo,
                activation=activation,
                n_tiles=2,
            )
        result = dataclasses.replace(result, sample=source)
        with self._lock:
            self._halos[key] = result
            while len(self._halos) > _HALO_CACHE_SIZE:
                self._halos.popitem(last=False)
        logger.info(
            "model %s: tile %s tolerance %g -> calibrated halo %d (error %.3g, from %s)",
            self.spec.name,
            tile_t,
            tolerance,
            result.halo,
            result.error,
            source,
        )
        return result

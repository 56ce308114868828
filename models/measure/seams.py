"""What a model says about its seams: whether tiles change its output, and when a run reports it.

A *tile-dependent* network (instance norm, attention, global pooling over the tile) cannot be made
exact by any halo (DESIGN.md, "tile-dependent networks"). :class:`SeamPolicy` holds one loaded
model's verdict: the spec's ``tile_dependent``, else :func:`models.measure.dependence.probe_tile_dependence`
run once on a tile of the spec's default shape (at warm-up, or on first need) and cached. From it
and the receptive field it decides whether a run measures its seam (:meth:`SeamPolicy.seam_stats`,
the ``X-Tilewise-Seam`` header) and whether a given halo deserves a warning
(:meth:`SeamPolicy.halo_warning`, the ``X-Tilewise-Warning`` header).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from models.backends import BasePredictor
from models.measure.calibration import HaloCalibrator
from models.measure.dependence import ProbeError, TileDependence, probe_tile_dependence
from models.planning.plan import RunPlan
from models.spec import Backend, ModelSpec
from models.transforms.preprocess import make_reduce
from tiling import SeamStats, TileGrid
from tiling.geometry import as_ints
from tiling.plan import round_up

__all__ = ["SeamPolicy"]

logger = logging.getLogger(__name__)


class SeamPolicy:
    """Tile dependence (spec or probe, cached; thread-safe), seam measurement and halo warnings.

    Args:
        spec: the model's spec.
        predictor: its predictor (probed at most once).
        calibrator: its receptive field (read, never probed here).
    """

    def __init__(self, spec: ModelSpec, predictor: BasePredictor, calibrator: HaloCalibrator) -> None:
        self.spec = spec
        self.predictor = predictor
        self.calibrator = calibrator
        self._lock = threading.Lock()
        self._probe: TileDependence | None = None

    @property
    def known(self) -> bool | None:
        """The spec's ``tile_dependent``, else the probe's verdict once run, else ``None`` (unknown).

        Analytic models and global-pooling ones (whose pool means come from the whole image, so
        tiles do not change them) are local without a probe.
        """
        spec = self.spec
        if spec.tile_dependent is not None:
            return spec.tile_dependent
        if spec.backend == Backend.ANALYTIC or spec.global_pooling:
            return False
        with self._lock:
            return None if self._probe is None else self._probe.tile_dependent

    @property
    def probe(self) -> TileDependence | None:
        """The probe's result, ``None`` before it ran (:mod:`models.measure.measured` stores it)."""
        with self._lock:
            return self._probe

    def restore(self, probe: TileDependence | None) -> None:
        """Take a stored probe result as if run here."""
        with self._lock:
            if self._probe is None:
                self._probe = probe

    def tile_dependent(self) -> bool:
        """:attr:`known`, else the probe's verdict, probing now (once: two or three forward passes
        over one tile of the spec's default shape). A tile too small to probe counts as local."""
        known = self.known
        if known is not None:
            return known
        spec = self.spec
        with self._lock:
            if self._probe is None:
                assert spec.defaults.tile is not None
                tile = as_ints(spec.defaults.tile, spec.spatial_dims, "tile", minimum=1)
                tile = tuple(round_up(t, a) for t, a in zip(tile, spec.alignment_per_axis, strict=True))
                try:
                    self._probe = probe_tile_dependence(
                        self.predictor,
                        spatial_dims=spec.spatial_dims,
                        in_channels=spec.in_channels,
                        tile_shape=tile,
                        radius=self.calibrator.known_radius,
                        alignment=spec.alignment_lcm,
                        device=self.predictor.device,
                    )
                except ProbeError as exc:
                    logger.warning("model %s: tile dependence unprobed (%s): local", spec.name, exc)
                    return False
                logger.info(
                    "model %s: tile-dependent %s (relative change %.3g at tile %s)",
                    spec.name,
                    self._probe.tile_dependent,
                    self._probe.relative_change,
                    tile,
                )
            return self._probe.tile_dependent

    def seam_stats(self, plan: RunPlan) -> SeamStats | None:
        """A fresh :class:`~tiling.SeamStats` when the run of ``plan`` should report its seam, else ``None``.

        Reported for a tile-dependent model, and for a local one whose halo is below its known
        receptive-field radius on an axis with more than one tile, unless ``halo=auto`` chose that
        halo by a calibration that met its tolerance: then the kept output is within the tolerance
        of the whole-image pass (the calibration compared exactly that, on this image), and the
        tiles' discarded halos, which the meter would compare, say nothing about it (a run equal
        to the whole pass within 4.5e-6 measured ``max=0.23`` there). Differences are taken after
        the spec's activation (probabilities, when it has one).
        """
        if self.tile_dependent():
            return SeamStats(transform=make_reduce(self.spec.activation, "probabilities"))
        if not self._short_axes(plan.grid, plan.halo) or self._calibrated_exact(plan):
            return None
        return SeamStats(transform=make_reduce(self.spec.activation, "probabilities"))

    def _calibrated_exact(self, plan: RunPlan) -> bool:
        """Whether ``plan``'s halo came from a calibration (``halo=auto``) that met its tolerance.

        A tile grown by the planner is calibrated on its own crop of the request's image (another
        sample name than the first tile's, :meth:`HaloCalibrator.calibrate`): for a plan whose halo
        came from a sample, the latest calibration of its tile on a sample (the one this request
        ran or reused: the cache is kept in use order) decides.
        """
        if plan.halo_source in ("given", "tile-dependent"):
            return False
        _, halos = self.calibrator.measured()
        tile = tuple(int(t) for t in plan.tile)
        from_sample = plan.halo_source.startswith("sample ")

        def same(source: str) -> bool:
            return source == plan.halo_source or (from_sample and source.startswith("sample "))

        found = [c for (t, _, source), c in halos if tuple(t) == tile and same(str(source))]
        return bool(found) and found[-1].met and found[-1].halo <= min(plan.halo)

    def halo_warning(self, grid: TileGrid, halo: tuple[int, ...]) -> str | None:
        """The warning for a given halo below a local model's radius where tiles meet, else ``None``."""
        radius = self.calibrator.known_radius
        if self.known or radius is None or not self._short_axes(grid, halo):
            return None

        def axes(values: Sequence[int]) -> str:
            return ",".join(str(v) for v in values)

        return (
            f"halo {axes(halo)} is below the receptive-field radius {axes(radius)} of model "
            f"{self.spec.name!r}, so the output differs from the whole-image result near tile seams "
            f"(use halo={axes(radius)} or halo=auto)."
        )

    def _short_axes(self, grid: TileGrid, halo: tuple[int, ...]) -> list[int]:
        """Axes with more than one tile whose halo is below the known radius."""
        radius = self.calibrator.known_radius
        if radius is None:
            return []
        return [a for a, axis in enumerate(grid.axes) if axis.n_tiles > 1 and halo[a] < radius[a]]

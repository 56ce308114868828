"""A loaded model: preprocess, plan once, execute the plan.

``Model.run(data, params)`` is ``preprocess`` + ``plan`` + ``execute``; the service calls the three
steps itself so that the one :class:`~models.RunPlan` also feeds its metrics and response headers.
The plan's tile and batch size are sized by :mod:`models.planning.planner` from the network's
:class:`~models.measure.footprint.Footprint` (measured once, at warm-up); a run that runs out of device
memory halves the batch, then the tile, and runs again (:meth:`Model.execute`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from models.backends import BasePredictor, PoolingContext
from models.errors import InputError, ParamError
from models.execution.execute import execute_plan
from models.execution.options import RunOptions
from models.measure.calibration import HaloCalibrator
from models.measure.footprint import Footprint, footprint_of
from models.measure.measured import Measurements
from models.measure.receptive import HaloCalibration
from models.measure.seams import SeamPolicy
from models.planning.params import Blend, InferenceParams, OutputKind
from models.planning.plan import RunPlan
from models.planning.planner import default_memory_budget, given_halo_rule, size_plan
from models.planning.sizing import WORK_TARGET
from models.spec import ModelSpec
from models.transforms.preprocess import preprocess
from tiling import SeamStats
from tiling.geometry import as_ints

__all__ = ["Model", "TiledPass"]

logger = logging.getLogger(__name__)


class TiledPass(Protocol):
    """Runs one tiled pass of a plan somewhere else than in this process (e.g. on a Dask cluster).

    :meth:`Model.execute` calls it in place of its own :func:`tiling.tiled_inference` pass, once per
    flip of the plan's ``tta``; everything around the pass (preprocessing, TTA averaging, output
    kind, mapping back) stays the model's.
    """

    def __call__(
        self,
        model: Model,
        x: npt.NDArray[np.float32],
        plan: RunPlan,
        reduce: Callable[[Any], Any] | None,
        options: RunOptions,
    ) -> tuple[npt.NDArray[Any], RunPlan]:
        """``x`` ``(C_in, *plan.spatial_shape)`` float32 -> ``(C_out, *spatial)`` float32, or
        ``(C_red, *spatial)`` once ``reduce`` (picklable; ``None``: identity) is applied; and
        the plan that ran there (e.g. ``plan`` with :attr:`~models.planning.plan.RunPlan.chunked`).
        ``options``: the run's ``progress`` and ``should_stop`` (:class:`RunOptions`)."""


class Model:
    """A loaded model: its spec, its predictor, and tiled inference over whole images.

    Attributes:
        spec: the :class:`~models.ModelSpec`.
        predictor: the backend's :class:`~models.Predictor`.
        calibrator: its receptive field and calibrated halos.
        seams: its tile dependence (spec or probe), seam measurement and halo warnings.
    """

    def __init__(self, spec: ModelSpec, predictor: BasePredictor) -> None:
        self.spec = spec
        self.predictor = predictor
        self.calibrator = HaloCalibrator(spec, predictor)
        self.context = predictor if isinstance(predictor, PoolingContext) else None
        self.run_lock = threading.Lock()  # global pooling: one run at a time (models.execution.execute)
        self.seams = SeamPolicy(spec, predictor, self.calibrator)
        self._footprint_lock = threading.Lock()
        self._footprint: Footprint | None = None

    def __repr__(self) -> str:
        return (
            f"Model({self.spec.name!r}, backend={self.spec.backend.value!r}, device={self.predictor.device})"
        )

    @property
    def known_receptive_field(self) -> tuple[int, ...] | None:
        """The radius per axis when known (spec, analytic net or a probe already run), else ``None``."""
        return self.calibrator.known_radius

    @property
    def known_tile_dependent(self) -> bool | None:
        """Tile dependence when known (the spec, an analytic or global-pooling net, a probe already
        run), else ``None``: :attr:`seams` ``.known``."""
        return self.seams.known

    def is_tile_dependent(self) -> bool:
        """Whether the network is tile-dependent, probed now (once) when unknown (:attr:`seams`)."""
        return self.seams.tile_dependent()

    def receptive_field(self) -> tuple[int, ...]:
        """Receptive-field radius per axis (voxels): from the spec, else probed once."""
        return self.calibrator.receptive_field()

    @property
    def known_footprint(self) -> Footprint | None:
        """The network's measured :class:`~models.measure.footprint.Footprint`, or ``None`` before
        :meth:`footprint` ran."""
        with self._footprint_lock:
            return self._footprint

    def footprint(self) -> Footprint:
        """Memory and time per voxel of a forward pass, measured once (eight forward passes of
        synthetic tiles: the spec's default tile, at most 128^3, and half of it, at batch 1 and 2+).

        Measure it at warm-up, before requests run: the memory measured is the process's own (see
        :mod:`models.measure.footprint`).
        """
        with self._footprint_lock:
            if self._footprint is None:
                self._footprint = footprint_of(self.spec, self.predictor)
                logger.info("model %s: footprint %s", self.spec.name, self._footprint.describe())
            return self._footprint

    def measurements(self) -> Measurements:
        """What this model measured so far: receptive field, tile dependence, footprint, halos."""
        probe, halos = self.calibrator.measured()
        return Measurements(probe, self.seams.probe, self.known_footprint, halos)

    def restore_measurements(self, measured: Measurements) -> None:
        """Take measurements stored by an earlier process
        (:class:`~models.measure.measured.MeasurementStore`): nothing is measured again that they hold."""
        self.calibrator.restore(measured.receptive_field, measured.halos)
        self.seams.restore(measured.tile_dependence)
        if measured.footprint is not None:
            with self._footprint_lock:
                if self._footprint is None:
                    self._footprint = measured.footprint

    def calibrate(
        self, tile: Sequence[int], tolerance: float, sample: npt.NDArray[np.float32] | None = None
    ) -> HaloCalibration:
        """Calibrated halo for ``tile`` and ``tolerance`` on a preprocessed ``sample`` (cached)."""
        return self.calibrator.calibrate(tile, tolerance, sample)

    def preprocess(self, data: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """The spec's preprocessing of a whole ``(C, *spatial)`` image (see
        :func:`models.transforms.preprocess`)."""
        return preprocess(data, self.spec)

    def plan(
        self,
        spatial_shape: Sequence[int],
        params: InferenceParams | None = None,
        *,
        sample: npt.NDArray[np.float32] | None = None,
        memory_budget: int | None = None,
        footprint: Footprint | None = None,
        calibrate: bool = True,
        input_bytes: int = 0,
        copies_input: bool = True,
        output_on_disk: bool = False,
    ) -> RunPlan:
        """Resolve ``params`` against the spec's defaults and plan the tile grid, once per request.

        Tile and batch size are sized by :func:`models.planning.planner.size_plan`: a tile whose halo leaves
        the network more than 2.4 voxels per input voxel grows (within the memory budget), and
        ``memory_budget`` picks the tile and batch the request does not give.

        Args:
            spatial_shape: spatial shape of the *preprocessed* input (voxels).
            params: the request's parameters (``None`` fields: the spec's defaults).
            sample: the preprocessed ``(C_in, *spatial)`` image, on which ``halo="auto"`` is
                calibrated (default: a synthetic sample).
            memory_budget: bytes the run may hold (``TILEWISE_MEMORY_BUDGET``); ``None``: the
                spec's tile and batch, grown only where the halo eats the tile, within half the
                machine's (or GPU's) memory.
            footprint: the network's footprint to cost plans with (default: :meth:`footprint`,
                measured now if it was not).
            calibrate: ``False`` plans without running the network (a dry run): ``halo="auto"``
                takes the halo last calibrated for this tile and tolerance, else the known
                receptive-field radius, else 0.
            input_bytes, copies_input: the decoded input held beside the run, and whether
                preprocessing copies it (what the budget counts besides the plan;
                :func:`models.planning.cost.peak_bytes`); ``output_on_disk``: the output is written to a
                file as it finishes (a streamed request).

        Raises:
            InputError: ``spatial_shape`` or ``sample`` does not fit the model.
            GridError: a tile, halo or overlap of the wrong count or range for this image.
        """
        spec = self.spec
        p = (params or InferenceParams()).merged(spec.defaults)
        given = params.model_fields_set if params is not None else set()
        shape = tuple(int(s) for s in spatial_shape)
        ndim = spec.spatial_dims
        if len(shape) != ndim:
            raise InputError(f"model {spec.name!r} plans {ndim} spatial axes, got shape {shape}")
        assert p.tile is not None and p.overlap is not None and p.halo is not None  # spec defaults
        if p.output == OutputKind.LABELS and spec.activation == "sigmoid" and spec.out_channels > 1:
            raise ParamError(
                f"output=labels: model {spec.name!r} is multi-label (a sigmoid over {spec.out_channels} "
                "channels, a voxel may carry several labels), one label per voxel cannot say that; ask "
                "output=probabilities (one channel per label, a label where its channel exceeds 0.5)"
            )
        assert p.blend is not None and p.batch_size is not None and p.output is not None
        tile = as_ints(p.tile, ndim, "tile", minimum=1)
        overlap = as_ints(p.overlap, ndim, "overlap", minimum=0)
        blend = p.blend
        auto, verify = p.halo == "auto", None
        if auto and self.is_tile_dependent():
            # no halo reproduces the whole image: no search, the blended default plan
            halo_of, source = given_halo_rule((0,) * ndim), "tile-dependent"
            framework = spec.padding != "end"  # the source framework's windows, as its spec says
            if "overlap" not in given and not any(overlap) and not framework:
                overlap = tuple(t // 2 for t in tile)  # nnU-Net's half a tile
            if "blend" not in given and blend == Blend.CONSTANT and not framework:
                blend = Blend.GAUSSIAN
        elif auto:
            assert p.halo_tolerance is not None
            tolerance = p.halo_tolerance
            halo_of, verify, source = self.calibrator.auto_rules(shape, tile, tolerance, sample, calibrate)
        else:
            assert not isinstance(p.halo, str)  # not "auto"
            halo_of, source = given_halo_rule(as_ints(p.halo, ndim, "halo", minimum=0)), "given"
        dependent = bool(self.known_tile_dependent)
        sized = size_plan(
            spec,
            shape,
            tile,
            halo_of,
            overlap,
            blend,
            p.batch_size,
            p.output,
            p.tta,
            fixed_tile_shape=auto or dependent,  # why: models.planning.planner's docstring
            tile_dependent=dependent,
            tile_given="tile" in given and params is not None and params.tile is not None,
            batch_given="batch_size" in given and params is not None and params.batch_size is not None,
            auto_halo=auto,
            footprint=(lambda: footprint) if footprint is not None else self.footprint,
            memory_budget=memory_budget,
            default_budget=lambda: default_memory_budget(self.predictor.device),
            verify=verify,
            input_bytes=input_bytes,
            copies_input=copies_input,
            output_on_disk=output_on_disk,
        )
        warning = self.seams.halo_warning(sized.grid, sized.halo) if source == "given" else None
        given_tile = "tile" in given and params is not None and params.tile is not None
        if given_tile and sized.tile_source != "given":  # a given tile is a limit, or we say why not
            grown = (
                f"tile={','.join(map(str, tile))} grown to {','.join(map(str, sized.grid.used_tile_shape))}: "
                f"with halo=auto ({','.join(map(str, sized.halo))}) the given tile fed more than "
                f"{WORK_TARGET} voxels through the network per input voxel (give a halo to keep the tile)"
            )
            warning = grown if warning is None else f"{warning}; {grown}"
        if sized.budget_unmet is not None:
            budget, peak = sized.budget_unmet
            unmet = (
                f"no plan fits the memory budget of {budget / 2**20:.0f} MiB: this one, the smallest "
                f"within the work bound, predicts {peak / 2**20:.0f} MiB"
            )
            warning = unmet if warning is None else f"{warning}; {unmet}"
        plan = RunPlan(
            spec.name, shape, sized.tile, sized.halo, overlap, blend, sized.batch_size, p.output, source,
            sized.grid, p.tta, warning=warning, mirror_axes=spec.mirror_axes, tile_source=sized.tile_source,
        )  # fmt: skip
        logger.info("model %s: plan %s (halo from %s, tile %s)", spec.name, plan.header(), source,
                    sized.tile_source)  # fmt: skip
        return plan

    def execute(
        self,
        x: npt.NDArray[np.float32],
        plan: RunPlan,
        *,
        out: npt.NDArray[Any] | None = None,
        options: RunOptions | None = None,
    ) -> npt.NDArray[Any]:
        """Run ``plan`` on the preprocessed ``x`` ``(C_in, *plan.spatial_shape)``.

        When the device runs out of memory (:class:`~models.errors.DeviceOutOfMemoryError`), the
        pass runs again from its start with half the batch, then half the tile,
        until it fits or neither can shrink; ``options.replanned`` is told each smaller plan, and
        the passes after it use that plan. A local network with a halo at its receptive field
        gives the same output with any tile and batch.

        With ``tta=mirror`` the plan runs once per flip of the spec's ``mirror_axes`` and the
        probabilities (or, with ``output.tta_average: logits``, the logits, as nnU-Net does) are
        averaged before labels are taken: for a local network, tiled TTA equals whole-image TTA.
        ``options.seam`` (see :meth:`seam_stats`) gathers the disagreement of overlapping tiles
        over every pass.

        Returns:
            ``(C_out, *spatial * scale)`` probabilities after the activation (float32, or float16
            when the spec's output dtype says so), or ``(*spatial * scale)`` uint8 labels (argmax
            over channels; ``p > 0.5`` for one channel); ``out`` when given.

        ``options`` (:class:`~models.execution.options.RunOptions`): ``progress`` (a bar, or a
        callback of each batch's tile count) and ``should_stop`` (asked before every batch) are
        :func:`tiling.tiled_inference`'s; so is ``resume`` (with ``out``, a run that continues one
        stopped at a finished tile row), which a ``tta=mirror`` plan ignores: its passes are
        averaged in memory, so it always runs whole. ``tiled`` runs each tiled pass in place of
        this process's :func:`tiling.tiled_inference` (a Dask cluster); it takes neither
        ``resume`` nor ``seam``. ``reuse`` (:class:`tiling.TileReuse`) says which tiles are not run
        (constant inputs, a skip rule) and counts them, over every pass.

        Raises:
            InputError: ``x`` is not the image the plan was made for.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
            RunCancelledError: ``options.should_stop()`` returned true.
        """
        spec = self.spec
        if tuple(x.shape[1:]) != plan.spatial_shape or x.shape[0] != spec.in_channels:
            raise InputError(
                f"model {spec.name!r}: the plan is for ({spec.in_channels}, *{plan.spatial_shape}), "
                f"got {tuple(x.shape)}"
            )
        options = options or RunOptions()
        if options.tiled is not None and (options.resume is not None or options.seam is not None):
            raise ValueError("a tiled pass elsewhere (tiled=) takes neither resume nor seam")
        start = time.perf_counter()
        result, plan = execute_plan(self, x, plan, out=out, options=options)
        logger.info("model %s: %s in %.2f s", spec.name, plan.header(), time.perf_counter() - start)
        if out is not None:
            return out
        if plan.output == OutputKind.LABELS:
            first: npt.NDArray[Any] = np.asarray(result)[0]
            return first
        return np.asarray(result, dtype=np.float16 if spec.output_dtype == "float16" else np.float32)

    def seam_stats(self, plan: RunPlan) -> SeamStats | None:
        """A fresh :class:`~tiling.SeamStats` when the run of ``plan`` reports its seam, else
        ``None`` (:meth:`SeamPolicy.seam_stats`)."""
        return self.seams.seam_stats(plan)

    def run(
        self,
        data: npt.NDArray[Any],
        params: InferenceParams | None = None,
        *,
        out: npt.NDArray[Any] | None = None,
        options: RunOptions | None = None,
    ) -> npt.NDArray[Any]:
        """Tiled inference over a whole image or volume: preprocess, plan, execute.

        Args:
            data: ``(C, *spatial)`` array of any numeric dtype with ``len(spatial) ==
                spec.spatial_dims``; the spec's preprocessing runs on the whole image first.
            params: tile, halo, overlap, blend, batch size and output kind (``None``: defaults).
            out: optional array to fill: ``(C_out, *spatial)`` float32 for probabilities,
                ``(*spatial)`` uint8 for labels.
            options: how the run is watched (:class:`~models.execution.options.RunOptions`).

        Raises:
            InputError: wrong number of spatial axes or channels.
            GridError: an invalid tile, halo, overlap or batch size for this image.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
        """
        x = self.preprocess(data)
        plan = self.plan(x.shape[1:], params, sample=x)
        return self.execute(x, plan, out=out, options=options)

"""A loaded model: preprocess, plan once, execute the plan.

``Model.run(data, params)`` is ``preprocess`` + ``plan`` + ``execute``; the service calls the three
steps itself so that the one :class:`~models.RunPlan` also feeds its metrics and response headers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from models.backends import BasePredictor, PoolingContext
from models.calibration import HaloCalibrator
from models.errors import InputError
from models.params import Blend, InferenceParams, OutputKind
from models.plan import RunPlan
from models.preprocess import make_reduce, preprocess
from models.receptive import HaloCalibration
from models.seams import SeamPolicy
from models.spec import ModelSpec
from tiling import Resume, SeamStats, TileGrid, aligned_extent, cap_halo, context_halo, fits_one_tile
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
        *,
        progress: bool | Callable[[int], object] = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> npt.NDArray[Any]:
        """``x`` ``(C_in, *plan.spatial_shape)`` float32 -> ``(C_out, *spatial)`` float32, or
        ``(C_red, *spatial)`` once ``reduce`` (picklable; ``None``: identity) is applied."""


class Model:
    """A loaded model: its spec, its predictor, and tiled inference over whole images.

    Attributes:
        spec: the :class:`~models.ModelSpec`.
        predictor: the backend's :class:`~models.Predictor`.
        calibrator: its receptive field and calibrated halos.
        seams: its tile dependence (spec or probe), seam measurement and halo warnings.
    """

    #: Global-pooling models: images of at most this many tiles' voxels get their pool means from
    #: one whole-image pass (exact and fastest; memory up to this many tiles' worth).
    CONTEXT_WHOLE_FACTOR = 4

    def __init__(self, spec: ModelSpec, predictor: BasePredictor) -> None:
        self.spec = spec
        self.predictor = predictor
        self.calibrator = HaloCalibrator(spec, predictor)
        self.context = predictor if isinstance(predictor, PoolingContext) else None
        self._run_lock = threading.Lock()
        self.seams = SeamPolicy(spec, predictor, self.calibrator)

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

    def calibrate(
        self, tile: Sequence[int], tolerance: float, sample: npt.NDArray[np.float32] | None = None
    ) -> HaloCalibration:
        """Calibrated halo for ``tile`` and ``tolerance`` on a preprocessed ``sample`` (cached)."""
        return self.calibrator.calibrate(tile, tolerance, sample)

    def preprocess(self, data: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """The spec's preprocessing of a whole ``(C, *spatial)`` image (see :func:`models.preprocess`)."""
        return preprocess(data, self.spec)

    def plan(
        self,
        spatial_shape: Sequence[int],
        params: InferenceParams | None = None,
        *,
        sample: npt.NDArray[np.float32] | None = None,
    ) -> RunPlan:
        """Resolve ``params`` against the spec's defaults and plan the tile grid, once per request.

        Args:
            spatial_shape: spatial shape of the *preprocessed* input (voxels).
            params: the request's parameters (``None`` fields: the spec's defaults).
            sample: the preprocessed ``(C_in, *spatial)`` image, on which ``halo="auto"`` is
                calibrated (default: a synthetic sample).

        Raises:
            InputError: ``spatial_shape`` or ``sample`` does not fit the model.
            GridError: a tile, halo or overlap of the wrong count or range for this image.
        """
        spec = self.spec
        p = (params or InferenceParams()).merged(spec.defaults)
        shape = tuple(int(s) for s in spatial_shape)
        ndim = spec.spatial_dims
        if len(shape) != ndim:
            raise InputError(f"model {spec.name!r} plans {ndim} spatial axes, got shape {shape}")
        assert p.tile is not None and p.overlap is not None and p.halo is not None  # spec defaults
        assert p.blend is not None and p.batch_size is not None and p.output is not None
        tile = as_ints(p.tile, ndim, "tile", minimum=1)
        overlap = as_ints(p.overlap, ndim, "overlap", minimum=0)
        blend = p.blend
        if p.halo == "auto" and self.is_tile_dependent():
            # no halo reproduces the whole image: no search, the blended default plan
            given = params.model_fields_set if params is not None else set()
            halo, source = (0,) * ndim, "tile-dependent"
            if "overlap" not in given and not any(overlap):
                overlap = tuple(t // 2 for t in tile)  # nnU-Net's half a tile
            if "blend" not in given and blend == Blend.CONSTANT:
                blend = Blend.GAUSSIAN
        elif p.halo == "auto":
            assert p.halo_tolerance is not None
            halo, source = self._auto_halo(shape, tile, p.halo_tolerance, sample)
        else:
            halo, source = as_ints(p.halo, ndim, "halo", minimum=0), "given"
        grid = TileGrid.plan(
            shape,
            tile,
            halo,
            overlap=overlap,
            alignment=spec.alignment,
            scale=spec.scale,
            blend=blend.value,
            # A calibrated halo is an estimate from sampled tiles; the fixed-shape plan keeps the
            # margins it was calibrated with (text-det-2d's calibrated halo 61 errs by 0.023 with
            # tiles sized to the grid). A tile-dependent network's output depends on the tile it
            # sees, so its plans hold at the tile size they were measured at (brain-mask-3d, 192^3
            # tiles over its 256^3 frame: Dice 0.98 against the whole pass; sized to 160^3, 0.966),
            # and it sees the patch shape it was trained on, as in nnU-Net's and MONAI's windows.
            fixed_tile_shape=p.halo == "auto" or bool(self.known_tile_dependent),
        )
        warning = self.seams.halo_warning(grid, halo) if source == "given" else None
        plan = RunPlan(
            spec.name, shape, tile, halo, overlap, blend, p.batch_size, p.output, source, grid, p.tta,
            warning=warning, mirror_axes=spec.mirror_axes,
        )  # fmt: skip
        logger.info("model %s: plan %s (halo from %s)", spec.name, plan.header(), source)
        return plan

    def _auto_halo(
        self,
        shape: tuple[int, ...],
        tile: tuple[int, ...],
        tolerance: float,
        sample: npt.NDArray[np.float32] | None,
    ) -> tuple[tuple[int, ...], str]:
        """``halo="auto"``: calibrated on ``sample``, capped by the radius and the alignment."""
        align = self.spec.alignment
        if fits_one_tile(shape, tile, align):
            return (0,) * len(tile), "one tile"  # one tile covers the image: no seam to protect
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
        halo = cap_halo((calibration.halo,) * len(tile), self.receptive_field(), tile, align)
        return halo, calibration.sample

    def execute(
        self,
        x: npt.NDArray[np.float32],
        plan: RunPlan,
        *,
        out: npt.NDArray[Any] | None = None,
        progress: bool | Callable[[int], object] = False,
        should_stop: Callable[[], bool] | None = None,
        resume: Resume | None = None,
        seam: SeamStats | None = None,
        tiled: TiledPass | None = None,
    ) -> npt.NDArray[Any]:
        """Run ``plan`` on the preprocessed ``x`` ``(C_in, *plan.spatial_shape)``.

        With ``tta=mirror`` the plan runs once per flip of the spec's ``mirror_axes`` and the
        probabilities (or, with ``output.tta_average: logits``, the logits, as nnU-Net does) are
        averaged before labels are taken: for a local network, tiled TTA equals whole-image TTA.
        ``seam`` (see :meth:`seam_stats`) gathers the disagreement of overlapping tiles over
        every pass.

        Returns:
            ``(C_out, *spatial * scale)`` probabilities after the activation (float32, or float16
            when the spec's output dtype says so), or ``(*spatial * scale)`` uint8 labels (argmax
            over channels; ``p > 0.5`` for one channel); ``out`` when given.

        ``progress`` (a bar, or a callback of each batch's tile count) and ``should_stop`` (asked
        before every batch) are :func:`tiling.tiled_inference`'s; so is ``resume`` (with ``out``, a
        run that continues one stopped at a finished tile row), which a ``tta=mirror`` plan ignores:
        its passes are averaged in memory, so it always runs whole. ``tiled`` runs each tiled pass
        in place of this process's :func:`tiling.tiled_inference` (a Dask cluster); it takes
        neither ``resume`` nor ``seam``.

        Raises:
            InputError: ``x`` is not the image the plan was made for.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
            RunCancelledError: ``should_stop()`` returned true.
        """
        spec = self.spec
        if tuple(x.shape[1:]) != plan.spatial_shape or x.shape[0] != spec.in_channels:
            raise InputError(
                f"model {spec.name!r}: the plan is for ({spec.in_channels}, *{plan.spatial_shape}), "
                f"got {tuple(x.shape)}"
            )
        if tiled is not None and (resume is not None or seam is not None):
            raise ValueError("a tiled pass elsewhere (tiled=) takes neither resume nor seam")
        start = time.perf_counter()
        labels = plan.output == OutputKind.LABELS

        def one_pass(x: npt.NDArray[np.float32], reduce: Any, target: Any, resume: Any) -> npt.NDArray[Any]:
            if tiled is None:
                return self._tiled(x, plan, reduce, target, progress, should_stop, resume, seam)
            y = tiled(self, x, plan, reduce, progress=progress, should_stop=should_stop)
            if target is None:
                return y
            target[...] = y
            return target  # type: ignore[no-any-return]

        if len(plan.flips) == 1:
            target = out[None] if out is not None and labels else out
            reduce = make_reduce(spec.activation, plan.output.value)
            result = one_pass(x, reduce, target, resume)
        else:  # tta: the mean over the flipped passes (probabilities, or logits), then the output kind
            logits = spec.output.tta_average == "logits"
            per_pass = make_reduce("none" if logits else spec.activation, "probabilities")
            total: npt.NDArray[np.float32] | None = None
            for axes in plan.flips:
                dims = tuple(1 + a for a in axes)
                flipped = np.ascontiguousarray(np.flip(x, dims)) if dims else x
                y = one_pass(flipped, per_pass, None, None)
                y = np.flip(np.asarray(y, dtype=np.float32), dims) if dims else np.asarray(y, np.float32)
                total = y.copy() if total is None else total + y
            assert total is not None
            result = total / np.float32(len(plan.flips))
            reduce = make_reduce(spec.activation if logits else "none", plan.output.value)
            if reduce is not None:
                import torch

                result = reduce(torch.from_numpy(result)).numpy()
            if out is not None:
                out[...] = result[0] if labels else result
        logger.info("model %s: %s in %.2f s", spec.name, plan.header(), time.perf_counter() - start)
        if out is not None:
            return out
        if labels:
            first: npt.NDArray[Any] = np.asarray(result)[0]
            return first
        return np.asarray(result, dtype=np.float16 if spec.output_dtype == "float16" else np.float32)

    def seam_stats(self, plan: RunPlan) -> SeamStats | None:
        """A fresh :class:`~tiling.SeamStats` when the run of ``plan`` reports its seam, else
        ``None`` (:meth:`SeamPolicy.seam_stats`)."""
        return self.seams.seam_stats(plan)

    def _tiled(
        self,
        x: npt.NDArray[np.float32],
        plan: RunPlan,
        reduce: Any,
        out: Any,
        progress: bool | Callable[[int], object],
        should_stop: Callable[[], bool] | None = None,
        resume: Resume | None = None,
        seam: SeamStats | None = None,
    ) -> npt.NDArray[Any]:
        """One tiled pass of ``plan`` over ``x`` (with the whole-image pool means when needed)."""
        from tiling import tiled_inference

        spec = self.spec
        # Whole-image pool means are state on the predictor: one global-pooling run at a time.
        with self._run_lock if self.context is not None else contextlib.nullcontext():
            try:
                if self.context is not None:
                    self._prepare_context(self.context, x, plan)
                result: npt.NDArray[Any] = tiled_inference(
                    x,
                    self.predictor,
                    tile_shape=plan.tile,
                    halo=plan.halo,
                    overlap=plan.overlap,
                    blend=plan.blend.value,
                    alignment=spec.alignment,
                    scale=spec.scale,
                    batch_size=plan.batch_size,
                    device=self.predictor.device,
                    out=out,
                    reduce=reduce,
                    progress=progress,
                    fixed_tile_shape=plan.grid.fixed_tile_shape,
                    should_stop=should_stop,
                    resume=resume,
                    seam=seam,
                )
            finally:
                if self.context is not None:
                    self.context.clear_context()
        return result

    def run(
        self,
        data: npt.NDArray[Any],
        params: InferenceParams | None = None,
        *,
        out: npt.NDArray[Any] | None = None,
        progress: bool = False,
    ) -> npt.NDArray[Any]:
        """Tiled inference over a whole image or volume: preprocess, plan, execute.

        Args:
            data: ``(C, *spatial)`` array of any numeric dtype with ``len(spatial) ==
                spec.spatial_dims``; the spec's preprocessing runs on the whole image first.
            params: tile, halo, overlap, blend, batch size and output kind (``None``: defaults).
            out: optional array to fill: ``(C_out, *spatial)`` float32 for probabilities,
                ``(*spatial)`` uint8 for labels.
            progress: show a progress bar over tiles.

        Raises:
            InputError: wrong number of spatial axes or channels.
            GridError: an invalid tile, halo, overlap or batch size for this image.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
        """
        x = self.preprocess(data)
        plan = self.plan(x.shape[1:], params, sample=x)
        return self.execute(x, plan, out=out, progress=progress)

    def _prepare_context(self, context: PoolingContext, x: npt.NDArray[np.float32], plan: RunPlan) -> None:
        """Whole-image pool means for a global-pooling model, before the tiled pass.

        Pool means average feature maps whose reach is the whole receptive field: a halo
        calibrated for the output truncates them (text-det-2d, halo 188: the neck's pool means
        2 % off, the output 0.43 off). So an image of at most :attr:`CONTEXT_WHOLE_FACTOR` tiles'
        voxels gets one whole-image pass (exact), and a larger one tile-by-tile passes with the
        radius as halo (exact once tile > 2 * radius; else the largest halo the tile allows).
        """
        extent = aligned_extent(x.shape[1:], self.spec.alignment)
        if math.prod(extent) <= self.CONTEXT_WHOLE_FACTOR * math.prod(plan.tile):
            context.prepare_context(x, tile=None, halo=None)
            return
        halo = context_halo(plan.halo, self.receptive_field(), plan.tile)
        context.prepare_context(x, tile=plan.tile, halo=halo, batch_size=plan.batch_size)

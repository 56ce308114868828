"""Running a plan: one tiled pass per ``tta`` flip, each retried smaller when the device runs out
of memory.

:meth:`models.Model.execute` validates the input and calls :func:`execute_plan`, which runs
:func:`tiling.tiled_inference` once per flip of ``plan.flips`` (one pass without ``tta``) through
:func:`models.planning.planner.retry_smaller` (half the batch, then half the tile, on
:class:`~models.errors.DeviceOutOfMemoryError`). A global-pooling network gets its whole-image
pool means before each pass (:func:`prepare_context`); those are state on the predictor, so such
a model runs one pass at a time (``model.run_lock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from models.execution.batching import current_predictor
from models.execution.options import RunOptions
from models.planning.params import OutputKind
from models.planning.plan import RunPlan
from models.planning.planner import retry_smaller
from models.transforms.preprocess import make_reduce
from tiling import Placement, Resume, aligned_extent, context_halo

if TYPE_CHECKING:
    from models.backends import PoolingContext
    from models.model import Model

__all__ = ["CONTEXT_WHOLE_FACTOR", "MirroredTiles", "execute_plan", "prepare_context"]

#: Global-pooling models: images of at most this many tiles' voxels get their pool means from one
#: whole-image pass (exact and fastest; memory up to this many tiles' worth).
CONTEXT_WHOLE_FACTOR = 4


def flips_in_tiles(spec: Any) -> bool:
    """Whether ``tta=mirror`` flips each tile inside one pass (a centred placement averaging logits,
    as nnU-Net mirrors inside each window) rather than running one pass per flip of the image."""
    return spec.padding is not Placement.END and spec.output.tta_average == "logits"


def execute_plan(
    model: Model,
    x: npt.NDArray[np.float32],
    plan: RunPlan,
    *,
    out: npt.NDArray[Any] | None = None,
    options: RunOptions | None = None,
) -> tuple[npt.NDArray[Any], RunPlan]:
    """Run ``plan`` on the preprocessed ``x`` ``(C_in, *plan.spatial_shape)`` (see
    :meth:`models.Model.execute`, which checks the shapes first). ``options.tiled`` runs each pass
    elsewhere (a Dask cluster: no out-of-memory retry here, the cluster retries its tasks).

    Returns:
        the output (``(C_out, *spatial * scale)`` float32 probabilities or ``(1, *spatial *
        scale)`` uint8 labels; ``out`` itself when given, filled) and the plan that made it
        (a smaller one after an out-of-memory retry; the chunks' plan on a cluster).

    Raises:
        InferenceError: the backend failed (``DeviceOutOfMemoryError`` when nothing smaller fits).
        RunCancelledError: ``options.should_stop()`` returned true.
    """
    options = options or RunOptions()
    if options.on_plan is not None and options.tiled is None:
        options.on_plan(plan)
    spec = model.spec
    labels = plan.output == OutputKind.LABELS
    # nnU-Net mirrors inside each window (logits averaged there): flipping the whole image would move
    # a centred window's padding and origins, so a centred placement flips each tile instead
    in_tiles = flips_in_tiles(spec) and options.tiled is None
    if len(plan.flips) == 1 or in_tiles:
        target = out[None] if out is not None and labels else out
        reduce = make_reduce(spec.activation, plan.output.value)
        flips = plan.flips if len(plan.flips) > 1 else None
        result, plan = _tiled(model, x, plan, reduce, target, options, flips=flips)
        return result, plan
    # tta: the mean over the flipped passes (probabilities, or logits), then the output kind
    logits = spec.output.tta_average == "logits"
    per_pass = make_reduce("none" if logits else spec.activation, "probabilities")
    total: npt.NDArray[np.float32] | None = None
    whole = dataclasses.replace(options, resume=None)  # averaged in memory: every pass runs whole
    for axes in plan.flips:
        dims = tuple(1 + a for a in axes)
        flipped = np.ascontiguousarray(np.flip(x, dims)) if dims else x
        y, plan = _tiled(model, flipped, plan, per_pass, None, whole)
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
        return out, plan
    return result, plan


def _tiled(
    model: Model,
    x: npt.NDArray[np.float32],
    plan: RunPlan,
    reduce: Any,
    out: Any,
    options: RunOptions,
    flips: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[npt.NDArray[Any], RunPlan]:
    """One tiled pass, retried smaller when the device runs out of memory
    (:func:`models.planning.planner.retry_smaller`), or run by ``options.tiled`` elsewhere; the
    result and the plan that made it. ``flips``: each tile's prediction is the mean over these
    flips of the tile (:class:`MirroredTiles`)."""
    from tiling import tiled_inference

    spec = model.spec
    if options.tiled is not None:
        y, ran = options.tiled(model, x, plan, reduce, options)
        if options.replanned is not None and ran is not plan:
            options.replanned(ran)
        if out is None:
            return y, ran
        out[...] = y
        return out, ran

    def once(p: RunPlan, r: Resume | None) -> npt.NDArray[Any]:
        context = model.context
        # a shared batch (models.execution.batching) when the service bound one; never with pool-mean state
        base = model.predictor if context is not None else current_predictor(model.predictor)
        predictor: Any = base if flips is None else MirroredTiles(base, flips)  # tta in each window
        # Whole-image pool means are state on the predictor: one global-pooling run at a time.
        with model.run_lock if context is not None else contextlib.nullcontext():
            try:
                if context is not None:
                    prepare_context(model, context, x, p)
                result: npt.NDArray[Any] = tiled_inference(
                    x, predictor, grid=p.grid, batch_size=p.batch_size,
                    device=model.predictor.device, out=out, reduce=reduce, progress=options.progress,
                    should_stop=options.should_stop, resume=r, seam=options.seam, reuse=options.reuse,
                )  # fmt: skip
            finally:
                if context is not None:
                    context.clear_context()
        return result

    return retry_smaller(once, plan, spec, model.predictor.device, options)


class MirroredTiles:
    """A predictor whose output for a batch of tiles is the mean over ``flips`` of
    ``flip(predictor(flip(tiles)))``: nnU-Net's ``_internal_maybe_mirror_and_predict`` (logits).

    ``flips`` are tuples of spatial axes (``()`` for the tile itself), as :attr:`RunPlan.flips`.
    """

    def __init__(self, predictor: Any, flips: tuple[tuple[int, ...], ...]) -> None:
        self.predictor = predictor
        self.flips = flips
        self.device = predictor.device

    def __call__(self, batch: Any) -> Any:
        """``(B, C_in, *tile)`` -> ``(B, C_out, *tile * scale)`` float32, on the batch's device."""
        import torch

        total = None
        for axes in self.flips:
            dims = tuple(2 + a for a in axes)
            y = torch.as_tensor(self.predictor(torch.flip(batch, dims) if dims else batch)).float()
            y = torch.flip(y, dims) if dims else y
            total = y if total is None else total + y
        assert total is not None
        return total / len(self.flips)


def prepare_context(model: Model, context: PoolingContext, x: npt.NDArray[np.float32], plan: RunPlan) -> None:
    """Whole-image pool means for a global-pooling model, before the tiled pass.

    Pool means average feature maps whose reach is the whole receptive field: a halo calibrated
    for the output truncates them (text-det-2d, halo 188: the neck's pool means 2 % off, the
    output 0.43 off). So an image of at most :data:`CONTEXT_WHOLE_FACTOR` tiles' voxels gets one
    whole-image pass (exact), and a larger one tile-by-tile passes with the radius as halo (exact
    once tile > 2 * radius; else the largest halo the tile allows).
    """
    extent = aligned_extent(x.shape[1:], model.spec.alignment_per_axis)
    if math.prod(extent) <= CONTEXT_WHOLE_FACTOR * math.prod(plan.tile):
        context.prepare_context(x, tile=None, halo=None)
        return
    halo = context_halo(plan.halo, model.receptive_field(), plan.tile)
    context.prepare_context(x, tile=plan.tile, halo=halo, batch_size=plan.batch_size)

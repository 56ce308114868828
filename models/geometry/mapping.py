"""Map one input onto a model's grid, and the model's outputs back onto the input's own grid.

Shapes: ``C`` input channels, ``C_out`` output channels, ``S`` the input's spatial shape (array-axis
order, as decoded), ``S_r`` the same voxels reoriented to the spec's ``orientation``, ``B`` the
frame's box inside ``S_r``, ``S_m`` the model grid.

What the spec asks for, in order (each step skipped when it is a no-op):

1. ``orientation`` (3-D, with an affine): reorient ``S -> S_r`` (flips and transposes; exact).
2. ``spacing``: resample (linear) the whole ``S_r`` to the spec's voxel size, ``S_m``
   (:mod:`models.geometry.model_grid`); or ``frame``: crop the foreground's box ``B`` (+ margin) of ``S_r``
   and resample it (linear) to ``frame.shape`` = ``S_m`` (deepbet's brain frame).
3. Back: probabilities are resampled (linear) to ``S_r`` (or ``B``), then inverse-reoriented;
   labels are the argmax of those resampled probabilities, made slab by slab
   (:mod:`models.geometry.resample`), so no ``C_out``-channel float volume exists at the input's
   resolution. Outside a frame's box the output is label 0: probability 1 on channel 0 (0 for a
   one-channel output).

``spacing=native`` (``native=True``) skips step 2: no resampling, no frame; reorientation stays.
Inputs without an affine (PNG, JPEG, TIFF: their pixel size is unknown) are never reoriented nor
resampled; a spec with neither ``orientation``, ``spacing`` nor ``frame`` never reads the affine.
A spec with any of them always gives the network float32 (resampling makes floats, and
``unit_range`` scales floats by their min-max but integers by their dtype's range, which must not
depend on whether this input happened to need resampling).

Memory, for ``output=labels`` with resampling: the model-grid input ``4 * C * prod(S_m)`` bytes (plus
the reoriented ``4 * C * prod(S_r)`` while it is made, when a reorientation or a frame needs it),
the model-grid probabilities ``4 * C_out * prod(S_m)``, the uint8 labels ``prod(S)`` and one slab
(``models.geometry.model_grid.DEFAULT_SLAB_BYTES``, 64 MiB).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from models.errors import InputError
from models.execution.options import RunOptions
from models.geometry.model_grid import DEFAULT_SLAB_BYTES, GeometryError, GeometryPlan, plan_geometry
from models.geometry.resample import _oriented, from_model_labels, from_model_probabilities, to_model
from models.planning.params import InferenceParams, OutputKind, Spacing
from models.spec import ModelSpec

if TYPE_CHECKING:
    from models.model import Model
    from models.planning.plan import RunPlan
    from tiling import Resume, SeamStats

__all__ = [
    "FOREGROUND_LEVEL",
    "GridMapping",
    "MappedRun",
    "PLANE_FRACTION",
    "foreground_box",
    "header_model_shape",
    "plan_mapping",
    "run_mapped",
]

logger = logging.getLogger(__name__)

#: Foreground: above this fraction of the 0.5-99.5 % intensity range.
FOREGROUND_LEVEL = 0.1
#: A plane belongs to the box when more than this fraction of it is foreground (deepbet's
#: ``get_bbox`` threshold).
PLANE_FRACTION = 0.02


def foreground_box(
    volume: npt.NDArray[Any],
    *,
    margin: float = 0.1,
    level: float = FOREGROUND_LEVEL,
    plane_fraction: float = PLANE_FRACTION,
) -> tuple[slice, ...]:
    """The foreground's bounding box, widened by ``margin`` of its size per side and clipped.

    Foreground: voxels above ``lo + level * (hi - lo)`` with ``lo, hi`` the 0.5 and 99.5 %
    percentiles. An axis keeps the planes whose foreground fraction exceeds ``plane_fraction``;
    centre and size are rounded as deepbet's ``get_bbox_with_margin`` does.

    Args:
        volume: ``(*S)`` intensities, any numeric dtype (NaN counts as 0, infinities as the
            largest finite values; a float32 copy is made).

    Returns:
        One slice per axis.

    Raises:
        InputError: no plane has enough foreground (a blank volume).

    Source:
        deepbet 1.0.2 ``deepbet/utils.py`` (``get_bbox``, ``get_bbox_with_margin``; MIT), with a
        threshold in place of its bounding-box network.
    """
    volume = np.nan_to_num(np.asarray(volume, dtype=np.float32))
    lo, hi = (float(v) for v in np.percentile(volume, [0.5, 99.5]))
    fg = volume > lo + level * (hi - lo)
    box = []
    for axis, length in enumerate(fg.shape):
        others = tuple(a for a in range(fg.ndim) if a != axis)
        planes = np.flatnonzero(fg.mean(axis=others) > plane_fraction)
        if planes.size == 0:
            raise InputError(f"no foreground to frame (a blank volume along axis {axis})")
        centre = round((planes[-1] + 1 + planes[0]) / 2)
        size = round((planes[-1] + 1 - planes[0]) * (1 + 2 * margin))
        box.append(slice(max(0, int(centre - size / 2)), min(length, int(centre + size / 2))))
    return tuple(box)


@dataclass(frozen=True, slots=True)
class GridMapping:
    """How one input maps onto a model's grid (:func:`plan_mapping`).

    Attributes:
        geometry: ``S -> S_r`` (reorientation) and, without a frame, ``S_r -> S_m`` (resampling).
        box: the frame's box in ``S_r`` (one slice per axis), or ``None``.
        frame: ``B -> S_m`` (the box resampled to the frame's shape), or ``None``.
        as_float: the model gets float32 even when nothing moves (the spec has geometry, so
            the input is float32 whenever it is resampled: ``unit_range`` must not depend on
            whether it was).
    """

    geometry: GeometryPlan
    box: tuple[slice, ...] | None = None
    frame: GeometryPlan | None = None
    as_float: bool = False

    @property
    def model_shape(self) -> tuple[int, ...]:
        """``S_m``: the spatial shape the network's plan is made on."""
        return self.frame.model_shape if self.frame is not None else self.geometry.model_shape

    def extra_bytes(self, out_channels: int, *, labels: bool) -> int:
        """Bytes mapping back holds beyond the run's own (:func:`models.planning.cost.peak_bytes` of
        its plan).

        With resampling the run ends in ``C_out``-channel float32 probabilities on the model grid
        (``4 * C_out * prod(S_m)`` instead of ``prod(S_m)`` uint8 labels), then the input-grid
        output (``prod(S)`` labels or ``4 * C_out * prod(S)``) and one slab; without it, nothing.
        """
        if self.is_identity:
            return 0
        model, native = math.prod(self.model_shape), math.prod(self.geometry.spatial_shape)
        back = native if labels else 4 * out_channels * native
        return 4 * out_channels * model - (model if labels else 0) + back + DEFAULT_SLAB_BYTES

    @property
    def is_identity(self) -> bool:
        """Whether the model grid is the input's own (nothing to map, either way)."""
        return self.frame is None and self.geometry.is_identity

    def to_model(self, data: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``(C, *S)`` -> ``(C, *S_m)`` float32 (``data`` itself when :attr:`is_identity` and not
        :attr:`as_float`)."""
        if self.is_identity:
            return np.asarray(data, dtype=np.float32) if self.as_float else data
        x = to_model(data, self.geometry)
        if self.frame is None or self.box is None:
            return x
        return to_model(x[(slice(None), *self.box)], self.frame)

    def labels(self, pred: npt.NDArray[Any], *, activation: str = "none") -> npt.NDArray[np.uint8]:
        """``(C_out, *S_m)`` model outputs -> ``(*S)`` uint8 labels (argmax after resampling back)."""
        if self.frame is None or self.box is None:
            return from_model_labels(pred, self.geometry, activation=activation)
        inside = from_model_labels(pred, self.frame, activation=activation)
        out = np.zeros(self.geometry.spatial_shape, dtype=inside.dtype)
        _oriented(out[None], self.geometry.ornt)[0][self.box] = inside
        return out

    def probabilities(self, pred: npt.NDArray[Any], *, activation: str = "none") -> npt.NDArray[np.float32]:
        """``(C_out, *S_m)`` model outputs -> ``(C_out, *S)`` float32, resampled back (linear)."""
        if self.frame is None or self.box is None:
            return from_model_probabilities(pred, self.geometry, activation=activation)
        inside = from_model_probabilities(pred, self.frame, activation=activation)
        out = np.zeros((inside.shape[0], *self.geometry.spatial_shape), dtype=np.float32)
        if inside.shape[0] > 1:
            out[0] = 1.0  # outside the box: label 0
        _oriented(out, self.geometry.ornt)[(slice(None), *self.box)] = inside
        return out


class _HasShape(Protocol):
    """What :func:`plan_mapping` reads of an input it plans no frame for: its shape."""

    @property
    def shape(self) -> tuple[int, ...]: ...


def plan_mapping(
    data: npt.NDArray[Any] | _HasShape,
    affine: npt.ArrayLike | None,
    spec: ModelSpec,
    *,
    native: bool = False,
) -> GridMapping:
    """Plan how ``data`` maps onto ``spec``'s grid (see the module docstring).

    Args:
        data: ``(C, *S)`` the input as the model takes it (``len(S) == spec.spatial_dims``); a
            frame's box is found on its first channel (without a frame, or with ``native``, only
            ``data.shape`` is read: any object with a shape will do).
        affine: the input's voxel-to-world affine (``(4, 4)``, NIfTI), or ``None`` (no geometry).
        spec: the model's spec (``orientation``, ``spacing``, ``frame``).
        native: the request's ``spacing=native``: no resampling, no frame.

    Raises:
        GeometryError: an affine that cannot be planned (zero or non-finite columns).
        InputError: a blank volume for a frame.
    """
    shape = tuple(int(n) for n in data.shape[1:])
    resample = spec.spacing is not None or spec.frame is not None
    orientation = spec.orientation if len(shape) == 3 else None
    as_float = resample or spec.orientation is not None
    if affine is None or not (orientation or (resample and not native)):
        return GridMapping(plan_geometry(shape), as_float=as_float)
    spacing = None if native or spec.frame is not None else spec.spacing
    geometry = plan_geometry(
        shape, affine, orientation=orientation, spacing_mm=spacing, resampling=spec.resampling
    )
    if native or spec.frame is None:
        return GridMapping(geometry, as_float=as_float)
    assert isinstance(data, np.ndarray)  # a frame's box is found on the voxels
    box = foreground_box(_oriented(data[:1], geometry.ornt)[0], margin=spec.frame.margin)
    frame = _resize_plan([b.stop - b.start for b in box], spec.frame.shape)
    logger.debug("frame: box %s of %s -> %s", box, geometry.reoriented_shape, frame.model_shape)
    return GridMapping(geometry, box, frame, as_float)


def header_model_shape(
    spatial_shape: Sequence[int], affine: npt.ArrayLike | None, spec: ModelSpec, *, native: bool = False
) -> tuple[int, ...]:
    """``S_m`` from an input's header alone (shape and affine): what :func:`plan_mapping` will give.

    A frame's shape is its own; a spacing's is planned from the affine. When the affine cannot be
    planned this is the header's shape (the run refuses the input with the reason).
    """
    shape = tuple(int(n) for n in spatial_shape)
    if affine is None or native:
        return shape
    if spec.frame is not None:
        return tuple(spec.frame.shape)
    if spec.spacing is None:
        return shape
    orientation = spec.orientation if len(shape) == 3 else None
    try:
        geometry = plan_geometry(
            shape, affine, orientation=orientation, spacing_mm=spec.spacing, resampling=spec.resampling
        )
        return geometry.model_shape
    except GeometryError:
        return shape


def _resize_plan(box_shape: Sequence[int], target: Sequence[int]) -> GeometryPlan:
    """A plan that resamples a ``box_shape`` array to exactly ``target`` (linear, one field of view)."""
    spacing = [b / t for b, t in zip(box_shape, target, strict=True)]
    plan = plan_geometry(box_shape, zooms_mm=[1.0] * len(box_shape), spacing_mm=spacing)
    if plan.model_shape != tuple(target):  # pragma: no cover - round(b / (b / t)) == t
        raise AssertionError(f"frame resize {tuple(box_shape)} -> {plan.model_shape}, expected {target}")
    return plan


@dataclass(frozen=True, slots=True)
class MappedRun:
    """One run on the input's own grid (:func:`run_mapped`).

    Attributes:
        result: ``(*S)`` uint8 labels or ``(C_out, *S)`` float32 probabilities (float16 when the
            spec's output dtype says so and nothing was resampled).
        plan: the plan that ran, on the model grid ``S_m``.
        mapping: how the input mapped onto the model grid.
        seam: the measured disagreement of overlapping tiles, when the model reports it
            (:meth:`Model.seam_stats`), else ``None``.
    """

    result: npt.NDArray[Any]
    plan: RunPlan
    mapping: GridMapping
    seam: SeamStats | None


def run_mapped(
    model: Model,
    data: npt.NDArray[Any],
    affine: npt.ArrayLike | None,
    params: InferenceParams | None = None,
    *,
    check: Callable[..., None] | None = None,
    start: Callable[[RunPlan], tuple[Any, Resume]] | None = None,
    options: RunOptions | None = None,
    memory_budget: int | None = None,
    input_bytes: int = 0,
) -> MappedRun:
    """Map ``data`` onto the model's grid, preprocess, plan once, run, and map the output back.

    Without resampling, labels come from the engine's ``reduce`` (no float volume at all); with
    it, the run gives model-grid probabilities and :class:`GridMapping` resamples them back, slab
    by slab for labels (memory: see the module docstring).

    Args:
        data: ``(C, *S)`` the input, any numeric dtype, ``len(S) == model.spec.spatial_dims``.
        affine: its ``(4, 4)`` voxel-to-world affine, or ``None`` (PNG, TIFF: native grid).
        params: the request's parameters (``spacing=native``: no resampling).
        check: called with the plan, the bytes the mapping and the seam meter add
            (:meth:`GridMapping.extra_bytes`) and whether preprocessing copied the input, before
            the network sees a tile (the server's budget).
        start: called with the plan the network runs (on the model grid: its ``output`` is
            ``probabilities`` when the mapping resamples) for the ``out`` array and the
            :class:`tiling.Resume` that continue a stopped run (a job's checkpoint).
        options: how the run is watched (:class:`~models.execution.options.RunOptions`: its
            ``progress``, ``should_stop``, ``on_plan``; the run adds ``resume``, ``seam`` and
            ``replanned``). Its ``tiled`` runs each tiled pass elsewhere
            (:class:`models.model.TiledPass`, e.g. on a Dask cluster) instead of in this process;
            everything before and after it is the same. No seam is measured then (``seam`` is
            ``None``), and ``start`` must be ``None``.
        memory_budget, input_bytes: the budget the plan is sized within and the decoded input's
            bytes held beside the run (:meth:`Model.plan`).

    Raises:
        InputError: the input does not fit the model (``GeometryError`` for its geometry).
        GridError, InferenceError, RunCancelledError: as :meth:`Model.execute`.
    """
    p = params or InferenceParams()
    spec = model.spec
    mapping = plan_mapping(data, affine, spec, native=p.spacing == Spacing.NATIVE)
    x = model.preprocess(mapping.to_model(data))
    copies = not np.shares_memory(x, data)
    wants_labels = (p.output or spec.defaults.output) == OutputKind.LABELS
    held = input_bytes + mapping.extra_bytes(spec.out_channels, labels=wants_labels)
    plan = model.plan(
        x.shape[1:], p, sample=x, memory_budget=memory_budget, input_bytes=held, copies_input=copies
    )
    options = options or RunOptions()
    seam = model.seam_stats(plan) if options.tiled is None else None
    if check is not None:
        labels = plan.output == OutputKind.LABELS
        extra = mapping.extra_bytes(spec.out_channels, labels=labels)
        if seam is not None:  # the meter's running sum and count over one row of tiles
            grid = plan.grid
            extra += 4 * (spec.out_channels + 1) * grid.out_tile_shape[0] * math.prod(grid.out_shape[1:])
        check(plan, extra, copies)
    executed = plan if mapping.is_identity else dataclasses.replace(plan, output=OutputKind.PROBABILITIES)
    out, resume = start(executed) if start is not None else (None, None)
    ran = [executed]  # a smaller plan after the device ran out of memory
    told = options.replanned

    def replanned(smaller: RunPlan) -> None:
        ran.append(smaller)
        if told is not None:
            told(smaller)

    reuse = options.reuse
    if reuse is None and options.tiled is None:
        from tiling import TileReuse

        reuse = TileReuse()  # constant tiles run once (tiling.reuse), counted
    run = dataclasses.replace(options, resume=resume, seam=seam, replanned=replanned, reuse=reuse)
    pred = model.execute(x, executed, out=out, options=run)
    skipped = None if reuse is None else reuse.n_reused
    plan = dataclasses.replace(ran[-1], output=plan.output, skipped=skipped)
    if mapping.is_identity:
        return MappedRun(pred, plan, mapping, seam)
    del x
    if plan.output == OutputKind.LABELS:
        result: npt.NDArray[Any] = mapping.labels(pred)
    else:
        result = mapping.probabilities(pred)
    return MappedRun(result, plan, mapping, seam)

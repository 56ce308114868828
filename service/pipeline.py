"""The one orchestration of a request: decode, fit, map to the model grid, preprocess, plan, tiled
run, map back, postprocess, encode.

The server (in its executor thread, for a request or a job) and ``tilewise infer`` all call
:func:`run_file`, so their outputs are identical for the same file and parameters. The
:class:`~models.RunPlan` is made once, on the preprocessed image, before the run; the result
carries it to the metrics (``tilewise_tiles_total``) and the response (``X-Tilewise-Plan``, and
``X-Tilewise-Seam`` when the model reports its seam). Nothing plans again after a run.

Geometry (:mod:`models.geometry.mapping`): a NIfTI is reoriented to the spec's ``orientation`` and resampled
to its ``spacing`` (or its ``frame``) before preprocessing, and the output comes back on the input's
exact grid, header and affine (labels as the argmax of probabilities resampled back, slab by slab).
``spacing=native`` skips the resampling. 2D images (PNG, JPEG, TIFF) carry no affine and no pixel
size: they always run on their own grid, as ``spacing=native``. A job's checkpoint holds the
network's output on the model grid.

Layout rules (DESIGN.md "Interfaces in detail"): a 2D image ``(C, H, W)`` goes to 2D models; a
NIfTI ``(C, X, Y, Z)`` goes to 3D models, and also to 2D models when ``Z == 1`` (a single slice),
the slice axis being restored on output. A 3D model refuses a true 2D image and a 2D model a 3D
volume (:class:`~service.errors.UnusableInputError`, HTTP 422). A 4D NIfTI is accepted only by a
model with as many input channels as it has volumes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.codecs import OUTPUT_FORMATS, DecodedVolume, decode, default_format, encode
from service.errors import BadParameterError, UnusableInputError
from service.precheck import (
    Limits,
    check_input,
    copies_input,
    dicom_options,
    input_bytes,
    model_shape,
    precheck,
    streamed_check,
)
from service.stages import RunOptions

if TYPE_CHECKING:
    from models import InferenceParams, Model, RunPlan
    from models.geometry.mapping import MappedRun
    from service.budget import Budget
    from service.stages import Prepared
    from tiling import Resume, SeamStats

__all__ = [
    "MEDIA_TYPES",
    "Checkpoint",
    "InferenceResult",
    "Limits",
    "check_input",
    "copies_input",
    "fit_to_model",
    "input_bytes",
    "model_shape",
    "plan_format",
    "precheck",
    "prepare_file",
    "run_file",
    "run_prepared",
    "run_volume",
]

logger = logging.getLogger(__name__)

#: Content types of the output formats.
MEDIA_TYPES = {
    "nii.gz": "application/gzip",
    "nii": "application/octet-stream",
    "png": "image/png",
    "tiff": "image/tiff",
    "npy": "application/octet-stream",
    "dicom-seg": "application/dicom",
    "ome.tiff": "image/tiff",
    "geojson": "application/geo+json",
    "ome.zarr": "application/zip",
}


class Checkpoint(Protocol):
    """Where a resumable run keeps its output (a job's memmap, :mod:`service.jobs.checkpoint`)."""

    def start(
        self, plan: RunPlan, shape: tuple[int, ...], dtype: np.dtype[Any], order: str = "C"
    ) -> tuple[Any, Resume]:
        """The ``out`` array of ``shape`` and ``dtype`` for ``plan``, in memory ``order`` (``"C"``, or
        ``"F"`` for the Fortran order of a NIfTI output), holding the rows a stopped run of the same
        plan finished, and the :class:`tiling.Resume` that continues from them."""


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """Where the output went, what it is, and the plan that made it."""

    path: Path
    format: str
    media_type: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    output_dtype: str
    output_kind: str
    seconds: float
    plan: RunPlan
    size_bytes: int
    model_shape: tuple[int, ...] = ()
    seam: SeamStats | None = None
    #: Seconds of the stages of a streamed run (``prepare``, ``execute``, ``finish``); empty for a
    #: whole-image run (decoded, run and encoded in one go).
    stages: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def n_tiles(self) -> int:
        """Tiles of the plan that ran."""
        return self.plan.n_tiles


def fit_to_model(volume: DecodedVolume, spec: Any) -> tuple[np.ndarray, bool]:
    """The array to give the model, and whether a singleton slice axis was dropped for it.

    Raises:
        UnusableInputError: wrong dimensionality, a 4D NIfTI whose volume count differs from the
            model's input channels, or data without a single finite value.
    """
    dims = int(spec.spatial_dims)
    data = volume.data
    dropped = False
    if dims == 2 and volume.spatial_dims == 3:
        if not volume.single_slice:
            raise UnusableInputError(
                f"model {spec.name!r} is 2D; the input is a 3D volume of spatial shape "
                f"{volume.spatial_shape} (a NIfTI with one slice, (X, Y, 1), would be an image)"
            )
        data, dropped = data[..., 0], True
    elif dims == 3 and volume.spatial_dims == 2:
        raise UnusableInputError(
            f"model {spec.name!r} is 3D; the input is a 2D {volume.kind.upper()} image of shape "
            f"{volume.spatial_shape} (send a volume, or a NIfTI (X, Y, 1) for a one-slice volume)"
        )
    elif dims != volume.spatial_dims:
        raise UnusableInputError(
            f"model {spec.name!r} has {dims} spatial axes; the input has {volume.spatial_dims}"
        )
    if volume.kind == "nifti" and volume.channels > 1 and volume.channels != int(spec.in_channels):
        raise UnusableInputError(
            f"4D NIfTI with {volume.channels} volumes (shape {volume.info.get('shape')}); model "
            f"{spec.name!r} takes {spec.in_channels} channel(s) of {dims}D data"
        )
    if data.dtype.kind == "f" and data.size and not np.isfinite(data).any():
        raise UnusableInputError("the input holds no finite value (all NaN or infinite)")
    return data, dropped


def plan_format(volume: DecodedVolume, spec: Any, params: InferenceParams, output_kind: str) -> str:
    """The output format: the requested one, else the spec's default, else by input kind.

    Raises:
        BadParameterError: ``png`` for a 3D output; ``dicom-seg`` for an input that is no DICOM
            series, or a series resampled for its gantry tilt.
    """
    fmt = params.format or spec.defaults.format or default_format(volume, output_kind)
    fmt = str(fmt)
    if fmt == "dicom-seg":
        from service.codecs.dicom_seg import check_seg

        check_seg(volume, spec, params, output_kind)
    if fmt == "png" and spec.spatial_dims != 2:
        raise BadParameterError(
            f"format=png needs a 2D output; model {spec.name!r} is 3D (use nii.gz or tiff)"
        )
    return fmt


def run_volume(
    model: Model,
    volume: DecodedVolume,
    params: InferenceParams,
    *,
    budget: Budget | None = None,
    options: RunOptions | None = None,
    checkpoint: Checkpoint | None = None,
    limits: Limits | None = None,
) -> MappedRun:
    """Run ``model`` on a decoded volume; the result is on the volume's own grid.

    The plan is sized within ``limits.memory_budget`` and checked against ``budget`` (default
    ``limits.budget``) before the network sees a tile. ``options``
    (:class:`~models.execution.options.RunOptions`): ``should_stop`` is asked before every batch
    (the run ends with :class:`tiling.RunCancelledError`); ``progress`` shows a bar of tiles on
    stderr, or is called with each batch's tile count; ``tiled`` runs the network's tiled passes
    elsewhere (a Dask cluster, :class:`service.cluster.DaskPass`) and takes no ``checkpoint``. With
    a ``checkpoint`` the network's output goes to its array, and a run of the same plan that
    stopped continues from its last finished tile row.

    Returns:
        The :class:`~models.geometry.mapping.MappedRun`: its ``result`` is uint8 ``(*spatial)`` labels or
        float32 ``(C_out, *spatial)`` values with ``spatial == volume.spatial_shape``; its
        ``plan`` the plan that ran (on the model grid), its ``seam`` the measured seam or ``None``.
    """
    from models.geometry.mapping import run_mapped
    from models.transforms.preprocess import label_dtype

    spec = model.spec
    data, dropped = fit_to_model(volume, spec)
    budget = budget if budget is not None else (None if limits is None else limits.budget)

    def check(plan: RunPlan, extra_bytes: int, copies: bool = True) -> None:
        if budget is not None:
            held = volume.data.nbytes + extra_bytes
            budget.check_plan(plan, int(spec.in_channels), int(spec.out_channels), input_bytes=held,
                              footprint=model.footprint(), copies_input=copies)  # fmt: skip

    def start(plan: RunPlan) -> tuple[Any, Resume]:
        assert checkpoint is not None
        return checkpoint.start(plan, *_output_layout(spec, plan))

    run = run_mapped(
        model,
        data,
        volume.affine,
        params,
        check=check,
        start=start if checkpoint is not None else None,
        options=options,
        memory_budget=None if limits is None else limits.memory_budget,
        input_bytes=volume.data.nbytes,
    )
    result = np.asarray(run.result)
    if dropped:
        result = result[..., None]
    if run.plan.output == "labels":
        result = result.astype(label_dtype(int(spec.out_channels)), copy=False)
    elif result.dtype != np.float32:
        result = result.astype(np.float32)
    return dataclasses.replace(run, result=result)


def _output_layout(spec: Any, plan: RunPlan) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Shape and dtype of :meth:`models.Model.execute`'s result for ``plan``."""
    spatial = tuple(plan.grid.out_shape)
    if plan.output == "labels":
        from models.transforms.preprocess import label_dtype

        return spatial, label_dtype(int(spec.out_channels))
    dtype = np.float16 if spec.output_dtype == "float16" else np.float32
    return (int(spec.out_channels), *spatial), np.dtype(dtype)


def run_file(
    model: Model,
    source: Path,
    target_stem: Path,
    params: InferenceParams,
    *,
    limits: Limits | None = None,
    options: RunOptions | None = None,
    checkpoint: Checkpoint | None = None,
) -> InferenceResult:
    """Check ``source``'s header, decode it, run ``model``, write the output next to ``target_stem``.

    Args:
        model: a loaded ``models.Model``.
        source: the input file (format detected by content).
        target_stem: output path without suffix; the format's suffix is appended.
        params: validated inference parameters.
        limits: what the header may declare (checked before decoding) and the plan may cost
            (checked before running); ``None``: no limits.
        options: how the run is watched (:class:`~models.execution.options.RunOptions`):
            ``should_stop`` (asked before every batch; true stops the run,
            ``tiling.RunCancelledError``), ``progress`` (a bar of tiles on stderr, or a callable
            called with each batch's tile count: the server's ``tilewise_tiles_total``), ``tiled``
            (the network's tiled passes elsewhere, a Dask cluster: :mod:`service.cluster`;
            decoding, geometry, preprocessing, TTA, output kind and encoding stay here, so the file
            is the same; takes no ``checkpoint``).
        checkpoint: keeps the network's output on disk so that a stopped run resumes (jobs).
    """
    started = time.perf_counter()
    limits = limits or Limits()
    options = options or RunOptions()
    spec = model.spec
    if options.tiled is None:  # read by region and written as it finishes, when the input allows
        prepared = prepare_file(model, source, target_stem, params, limits=limits, checkpoint=checkpoint)
        if prepared is not None:
            return run_prepared(prepared, options)
    else:
        from service.stages import output_format
        from service.writers import check_output_dtype

        header = check_input(spec, source, limits, params)
        check_output_dtype(output_format(header.kind, spec, params), params, spec)
    volume = decode(
        source,
        max_voxels=limits.max_voxels,
        max_image_pixels=limits.max_image_pixels,
        max_bytes=limits.max_bytes,
        dicom=dicom_options(params),
    )
    output_kind = str(params.output or spec.defaults.output)
    fmt = plan_format(volume, spec, params, output_kind)  # checked before the (long) run
    run = run_volume(model, volume, params, options=options, checkpoint=checkpoint, limits=limits)
    array, plan = run.result, run.plan
    if run.plan.output != "labels":
        from service.writers import output_dtype, to_output_dtype

        array = to_output_dtype(array, output_dtype(params, False))
    from models.transforms.preprocess import count_nonfinite

    bad = count_nonfinite(volume.data)
    if bad:  # replaced by 0 after preprocessing (models.transforms.preprocess)
        nonfinite = f"{bad} non-finite input voxel(s) (NaN or inf) were replaced by 0 after preprocessing"
        plan = dataclasses.replace(
            plan, warning=nonfinite if not plan.warning else f"{plan.warning}; {nonfinite}"
        )
    if plan.warning:
        logger.warning("model %s: %s", spec.name, plan.warning)
    path = target_stem.with_name(target_stem.name + OUTPUT_FORMATS[fmt])
    from service.provenance import provenance_of

    seg_type = None if params.seg_type is None else str(params.seg_type.value)
    encode(
        volume,
        array,
        fmt,
        path,
        provenance=provenance_of(spec, plan.header(), output_kind),
        seg_type=seg_type,
    )
    for note in volume.info.get("notes", ()):
        logger.warning("input: %s", note)
    seconds = time.perf_counter() - started
    logger.info(
        "model=%s input=%s%s output=%s%s %s plan=%s in %.3fs",
        spec.name,
        volume.kind,
        tuple(volume.data.shape),
        fmt,
        tuple(array.shape),
        array.dtype,
        plan.header(),
        seconds,
    )
    return InferenceResult(
        path=path,
        format=fmt,
        media_type=MEDIA_TYPES[fmt],
        input_shape=tuple(int(n) for n in volume.data.shape),
        output_shape=tuple(int(n) for n in array.shape),
        output_dtype=str(array.dtype),
        output_kind=output_kind,
        seconds=seconds,
        plan=plan,
        size_bytes=path.stat().st_size,
        model_shape=run.mapping.model_shape,
        seam=run.seam,
    )


def prepare_file(
    model: Model,
    source: Path,
    target_stem: Path,
    params: InferenceParams,
    *,
    limits: Limits | None = None,
    checkpoint: Checkpoint | None = None,
) -> Prepared | None:
    """The first stage of a streamed request (:func:`service.stages.prepare`), or ``None`` when
    ``source`` is run whole (:func:`run_file` then decodes it). The header is checked either way
    (the bomb limits only for inputs decoded whole).

    Raises:
        PayloadTooLargeError, UnusableInputError, DecodeError, BadParameterError,
        InsufficientStorageError, OverBudgetError, MemoryBudgetError: see :func:`run_file`.
    """
    from service.stages import output_format, prepare
    from service.writers import check_output_dtype

    limits = limits or Limits()
    spec = model.spec
    streams = streamed_check(model, source, params)
    header = check_input(spec, source, limits, params, streamed=streams)
    fmt = output_format(header.kind, spec, params)
    check_output_dtype(fmt, params, spec)
    if not streams(header):
        return None
    path = target_stem.with_name(target_stem.name + OUTPUT_FORMATS[fmt])
    return prepare(model, source, header, params, limits, path, fmt, checkpoint)


def run_prepared(prepared: Prepared, options: RunOptions | None = None) -> InferenceResult:
    """The last two stages of a streamed request in this thread: execute, then finish."""
    from service.stages import execute, finish

    try:
        execute(prepared, options)
    except BaseException:
        path = prepared.target.path
        prepared.close()
        path.unlink(missing_ok=True)
        raise
    result: InferenceResult = finish(prepared)
    return result

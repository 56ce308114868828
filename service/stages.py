"""A request in three stages, with memory that follows the tile (issue 20 items 1-4).

For an input that can be read by region (:mod:`service.regions`), a model whose preprocessing is
local (:mod:`models.transforms.streamed`) on its own grid, and an output that can be written as it
finishes (:mod:`service.writers`), a request runs as three stages instead of decode-run-encode:

- :func:`prepare`: the header (probed once, by admission), the disk check (507 when the disk
  cannot hold the output and temporaries), the region source and its preprocessing statistics
  (one streaming pass, when a step needs them), one plan, checked against the budget, and the
  output file opened on disk;
- :func:`execute`: only the tiled network passes, the plan's grid handed to the engine
  (``tiling.tiled_inference(..., grid=)``), tiles read by region and written to the output file
  as they finish;
- :func:`finish`: the file completed (compressed, tiled) and described (:class:`InferenceResult`).

Nothing input-sized is held in memory: the peak is the plan's (a batch of tiles, a row of the
merger) plus the slabs of the statistics pass. :func:`why_not_streamed` says, in a sentence, why a
request takes the whole-image path instead (:func:`service.pipeline.run_file` asks it); the two
paths give the same file for the same request.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.execution.options import RunOptions
from service.errors import InsufficientStorageError

if TYPE_CHECKING:
    from models import InferenceParams, Model, RunPlan
    from service.codecs import Probe
    from service.precheck import Limits
    from service.writers import OutputTarget
    from tiling import SeamStats

__all__ = [
    "Prepared",
    "RunOptions",
    "check_disk",
    "disk_bytes",
    "execute",
    "finish",
    "output_format",
    "prepare",
    "result_headers",
    "why_not_streamed",
]

logger = logging.getLogger(__name__)


def output_format(kind: str, spec: Any, params: InferenceParams) -> str:
    """The output format from the input's kind alone (:func:`service.pipeline.plan_format`'s
    choice): the requested one, else the spec's default, else ``nii.gz`` for NIfTI, ``png`` for
    labels, ``tiff`` for probabilities."""
    output = str(params.output or spec.defaults.output)
    fmt = params.format or spec.defaults.format
    if fmt is not None:
        return str(fmt)
    if kind == "nifti":
        return "nii.gz"
    return "png" if output == "labels" else "tiff"


def why_not_streamed(
    model: Model, header: Probe, params: InferenceParams, fmt: str, source: Path, *, whole_only: bool = False
) -> str | None:
    """Why this request is decoded whole rather than streamed (a sentence), or ``None``.

    ``whole_only``: the caller needs the whole-image path (a job's slab checkpoint, a Dask pass).

    Raises:
        UnusableInputError: a slide asked at another level or mpp than level 0 by a request that
            cannot be streamed (:func:`service.slides.whole_slide_check`).
    """
    from service.slides import whole_slide_check

    reason = _why_not_streamed(model, header, params, fmt, source, whole_only=whole_only)
    whole_slide_check(header, model.spec, params.merged(model.spec.defaults), reason)
    return reason


def _why_not_streamed(
    model: Model, header: Probe, params: InferenceParams, fmt: str, source: Path, *, whole_only: bool = False
) -> str | None:
    from models.planning.params import OutputKind, Spacing, Tta
    from models.transforms.streamed import why_not_local
    from service.regions import why_not_regions
    from service.writers import why_not_streamed_output

    spec = model.spec
    p = params.merged(spec.defaults)
    dims = int(spec.spatial_dims)
    if whole_only:
        return "a checkpointed or distributed run"
    if header.spatial_dims != dims or (header.kind == "nifti" and dims != 3):
        return "the input's dimensionality differs from the model's (a one-slice volume, a 2D NIfTI)"
    if header.kind == "nifti" and header.channels > 1:
        return "a 4D NIfTI"
    geometry = spec.frame is not None or (spec.spacing is not None and p.spacing != Spacing.NATIVE)
    if header.kind == "nifti" and (geometry or (spec.orientation is not None and dims == 3)):
        return "the model resamples or reorients the input (its own grid)"
    if p.tta is not None and p.tta != Tta.NONE:
        return "test-time augmentation averages whole passes"
    if p.halo == "auto":
        return "halo=auto calibrates on the whole preprocessed image"
    if model.context is not None:
        return "a global-pooling model takes whole-image pool means"
    from service.slides import slide_info

    reason = why_not_local(spec) or why_not_streamed_output(fmt, dims)
    if reason is None and slide_info(header) is None:  # a slide is read by region (service.slides)
        reason = why_not_regions(source, header)
    if reason is not None:
        return reason
    if p.output not in (OutputKind.LABELS, OutputKind.PROBABILITIES):  # pragma: no cover - enum
        return f"output {p.output}"
    return None


def disk_bytes(
    header: Probe, fmt: str, out_channels: int, labels: bool, gzipped: bool, dtype: Any = None
) -> int:
    """Bytes of disk a streamed run needs: the output (:func:`service.writers.output_disk_bytes`)
    plus a ``.nii.gz`` input inflated to a temporary ``.nii``."""
    from service.writers import output_disk_bytes

    spatial = tuple(int(n) for n in header.spatial_shape)
    dtype = dtype or (np.uint8 if labels else np.float32)
    out = output_disk_bytes(fmt, spatial, 1 if labels else out_channels, dtype)
    return out + (int(header.nbytes) if gzipped else 0)


def check_disk(folder: Path, needed: int) -> None:
    """Refuse a run whose output and temporaries the disk under ``folder`` cannot hold.

    Raises:
        InsufficientStorageError: fewer free bytes than ``needed`` (507).
    """
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise InsufficientStorageError(
            f"the output and temporaries need {needed / 2**20:.0f} MiB of disk; "
            f"{free / 2**20:.0f} MiB are free"
        )


@dataclass
class Prepared:
    """A request ready for the device: what :func:`execute` runs and :func:`finish` completes."""

    model: Model
    header: Probe
    params: InferenceParams
    fmt: str
    output_kind: str
    plan: RunPlan
    source: Any
    target: OutputTarget
    workdir: Path
    seam: SeamStats | None
    started: float
    ran: RunPlan | None = None
    #: A job's checkpoint array (the network's output, resumable) and where its run continues;
    #: :func:`finish` copies it into the output slab by slab.
    kept: Any = None
    resume: Any = None
    #: Seconds of each stage so far (``prepare``, ``execute``, ``finish``).
    stages: dict[str, float] = dataclasses.field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        """Remove the temporaries (an inflated input, a raw output) and release the files."""
        closer = getattr(getattr(self.source, "source", None), "close", None)
        if callable(closer):
            closer()
        if self.target is not None and self.target.array is not None:
            self.target.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def prepare(
    model: Model,
    source: Path,
    header: Probe,
    params: InferenceParams,
    limits: Limits,
    path: Path,
    fmt: str,
    checkpoint: Any = None,
) -> Prepared:
    """Stage 1: disk check, region source, preprocessing statistics, one plan (checked against
    ``limits.budget``), the output opened at ``path``. With a job's ``checkpoint``
    (:class:`service.pipeline.Checkpoint`) the network writes to its array, so a stopped run
    continues from its last finished tile row; the output is made from it at :func:`finish`.

    Raises:
        InsufficientStorageError: the disk cannot hold output and temporaries (507).
        OverBudgetError, MemoryBudgetError: the plan over the budget.
        InputError, DecodeError: an input the model cannot take, a corrupt file.
    """
    from models.geometry.mapping import plan_mapping
    from models.planning.params import OutputKind
    from models.transforms.streamed import RegionPreprocessed
    from service.precheck import held_beside
    from service.regions import open_regions
    from service.sniff import sniff_gzipped
    from service.writers import open_output, output_dtype

    started = time.perf_counter()
    spec = model.spec
    p = params.merged(spec.defaults)
    output_kind = str(p.output)
    labels = p.output == OutputKind.LABELS
    gzipped = header.kind == "nifti" and sniff_gzipped(source)
    folder = path.parent
    dtype = output_dtype(params, labels, int(spec.out_channels))
    from service.slides import read_header

    out = read_header(header, spec, p)  # a slide: the output has the shape of the level read
    check_disk(folder, disk_bytes(out, fmt, int(spec.out_channels), labels, gzipped, dtype))
    tmp = tempfile.TemporaryDirectory(prefix=".tilewise-", dir=folder)
    workdir = Path(tmp.name)
    prepared: Prepared | None = None
    regions: Any = None
    target: Any = None
    ready = False  # until the return: anything raised releases what was opened
    try:
        from service.slides import open_slide_source

        regions = open_slide_source(source, header, spec, p) or open_regions(source, header, workdir)
        affine = header.info.get("affine")
        mapping = plan_mapping(_Shape(regions.shape), affine, spec, native=True)
        x = RegionPreprocessed(regions, spec, as_float=mapping.as_float)
        held = held_beside(spec, header, streamed=True)
        plan = model.plan(x.shape[1:], params, memory_budget=limits.memory_budget, **held)
        if x.nonfinite:  # replaced by 0 after preprocessing, as on the whole path (service.pipeline)
            said = (
                f"{x.nonfinite} non-finite input voxel(s) (NaN or inf) were replaced by 0 after preprocessing"
            )
            plan = dataclasses.replace(plan, warning=f"{plan.warning}; {said}" if plan.warning else said)
        seam = model.seam_stats(plan)
        from service.slides import expected_skipped

        plan = expected_skipped(plan, regions, model.spec)
        if limits.budget is not None:
            footprint = model.footprint()
            limits.budget.check_plan(plan, int(spec.in_channels), int(spec.out_channels),
                                     footprint=footprint, **held)  # fmt: skip
        out_shape = tuple(plan.grid.out_shape)
        nifti = None
        if fmt in ("nii", "nii.gz") and header.kind == "nifti":
            nifti = {"header": regions.nifti_header, "version": header.info.get("nifti_version", 1),
                     "shape": header.info.get("shape")}  # fmt: skip
        from service.provenance import provenance_of

        provenance = provenance_of(spec, plan.header(), output_kind)  # DESIGN "third wave"
        to_uint8 = dtype == np.uint8 and not labels
        from service.pyramid import output_mpp

        mpp = output_mpp(header.info, tuple(header.spatial_shape), out_shape)  # ome.tiff / ome.zarr
        (in_y, in_x), (out_y, out_x) = header.spatial_shape[-2:], out_shape[-2:]
        scale = (float(in_y) / float(out_y), float(in_x) / float(out_x))
        target = open_output(fmt, path, workdir, out_shape, int(spec.out_channels), dtype, labels=labels,
                             nifti=nifti, dpi=header.info.get("dpi"), unit_to_uint8=to_uint8,
                             provenance=provenance, mpp=mpp, scale=scale)  # fmt: skip
        prepared = Prepared(model, header, params, fmt, output_kind, plan, x, target, workdir, seam, started,
                            _tmp=tmp)  # fmt: skip
        if checkpoint is not None:
            from service.paged import paged
            from service.pipeline import _output_layout

            # the checkpoint in the output's memory order (a NIfTI's is Fortran): finish copies it
            # slab by slab
            root = target.root
            order = "F" if root.ndim > 1 and root.flags.f_contiguous and not root.flags.c_contiguous else "C"
            kept, prepared.resume = checkpoint.start(plan, *_output_layout(spec, plan), order=order)
            prepared.kept = paged(kept) if isinstance(kept, np.memmap) else kept
        prepared.stages["prepare"] = time.perf_counter() - started
        ready = True
        return prepared
    finally:
        if not ready:  # refused (plan, budget, output, checkpoint): release what was opened
            for opened in (target, regions):
                closer = getattr(opened, "close", None)
                if callable(closer):
                    closer()
            tmp.cleanup()


#: Bytes of one block that :func:`_copy_slabs` copies between two same-ordered files.
COPY_BYTES = 16 << 20


def _copy_slabs(source: Any, target: Any, lead: int, block: int = 64) -> None:
    """``target[...] = source``, the checkpoint into the output, with the pages of both handed back
    as it goes (:class:`~service.paged.PagedMemmap`).

    A Fortran-ordered ``source`` (the checkpoint of a NIfTI output, its spatial axes in the
    target's order) goes in slabs of at most :data:`COPY_BYTES` along the last axis, the slowest
    spatial axis in both files: each slab is one run of the source and one run per channel of the
    target, and its pages are handed back before the next, so the resident memory of the copy is
    two slabs whatever the volume's extent. Otherwise (C order) it goes block by block:
    ``block`` voxels along axis ``lead`` (the first spatial axis) and along the last axis, every
    other axis whole."""
    if source.ndim > 1 and source.flags.f_contiguous and not source.flags.c_contiguous:
        last = int(source.shape[-1])
        step = max(1, COPY_BYTES // max(1, source.nbytes // max(1, last)))
        for z in range(0, last, step):
            target[..., z : z + step] = np.asarray(source[..., z : z + step])
            for array in (source, target):
                drop = getattr(array, "drop", None)
                if callable(drop):
                    drop()
        return
    first, last = int(source.shape[lead]), int(source.shape[-1])
    spans_last = [(0, last)] if source.ndim - 1 == lead else [(z, z + block) for z in range(0, last, block)]
    for x in range(0, first, block):
        for z0, z1 in spans_last:
            index = (slice(None),) * lead + (slice(x, x + block),)
            if source.ndim - 1 != lead:
                index = index + (Ellipsis, slice(z0, z1))
            target[index] = np.asarray(source[index])


class _Shape:
    """A stand-in with only ``shape`` (plan_mapping reads no voxel without a frame)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def execute(prepared: Prepared, options: RunOptions | None = None) -> RunPlan:
    """Stage 2 (the device thread): the tiled network passes of the prepared plan, tiles read by
    region and written to the output file. Returns the plan that ran (smaller after running out
    of device memory).

    Raises:
        InferenceError, RunCancelledError: see :meth:`models.Model.execute`.
    """
    options = options or RunOptions()
    started = time.perf_counter()
    ran = [prepared.plan]
    told = options.replanned

    def replanned(smaller: RunPlan) -> None:
        ran.append(smaller)
        if told is not None:
            told(smaller)

    out = prepared.target.array if prepared.kept is None else prepared.kept
    from tiling import TileReuse

    # constant tiles (blank glass outside a slide's tissue mask too) run once, counted
    reuse = options.reuse if options.reuse is not None else TileReuse()
    run = dataclasses.replace(
        options, resume=prepared.resume, seam=prepared.seam, replanned=replanned, reuse=reuse
    )
    prepared.model.execute(prepared.source, prepared.plan, out=out, options=run)
    prepared.ran = dataclasses.replace(ran[-1], output=prepared.plan.output, skipped=reuse.n_reused)
    prepared.stages["execute"] = time.perf_counter() - started
    return prepared.ran


def result_headers(label: str, result: Any) -> dict[str, str]:
    """The ``X-Tilewise-*`` headers of an inference result (:class:`service.pipeline.InferenceResult`),
    the same for the synchronous answer and a job's result."""
    warning = {"X-Tilewise-Warning": result.plan.warning} if result.plan.warning else {}
    return {
        **warning,
        "X-Tilewise-Model": label,
        "X-Tilewise-Format": result.format,
        "X-Tilewise-Output": result.output_kind,
        "X-Tilewise-Shape": ",".join(str(n) for n in result.output_shape),
        "X-Tilewise-Dtype": result.output_dtype,
        "X-Tilewise-Seconds": f"{result.seconds:.3f}",
        "X-Tilewise-Plan": result.plan.header(),
        **({"X-Tilewise-Seam": result.seam.header()} if result.seam is not None else {}),
    }


def finish(prepared: Prepared) -> Any:
    """Stage 3: complete the output file, describe it, remove the temporaries.

    Returns:
        The :class:`service.pipeline.InferenceResult`.
    """
    from service.pipeline import MEDIA_TYPES, InferenceResult

    begun = time.perf_counter()
    try:
        target = prepared.target
        if prepared.kept is not None:
            _copy_slabs(prepared.kept, target.array, 0 if prepared.output_kind == "labels" else 1)
        shape = tuple(int(n) for n in target.array.shape)
        dtype = str(target.array.dtype.newbyteorder("="))
        path = target.finish()
        plan = prepared.ran or prepared.plan
        seconds = time.perf_counter() - prepared.started
        spec = prepared.model.spec
        logger.info("model=%s input=%s%s streamed output=%s%s %s plan=%s in %.3fs", spec.name,
                    prepared.header.kind, tuple(prepared.source.shape), prepared.fmt, shape, dtype,
                    plan.header(), seconds)  # fmt: skip
        return InferenceResult(
            path=path,
            format=prepared.fmt,
            media_type=MEDIA_TYPES[prepared.fmt],
            input_shape=(int(prepared.header.channels), *(int(n) for n in prepared.header.spatial_shape)),
            output_shape=shape,
            output_dtype=dtype,
            output_kind=prepared.output_kind,
            seconds=seconds,
            plan=plan,
            size_bytes=path.stat().st_size,
            model_shape=tuple(int(n) for n in prepared.source.shape[1:]),
            seam=prepared.seam,
            stages={**prepared.stages, "finish": time.perf_counter() - begun},
        )
    finally:
        prepared.close()

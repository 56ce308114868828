"""The dry run: the plan of a request as JSON, without running the network.

``POST /v1/models/{name}/infer?dry_run=true`` (with the file) and ``tilewise plan INPUT --model NAME``
answer the same object, from the file's header alone (nothing is decoded)::

    {"model": "gaussian-3d", "input_shape": [192, 192, 192], "model_shape": [192, 192, 192],
     "tile": [60, 60, 60], "halo": [8, 8, 8], "overlap": [0, 0, 0], "blend": "constant",
     "batch_size": 2, "tiles": 64, "work": 1.95, "peak_bytes": 103079215, "eta_s": 14.2,
     "tta": "none", "tile_dependent": false, ...}

``tile`` is the tile fed to the network; ``peak_bytes`` the request's predicted peak memory (the
decoded input included; :func:`models.planning.cost.peak_bytes` from the footprint measured at warm-up);
``eta_s`` the predicted network time (the throughput measured at warm-up); ``tiles`` counts every
``tta`` pass (``passes``: 1, or 2**axes with ``tta=mirror``). Beyond the design's keys:
``tile_source`` and ``halo_source`` (where they came from), ``memory_budget``, ``footprint`` (the
measured figures), ``over_budget`` (``null``, or why the server would refuse the request) and
``streamed`` (whether the input is read by region and the output written as it finishes,
:mod:`service.stages`), ``disk_bytes`` (disk for the output and temporaries) and
``warning`` (``null``, or what ``X-Tilewise-Warning`` would say: a halo below the receptive-field
radius, or a memory budget that no plan meets), ``skipped`` (tiles expected not to run, when known:
outside a slide's tissue mask) and, for slides, ``reader``, ``levels``, ``mpp``, ``vendor`` and
``level_used`` (:mod:`service.slides`).
``halo="auto"`` reports the halo the run will use: the one calibrated on the same sample as the
run (the preprocessed image on the model grid; a streamed request's synthetic sample), read from
the measurements when that sample was calibrated before (a run, a plan, this server), else
calibrated now (a few network passes of sample tiles; the result is kept, so the run reuses it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import MemoryBudgetError, OverBudgetError
from service.precheck import Limits, check_input, check_model_grid, held_beside, model_shape, streamed_check

if TYPE_CHECKING:
    from models import InferenceParams, Model

__all__ = ["dry_run"]


def dry_run(model: Model, source: Path, params: InferenceParams, limits: Limits) -> dict[str, Any]:
    """The plan of running ``model`` on ``source`` with ``params`` (see the module docstring).

    Raises:
        PayloadTooLargeError, UnusableInputError, EmptyBodyError, UnsupportedMediaTypeError,
        DecodeError: the header or the model grid is refused (as for a real request; an
            implausible spacing before the network's footprint is measured).
        ParamError, GridError: parameters that cannot tile this image.
    """
    from models.planning.cost import network_seconds, peak_bytes

    spec = model.spec
    streams = streamed_check(model, source, params)
    header = check_input(spec, source, limits, params, streamed=streams)
    shape = model_shape(spec, header, params)
    check_model_grid(spec, header, shape, params, limits, streamed=streams(header))
    footprint = model.footprint()
    held = held_beside(spec, header, streamed=streams(header))
    plan = model.plan(
        shape, params, memory_budget=limits.memory_budget, footprint=footprint, calibrate=False, **held
    )
    if plan.halo_source.startswith("dry run"):  # halo=auto on several tiles: the run's calibration
        sample = None if streams(header) else _model_input(model, source, params, limits)
        plan = model.plan(
            shape, params, sample=sample, memory_budget=limits.memory_budget, footprint=footprint, **held
        )
    over: str | None = None
    if limits.budget is not None:
        try:
            limits.budget.check_plan(plan, spec.in_channels, spec.out_channels, footprint=footprint, **held)
        except (OverBudgetError, MemoryBudgetError) as exc:
            over = str(exc)
    peak = peak_bytes(plan, spec.in_channels, spec.out_channels, footprint, **held)
    grid = plan.grid
    disk = _disk_bytes(model, source, header, params, streamed=streams(header))
    from service.slides import slide_fields

    slide = slide_fields(source, header, spec, params, plan)  # {} for an input that is no slide
    plan = slide.pop("plan", plan)
    return {
        "model": spec.name,
        "input_shape": list(header.spatial_shape),
        "model_shape": list(shape),
        "tile": list(grid.used_tile_shape),
        "halo": list(plan.halo),
        "overlap": list(plan.overlap),
        "blend": plan.blend.value,
        "batch_size": plan.batch_size,
        "tiles": plan.n_tiles,
        "work": round(plan.work, 4),
        "peak_bytes": int(peak),
        "eta_s": round(network_seconds(plan, footprint), 3),
        "tta": plan.tta.value,
        "passes": len(plan.flips),
        "tile_dependent": bool(spec.tile_dependent),
        "tile_source": plan.tile_source,
        "halo_source": plan.halo_source,
        "memory_budget": limits.memory_budget,
        "footprint": footprint.describe(),
        "over_budget": over,
        "warning": plan.warning,
        "streamed": streams(header),
        "disk_bytes": disk,
        "skipped": plan.skipped,
        **slide,
    }


def _model_input(model: Model, source: Path, params: InferenceParams, limits: Limits) -> np.ndarray:
    """The preprocessed ``(C, *S_m)`` image the run plans on (and calibrates ``halo=auto`` with):
    decoded, mapped onto the model grid and preprocessed as :func:`models.geometry.mapping.run_mapped`
    does."""
    from models.geometry.mapping import plan_mapping
    from service.codecs import decode
    from service.pipeline import fit_to_model
    from service.precheck import dicom_options

    volume = decode(
        source,
        max_voxels=limits.max_voxels,
        max_image_pixels=limits.max_image_pixels,
        max_bytes=limits.max_bytes,
        dicom=dicom_options(params),
    )
    data, _ = fit_to_model(volume, model.spec)
    mapping = plan_mapping(data, volume.affine, model.spec, native=params.spacing == "native")
    return np.asarray(model.preprocess(mapping.to_model(data)))


def _disk_bytes(model: Model, source: Path, header: Any, params: InferenceParams, *, streamed: bool) -> int:
    """Bytes of disk the request needs: a streamed one's output and temporaries
    (:func:`service.stages.disk_bytes`), else its uncompressed output."""
    from service.sniff import sniff_gzipped
    from service.stages import disk_bytes, output_format
    from service.writers import output_dtype

    spec = model.spec
    labels = str(params.output or spec.defaults.output) == "labels"
    fmt = output_format(header.kind, spec, params)
    gzipped = streamed and header.kind == "nifti" and sniff_gzipped(source)
    if streamed:
        return disk_bytes(
            header,
            fmt,
            int(spec.out_channels),
            labels,
            gzipped,
            output_dtype(params, labels, int(spec.out_channels)),
        )
    voxels = int(np.prod(header.spatial_shape))
    return voxels * (
        1
        if labels
        else output_dtype(params, labels, int(spec.out_channels)).itemsize * int(spec.out_channels)
    )

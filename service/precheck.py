"""What a request may cost, checked from the file's header before anything is decoded.

:class:`Limits` holds what an input may declare (voxels, pixels, decompressed bytes and their ratio
to the file's bytes) and what its plan may cost (:mod:`service.budget`, ``TILEWISE_MEMORY_BUDGET``).
:func:`check_input` checks a header against them and the model; :func:`precheck` also plans on the
model grid (the header's shape resampled to the spec's spacing, from its affine), refuses a
spacing no scan has (:func:`check_spacing`) and a model grid over ``max_voxels``
(:func:`check_model_grid`), and a plan over the budget (memory, tiles, predicted seconds), before
the request is queued. :mod:`service.pipeline` runs the request; :mod:`service.dryrun` answers the
plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.codecs import Probe, probe
from service.errors import PayloadTooLargeError, UnusableInputError

if TYPE_CHECKING:
    from models import InferenceParams, Model
    from service.budget import Budget

__all__ = [
    "Limits",
    "MAX_SPACING_RATIO",
    "MIN_SPACING_RATIO",
    "RATIO_FREE_BYTES",
    "check_compression",
    "check_input",
    "check_model_grid",
    "check_spacing",
    "copies_input",
    "dicom_options",
    "held_beside",
    "input_bytes",
    "model_shape",
    "precheck",
    "streamed_check",
]

#: A voxel this many times larger than the model's (50 mm for a model of 1 mm), or smaller (1 um),
#: is a mislabelled header: resampling it would make a model grid of another size altogether.
MAX_SPACING_RATIO = 50.0
MIN_SPACING_RATIO = 1e-3
#: Inputs that inflate to at most this many bytes are not held to ``max_compression_ratio``.
RATIO_FREE_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Limits:
    """What an input may declare and a request may cost (``None``: unbounded).

    Attributes:
        max_voxels: voxels times channels, from the header (413).
        max_image_pixels: pixels per plane of a picture or TIFF page (413).
        max_bytes: bytes once decompressed, from the header (413).
        max_ratio: bytes once decompressed per byte of the file, above :data:`RATIO_FREE_BYTES`
            (413): a compression bomb is refused before it is inflated.
        budget: batch size, tiles, work and memory of the plan (:mod:`service.budget`).
        memory_budget: bytes the plan should fit (``TILEWISE_MEMORY_BUDGET``): picks the tile and
            batch size the request does not give (:mod:`models.planning.planner`).
    """

    max_voxels: int | None = None
    max_image_pixels: int | None = None
    max_bytes: int | None = None
    budget: Budget | None = None
    memory_budget: int | None = None
    max_ratio: float | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        """The limits of :class:`~service.settings.Settings`."""
        from service.budget import Budget

        return cls(
            settings.max_voxels,
            settings.max_image_pixels,
            settings.max_decoded_bytes,
            Budget.from_settings(settings),
            settings.memory_budget,
            settings.max_compression_ratio,
        )


def check_input(
    spec: Any,
    source: Path,
    limits: Limits,
    params: InferenceParams | None = None,
    *,
    streamed: Callable[[Probe], bool] | None = None,
) -> Probe:
    """The input's header, checked against ``limits`` and the model before anything is decoded.

    ``streamed(header)`` true: the input is read by region and never decoded whole
    (:mod:`service.stages`), so the voxel, pixel and decompressed-byte limits (bomb guards of
    whole decoding) do not apply; its cost is the plan's memory and the disk.

    Raises:
        PayloadTooLargeError: voxels, pixels, decompressed bytes or their ratio to the file's bytes
            over the limits (413).
        UnusableInputError: the wrong dimensionality or channel count for the model (422).
        EmptyBodyError, UnsupportedMediaTypeError, DecodeError: see :func:`service.codecs.probe`.
        DicomSeriesError: a DICOM upload that is no one usable series (``params.series``,
            ``params.tilt`` choose).
    """
    header = probe(source, dicom=dicom_options(params), max_bytes=limits.max_bytes)
    if streamed is None or not streamed(header):
        header.check_limits(
            max_voxels=limits.max_voxels, max_image_pixels=limits.max_image_pixels, max_bytes=limits.max_bytes
        )
    check_compression(header, Path(source).stat().st_size, limits.max_ratio)
    header.check_model(int(spec.spatial_dims), spec.name, in_channels=int(spec.in_channels))
    from service.slides import set_level_used

    return set_level_used(header, spec, params)  # a slide: the level this request reads


def check_compression(header: Probe, file_bytes: int, max_ratio: float | None) -> None:
    """Refuse a file that declares more than ``max_ratio`` bytes once decompressed per byte it
    holds, when it inflates past :data:`RATIO_FREE_BYTES` (from the header: nothing is inflated).

    E.g. 1024^3 uint8 zeros in a 1 MB ``.nii.gz`` (gzip's ratio on zeros is about 1000): refused at
    the default 200, where a CT (2 to 5) or an MRI with its background (5 to 20) passes.

    Raises:
        PayloadTooLargeError: naming both figures and ``max_compression_ratio`` (413).
    """
    if max_ratio is None or header.nbytes <= RATIO_FREE_BYTES:
        return
    ratio = header.nbytes / max(1, file_bytes)
    if ratio > max_ratio:
        raise PayloadTooLargeError(
            f"{header.format_name} of {file_bytes} bytes declares {header.nbytes} bytes once "
            f"decompressed: a ratio of {ratio:.0f}, over max_compression_ratio={max_ratio:g} "
            "(TILEWISE_MAX_COMPRESSION_RATIO)"
        )


def precheck(model: Model, source: Path, params: InferenceParams, limits: Limits) -> Probe:
    """Refuse, from the file's header alone, an input or a plan beyond ``limits`` (before queueing).

    The plan is made on the model grid's shape, from the header's shape and affine (the spec's
    spacing or frame), with the network's footprint as far as it is known (measured at warm-up;
    else an estimate); a calibrated halo (``halo=auto``) counts as 0 here, a lower bound of the
    real plan's cost, which :func:`service.pipeline.run_volume` checks again before running it.

    Raises:
        PayloadTooLargeError, UnusableInputError: see :func:`check_input` and
            :func:`check_model_grid`.
        OverBudgetError, MemoryBudgetError: the plan over the budget (422, 413).
        ParamError, GridError: parameters that cannot tile this image (400).
    """
    from models.measure.footprint import Footprint

    spec = model.spec
    streams = streamed_check(model, source, params)
    header = check_input(spec, source, limits, params, streamed=streams)
    from service.stages import output_format
    from service.writers import check_output_dtype

    check_output_dtype(output_format(header.kind, spec, params), params, spec)
    if streams(header):  # read by region: no input held, the disk holds the output
        from service.sniff import sniff_gzipped
        from service.stages import check_disk, disk_bytes, output_format
        from service.writers import output_dtype

        labels = str(params.output or spec.defaults.output) == "labels"
        gzipped = header.kind == "nifti" and sniff_gzipped(source)
        fmt = output_format(header.kind, spec, params)
        dtype = output_dtype(params, labels, int(spec.out_channels))
        from service.slides import read_header

        out = read_header(header, spec, params.merged(spec.defaults))  # a slide: the level read
        check_disk(source.parent, disk_bytes(out, fmt, int(spec.out_channels), labels, gzipped, dtype))
    if limits.budget is None:
        check_model_grid(
            spec, header, model_shape(spec, header, params), params, limits, streamed=streams(header)
        )
    else:
        if params.merged(spec.defaults).halo == "auto":
            params = params.model_copy(update={"halo": 0})
        footprint = model.known_footprint or Footprint.estimate(int(spec.in_channels))
        held = held_beside(spec, header, streamed=streams(header))
        shape = model_shape(spec, header, params)
        check_model_grid(spec, header, shape, params, limits, streamed=streams(header))
        plan = model.plan(shape, params, memory_budget=limits.memory_budget, footprint=footprint, **held)
        limits.budget.check_plan(
            plan, int(spec.in_channels), int(spec.out_channels), footprint=footprint, **held
        )
    return header


def streamed_check(model: Model, source: Path, params: InferenceParams) -> Callable[[Probe], bool]:
    """``header -> bool``: whether a request with this header is streamed (:mod:`service.stages`);
    the answer for one header is kept (it may open the file)."""
    from service.stages import output_format, why_not_streamed

    answers: dict[int, bool] = {}

    def streams(header: Probe) -> bool:
        if id(header) not in answers:
            fmt = output_format(header.kind, model.spec, params)
            answers[id(header)] = why_not_streamed(model, header, params, fmt, source) is None
        return answers[id(header)]

    return streams


def model_shape(spec: Any, header: Probe, params: InferenceParams) -> tuple[int, ...]:
    """The spatial shape the model plans on for an input with this header: on the model's grid
    (the spec's spacing or frame, from the header's affine); a one-slice NIfTI is an image for a
    2D model."""
    from models.geometry.mapping import header_model_shape
    from service.slides import resolution_of

    resolution = resolution_of(header, spec, params)
    if resolution is not None:  # a slide: the level (and resampling) the request reads
        return resolution.shape
    shape = tuple(header.spatial_shape)
    if int(spec.spatial_dims) == 2 and header.single_slice:
        shape = shape[:2]
    native = params.spacing == "native"
    return tuple(header_model_shape(shape, header.info.get("affine"), spec, native=native))


def held_beside(spec: Any, header: Probe, *, streamed: bool) -> dict[str, Any]:
    """What a request holds beside its plan, as :func:`models.planning.cost.peak_bytes` takes it: the
    decoded input and its float copy; a streamed request (:mod:`service.stages`) neither, and its
    output is on disk; a streamed slide its cache of decoded stored tiles
    (:data:`service.slides.tilecache.TILE_CACHE_BYTES` at most: no more than the slide's level 0)."""
    if streamed:
        from service.slides import slide_info
        from service.slides.tilecache import TILE_CACHE_BYTES

        cache = min(TILE_CACHE_BYTES, input_bytes(header)) if slide_info(header) is not None else 0
        return {"input_bytes": cache, "copies_input": False, "output_on_disk": True}
    return {"input_bytes": input_bytes(header), "copies_input": copies_input(spec, header)}


def check_model_grid(
    spec: Any,
    header: Probe,
    shape: tuple[int, ...],
    params: InferenceParams,
    limits: Limits,
    *,
    streamed: bool = False,
) -> None:
    """Refuse an input whose model grid ``shape`` (:func:`model_shape`) is beyond ``max_voxels``, or
    whose spacing is implausible for the model (:func:`check_spacing`): the limits hold for what
    the network will see, not only for what the header declares. A ``streamed`` input (read by
    region, never decoded whole) is bounded by memory and disk instead of ``max_voxels``.

    Raises:
        UnusableInputError: see :func:`check_spacing` (422).
        PayloadTooLargeError: ``shape`` times the model's input channels over ``max_voxels`` (413).
    """
    check_spacing(spec, header, params)
    voxels = math.prod(shape) * int(spec.in_channels)
    if not streamed and limits.max_voxels is not None and voxels > limits.max_voxels:
        raise PayloadTooLargeError(
            f"the input ({'x'.join(map(str, header.spatial_shape))}) resampled to the model grid is "
            f"{'x'.join(map(str, shape))} with {spec.in_channels} channel(s): {voxels} voxels; the "
            f"limit is max_voxels={limits.max_voxels} (TILEWISE_MAX_VOXELS)"
        )


def check_spacing(spec: Any, header: Probe, params: InferenceParams) -> None:
    """Refuse a voxel size that no scan has, relative to the model's spacing: above
    :data:`MAX_SPACING_RATIO` times its largest spacing or below :data:`MIN_SPACING_RATIO` times
    its smallest (for a model of 1 mm: over 50 mm or under 1 um). Only where the input is resampled
    to the spec's ``spacing`` (a NIfTI with an affine, not ``spacing=native``).

    E.g. 10^3 voxels of 100 mm for a model of 1 mm would be resampled to a 1000^3 model grid.

    Raises:
        UnusableInputError: naming the axis, the header's voxel size and the model's spacing (422).
    """
    affine = header.info.get("affine")
    spacing = getattr(spec, "spacing", None)
    if affine is None or spacing is None or getattr(spec, "frame", None) is not None:
        return
    if params.spacing == "native":
        return
    axes = 2 if int(spec.spatial_dims) == 2 and header.single_slice else len(header.spatial_shape)
    zooms = np.sqrt((np.asarray(affine, dtype=np.float64)[:3, :axes] ** 2).sum(axis=0))
    low, high = min(spacing) * MIN_SPACING_RATIO, max(spacing) * MAX_SPACING_RATIO
    model = "x".join(f"{s:g}" for s in spacing)
    for axis, zoom in enumerate(zooms):
        if not (low <= zoom <= high):
            raise UnusableInputError(
                f"implausible voxel size: axis {axis} of the header's affine is {zoom:g} mm for model "
                f"{spec.name!r} of spacing {model} mm (plausible: {low:g} to {high:g} mm); the header "
                "is mislabelled: fix its pixdim / sform, or send spacing=native"
            )


def dicom_options(params: InferenceParams | None) -> dict[str, Any]:
    """``series`` and ``tilt`` of ``params`` for a DICOM input (:func:`service.codecs.decode`)."""
    if params is None:
        return {}
    return {"series": params.series, "tilt": params.tilt}


def input_bytes(header: Probe) -> int:
    """Bytes of the decoded input of a file with this header."""
    return int(header.voxels * np.dtype(header.dtype).itemsize)


def copies_input(spec: Any, header: Probe) -> bool:
    """Whether preprocessing makes a float32 copy of the decoded input: always but for a float32
    image in C order that no preprocessing step changes (NIfTI voxels decode in Fortran order)."""
    return np.dtype(header.dtype) != np.float32 or bool(spec.preprocess) or header.kind in ("nifti", "dicom")

"""What a request may cost, checked from the file's header before anything is decoded.

:class:`Limits` holds what an input may declare (voxels, pixels, decompressed bytes) and what its
plan may cost (:mod:`service.budget`, ``TILEWISE_MEMORY_BUDGET``). :func:`check_input` checks a
header against them and the model; :func:`precheck` also plans on the header's shape (the model
grid's, from its affine) and refuses a plan over the budget before the request is queued.
:mod:`service.pipeline` runs the request; :mod:`service.dryrun` answers the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.codecs import Probe, probe

if TYPE_CHECKING:
    from models import InferenceParams, Model
    from service.budget import Budget

__all__ = ["Limits", "check_input", "copies_input", "dicom_options", "input_bytes", "model_shape", "precheck"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What an input may declare and a request may cost (``None``: unbounded).

    Attributes:
        max_voxels: voxels times channels, from the header (413).
        max_image_pixels: pixels per plane of a picture or TIFF page (413).
        max_bytes: bytes once decompressed, from the header (413).
        budget: batch size, tiles, work and memory of the plan (:mod:`service.budget`).
        memory_budget: bytes the plan should fit (``TILEWISE_MEMORY_BUDGET``): picks the tile and
            batch size the request does not give (:mod:`models.planner`).
    """

    max_voxels: int | None = None
    max_image_pixels: int | None = None
    max_bytes: int | None = None
    budget: Budget | None = None
    memory_budget: int | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        """The limits of :class:`~service.settings.Settings` (decompressed bytes:
        ``max_decoded_bytes``, else the request memory budget)."""
        from service.budget import Budget

        return cls(
            settings.max_voxels,
            settings.max_image_pixels,
            settings.max_decoded_bytes or settings.max_request_bytes,
            Budget.from_settings(settings),
            settings.memory_budget,
        )


def check_input(spec: Any, source: Path, limits: Limits, params: InferenceParams | None = None) -> Probe:
    """The input's header, checked against ``limits`` and the model before anything is decoded.

    Raises:
        PayloadTooLargeError: voxels, pixels or decompressed bytes over the limits (413).
        UnusableInputError: the wrong dimensionality or channel count for the model (422).
        EmptyBodyError, UnsupportedMediaTypeError, DecodeError: see :func:`service.codecs.probe`.
        DicomSeriesError: a DICOM upload that is no one usable series (``params.series``,
            ``params.tilt`` choose).
    """
    header = probe(source, dicom=dicom_options(params), max_bytes=limits.max_bytes)
    header.check_limits(
        max_voxels=limits.max_voxels, max_image_pixels=limits.max_image_pixels, max_bytes=limits.max_bytes
    )
    header.check_model(int(spec.spatial_dims), spec.name, in_channels=int(spec.in_channels))
    return header


def precheck(model: Model, source: Path, params: InferenceParams, limits: Limits) -> Probe:
    """Refuse, from the file's header alone, an input or a plan beyond ``limits`` (before queueing).

    The plan is made on the model grid's shape, from the header's shape and affine (the spec's
    spacing or frame), with the network's footprint as far as it is known (measured at warm-up;
    else an estimate); a calibrated halo (``halo=auto``) counts as 0 here, a lower bound of the
    real plan's cost, which :func:`service.pipeline.run_volume` checks again before running it.

    Raises:
        PayloadTooLargeError, UnusableInputError: see :func:`check_input`.
        OverBudgetError, MemoryBudgetError: the plan over the budget (422, 413).
        ParamError, GridError: parameters that cannot tile this image (400).
    """
    from models.footprint import Footprint

    spec = model.spec
    header = check_input(spec, source, limits, params)
    if limits.budget is not None:
        if params.merged(spec.defaults).halo == "auto":
            params = params.model_copy(update={"halo": 0})
        footprint = model.known_footprint or Footprint.estimate(int(spec.in_channels))
        held = {"input_bytes": input_bytes(header), "copies_input": copies_input(spec, header)}
        shape = model_shape(spec, header, params)
        plan = model.plan(shape, params, memory_budget=limits.memory_budget, footprint=footprint, **held)
        limits.budget.check_plan(
            plan, int(spec.in_channels), int(spec.out_channels), footprint=footprint, **held
        )
    return header


def model_shape(spec: Any, header: Probe, params: InferenceParams) -> tuple[int, ...]:
    """The spatial shape the model plans on for an input with this header: on the model's grid
    (the spec's spacing or frame, from the header's affine); a one-slice NIfTI is an image for a
    2D model."""
    from models.mapping import header_model_shape

    shape = tuple(header.spatial_shape)
    if int(spec.spatial_dims) == 2 and header.single_slice:
        shape = shape[:2]
    native = params.spacing == "native"
    return tuple(header_model_shape(shape, header.info.get("affine"), spec, native=native))


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

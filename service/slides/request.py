"""A request's slide: what its ``mpp``, ``level`` and ``mask`` parameters read of a slide.

The stages, the precheck and the dry run call these with the input's probe (``header``), the
model's spec and the request's parameters; each returns ``None``, ``{}``, ``False`` or ``header``
as it is for an input that is no slide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.codecs.volume import Probe
from service.errors import UnusableInputError
from service.slides.readers import slide_info
from service.slides.regions import SlideRegions, open_slide_regions
from service.slides.resolution import Resolution, choose_resolution
from service.slides.tissue import expected_skipped

__all__ = [
    "open_slide_source",
    "read_header",
    "resolution_of",
    "set_level_used",
    "slide_fields",
    "whole_slide_check",
]


def resolution_of(header: Any, spec: Any, params: Any) -> Resolution | None:
    """The :class:`Resolution` a request reads a slide at (``None`` for no slide): the request's
    ``level`` or ``mpp``, else the spec's ``mpp``."""
    info = slide_info(header)
    if info is None:
        return None
    spec_mpp = None if getattr(spec, "mpp", None) is None else float(spec.mpp[1])
    return choose_resolution(info, spec_mpp, params.mpp, params.level)


def read_header(header: Any, spec: Any, params: Any) -> Any:
    """``header`` with the spatial shape a request reads (:func:`resolution_of`: the level and
    resampling asked) for a slide, as the output and its disk estimate have it; ``header`` as it is
    for any other input."""
    import dataclasses

    resolution = resolution_of(header, spec, params)
    if resolution is None or tuple(resolution.shape) == tuple(header.spatial_shape):
        return header
    return dataclasses.replace(header, spatial_shape=tuple(resolution.shape))


def whole_slide_check(header: Any, spec: Any, params: Any, reason: str | None) -> bool:
    """Whether ``header`` is a slide; one that cannot be streamed (``reason``) is decoded whole at
    level 0 only, so a request for another level or mpp is refused.

    Raises:
        UnusableInputError: a slide whose requested level or mpp needs the region reader, with
            ``reason`` why this request cannot use it.
    """
    resolution = resolution_of(header, spec, params)
    if resolution is None:
        return False
    if reason is not None and header.kind == "slide":
        raise UnusableInputError(f"a DICOM whole-slide image is read only by region, which this request "
                                 f"cannot use: {reason}")  # fmt: skip
    if reason is not None and (resolution.level != 0 or resolution.factor != 1.0):
        raise UnusableInputError(
            f"this slide is read at level {resolution.level} (resampled x{resolution.factor:.3g}) only by "
            f"region, which this request cannot use: {reason}; ask for level=0"
        )
    return True


def open_slide_source(path: Path, header: Any, spec: Any, params: Any) -> SlideRegions | None:
    """The slide of ``header`` read by region at the request's resolution, with the tissue mask
    unless ``params.mask`` is ``none``; ``None`` for an input that is no slide."""
    resolution = resolution_of(header, spec, params)
    info = slide_info(header)
    if resolution is None or info is None:
        return None
    return open_slide_regions(path, info, resolution, mask=str(params.mask or "auto") == "auto")


def slide_fields(path: Path, header: Any, spec: Any, params: Any, plan: Any) -> dict[str, Any]:
    """The dry run's slide keys (``reader``, ``levels``, ``mpp``, ``vendor``, ``level_used``,
    ``mpp_used``, ``resampled``) and ``plan`` with its expected ``skipped`` (the tissue mask is made
    from a low level: a small read); ``{}`` for an input that is no slide."""
    p = params.merged(spec.defaults)
    resolution = resolution_of(header, spec, p)
    info = slide_info(header)
    if resolution is None or info is None:
        return {}
    fields: dict[str, Any] = {**info.describe(), "level_used": resolution.level, "mpp_used": resolution.mpp,
                              "resampled": resolution.factor != 1.0}  # fmt: skip
    if str(p.mask or "auto") == "auto":
        regions = open_slide_regions(path, info, resolution, mask=True)
        try:
            fields["plan"] = expected_skipped(plan, regions, spec)
        finally:
            regions.close()
    return fields


def set_level_used(header: Probe, spec: Any, params: Any = None) -> Probe:
    """``header`` with ``info["level_used"]`` the level a request reads (:func:`resolution_of` of
    ``params`` merged with the spec's defaults: the request's ``level`` or ``mpp``, else the spec's
    ``mpp``, else 0), as the dry run reports it; set in place (the header stays the same object),
    and nothing done for an input that is no slide.

    Raises:
        UnusableInputError: a level the slide lacks, or an mpp it cannot be read at
            (:func:`~service.slides.resolution.choose_resolution`).
    """
    if slide_info(header) is None:
        return header
    merged = spec.defaults if params is None else params.merged(spec.defaults)
    resolution = resolution_of(header, spec, merged)
    assert resolution is not None
    header.info["level_used"] = resolution.level
    return header

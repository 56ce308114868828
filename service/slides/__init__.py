"""Whole-slide images: pyramidal TIFF-family slides read by level and region (issue 21 items 1-3).

Shapes: ``(C, H, W)`` channel-first (``C = 3``, RGB), ``H, W`` at the level read; levels are listed
``[width, height, downsample]`` as slide readers do.

One module per concept, their public names re-exported here:

- :mod:`~service.slides.readers`: what a slide is (by content), its reader (``tiffslide``,
  ``tifffile``, ``openslide``), vendor, levels and mpp (:class:`SlideInfo`), and its pixels by
  level and region (:func:`open_slide`).
- :mod:`~service.slides.resolution`: the level and resampling an ``mpp`` or ``level`` asks
  (:func:`choose_resolution`, :class:`Resolution`).
- :mod:`~service.slides.tissue`: the tissue mask (:class:`TissueMask`, ``mask=auto``) on a low
  level, and the tiles it leaves unrun (:func:`expected_skipped`).
- :mod:`~service.slides.regions`: the slide as a region source at one resolution, answering
  regions wholly outside the tissue as blank glass without reading them (:class:`SlideRegions`).
- :mod:`~service.slides.request`: what a request's parameters read of a slide, for the stages,
  the precheck and the dry run (:func:`resolution_of`, :func:`slide_fields`, ...).
"""

from service.slides.readers import (
    MPP_RANGE,
    WSI_SOP_CLASS,
    SlideInfo,
    is_slide_tiff,
    open_slide,
    probe_dicom_wsi,
    probe_slide,
    slide_info,
    slide_probe,
)
from service.slides.regions import SlideRegions, open_slide_regions
from service.slides.request import (
    open_slide_source,
    read_header,
    resolution_of,
    set_level_used,
    slide_fields,
    whole_slide_check,
)
from service.slides.resolution import MIN_MPP_RATIO, MPP_SAME, Resolution, choose_resolution
from service.slides.tissue import (
    GLASS_TOLERANCE,
    MASK_SIDE,
    TissueMask,
    background_tiles,
    expected_skipped,
    thumbnail,
)

__all__ = [
    "GLASS_TOLERANCE",
    "MASK_SIDE",
    "MIN_MPP_RATIO",
    "MPP_RANGE",
    "MPP_SAME",
    "Resolution",
    "SlideInfo",
    "SlideRegions",
    "TissueMask",
    "WSI_SOP_CLASS",
    "background_tiles",
    "choose_resolution",
    "expected_skipped",
    "is_slide_tiff",
    "open_slide",
    "open_slide_regions",
    "open_slide_source",
    "probe_dicom_wsi",
    "probe_slide",
    "read_header",
    "resolution_of",
    "set_level_used",
    "slide_fields",
    "slide_info",
    "slide_probe",
    "thumbnail",
    "whole_slide_check",
]

"""Whole-slide images: pyramidal TIFF-family slides read by level and region (issue 21 items 1, 2).

Shapes: ``(C, H, W)`` channel-first (``C = 3``, RGB), ``H, W`` at the level read; levels are listed
``[width, height, downsample]`` as slide readers do.

A TIFF is a *slide* by content, not by name: tifffile flags it as a slide format (SVS, NDPI, SCN,
Philips, BIF, QPI) or it is tiled with several pyramid levels (SubIFDs of an OME-TIFF, or
reduced-resolution pages of a generic tiled TIFF), and its pixels are 8-bit ``YX`` or ``YXS``.
The reader is chosen per file and named in the plan: ``tiffslide`` (the TIFF family; BSD, pure
Python on tifffile), else ``tifffile`` (its own pyramid levels, when the ``slides`` extra is
absent), and ``openslide`` (extra ``openslide``) for what no TIFF reader opens (DICOM-WSI, MRXS).
Regions are read lazily through the level's zarr store (only the tiles a region touches are
decoded); nothing decodes a whole level.

Resolution (:func:`choose_resolution`). The spec's ``mpp`` (microns per pixel the network was
trained at) or the request's ``mpp`` picks the nearest level at or finer than the target, resampled
per region to it (bilinear on pixel centres: output pixel ``i`` samples the level at
``(i + 0.5) * f - 0.5``, ``f = target / level mpp``, the same value whichever region asks, so tiled
reads equal one whole read; ``f = 2`` is the 2x2 box mean); ``level`` reads a level as it is. A
target finer than half the slide's level-0 mpp (:data:`MIN_MPP_RATIO`) is refused (422), so the
read shape is at most twice level 0 per side; the output's disk estimate is of that shape.
A slide whose mpp is missing or implausible (outside :data:`MPP_RANGE`: a 72 dpi resolution tag
read as 352.8 um/px) is never guessed: a model with an ``mpp`` then needs ``level=N``.

The tissue mask (:class:`TissueMask`, ``mask=auto``) and the glass colour come from a low level;
regions wholly outside the (dilated) mask are answered as blank glass without being read, and the
engine's constant-tile reuse (:mod:`tiling.reuse`) runs the network on that blank once.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import UnusableInputError
from service.regions import RegionSource
from service.tilecache import TileCache, read_tiles

__all__ = [
    "MIN_MPP_RATIO",
    "MPP_RANGE",
    "Resolution",
    "SlideInfo",
    "SlideRegions",
    "TissueMask",
    "choose_resolution",
    "background_tiles",
    "expected_skipped",
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
    "whole_slide_check",
]

logger = logging.getLogger(__name__)

#: Plausible microns per pixel of a slide level 0 (40x is about 0.25, 1.25x about 8).
MPP_RANGE = (0.02, 20.0)
#: A level whose mpp is within this relative difference of the target is read as it is.
MPP_SAME = 0.01
#: The finest target mpp a slide is read at, as a share of its level-0 mpp (an upsampling by 2
#: at most: a target of 1e-6 um/px would make a slide of 1e10 x 1e10 pixels).
MIN_MPP_RATIO = 0.5
#: A mask pixel further than this from the glass's colour (any channel, 0-255) is tissue.
GLASS_TOLERANCE = 10.0
#: The tissue mask is made on at most this many pixels per side.
MASK_SIDE = 2048
_SLIDE_FLAGS = ("is_svs", "is_ndpi", "is_scn", "is_philips", "is_bif", "is_qpi")


@dataclass(frozen=True)
class SlideInfo:
    """What a slide declares (from its header; nothing decoded).

    Attributes:
        reader: ``tiffslide``, ``tifffile`` or ``openslide``.
        vendor: ``aperio``, ``hamamatsu``, ``generic-tiff``, ... (``None`` when unknown).
        levels: ``(width, height, downsample)`` per level, level 0 first.
        mpp: level-0 microns per pixel (x), ``None`` when missing or implausible.
        mpp_note: why ``mpp`` is ``None`` (a sentence), else ``None``.
    """

    reader: str
    vendor: str | None
    levels: tuple[tuple[int, int, float], ...]
    mpp: float | None
    mpp_note: str | None = None

    def describe(self) -> dict[str, Any]:
        """``{"reader", "levels", "mpp", "vendor"}`` for the probe and the dry run."""
        return {
            "reader": self.reader,
            "levels": [[w, h, round(d, 4)] for w, h, d in self.levels],
            "mpp": self.mpp,
            "vendor": self.vendor,
        }


def slide_probe(info: SlideInfo, kind: str = "tiff") -> Any:
    """The :class:`~service.codecs.Probe` of a slide: level 0 ``(H, W)``, 3 channels, uint8; its
    ``info`` holds ``slide: true``, :meth:`SlideInfo.describe`'s keys (``mpp_note`` too) and
    ``level_used`` 0 (what a request with no ``mpp`` or ``level`` reads for a model without an
    ``mpp``; :func:`set_level_used` sets a request's)."""
    from service.codecs.volume import Probe

    w, h, _ = info.levels[0]
    return Probe(kind, (h, w), 3, np.dtype(np.uint8), w * h * 3,
                 {"slide": True, **info.describe(), "mpp_note": info.mpp_note, "level_used": 0})  # fmt: skip


def set_level_used(header: Any, spec: Any, params: Any = None) -> Any:
    """``header`` with ``info["level_used"]`` the level a request reads (:func:`resolution_of` of
    ``params`` merged with the spec's defaults: the request's ``level`` or ``mpp``, else the spec's
    ``mpp``, else 0), as the dry run reports it; set in place (the header stays the same object),
    and nothing done for an input that is no slide.

    Raises:
        UnusableInputError: a level the slide lacks, or an mpp it cannot be read at
            (:func:`choose_resolution`).
    """
    if slide_info(header) is None:
        return header
    merged = spec.defaults if params is None else params.merged(spec.defaults)
    resolution = resolution_of(header, spec, merged)
    assert resolution is not None
    header.info["level_used"] = resolution.level
    return header


#: SOP class of DICOM whole-slide images (VL Whole Slide Microscopy Image Storage).
WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"


def probe_dicom_wsi(path: Path) -> Any:
    """The :class:`~service.codecs.Probe` (kind ``slide``, reader ``openslide``) of a DICOM
    whole-slide image file, ``None`` for any other DICOM input (a folder, a zip, a series).

    Raises:
        UnusableInputError: a DICOM-WSI without the ``openslide`` extra, or one OpenSlide cannot open.
    """
    if path.is_dir():
        return None
    import pydicom

    try:
        meta = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPClassUID"])
    except Exception:  # noqa: BLE001 - not one DICOM file (a zip): the series reader decides
        return None
    if str(meta.get("SOPClassUID", "")) != WSI_SOP_CLASS:
        return None
    slide = _OpenSlide(path, what="a DICOM whole-slide image (VL Whole Slide Microscopy Image Storage)")
    try:
        return slide_probe(slide.info, kind="slide")
    finally:
        slide.close()


def slide_info(header: Any) -> SlideInfo | None:
    """The :class:`SlideInfo` a probe carries, ``None`` for an input that is no slide."""
    meta = getattr(header, "info", None) or {}
    if not meta.get("slide"):
        return None
    levels = tuple((int(w), int(h), float(d)) for w, h, d in meta["levels"])
    return SlideInfo(meta["reader"], meta.get("vendor"), levels, meta.get("mpp"), meta.get("mpp_note"))


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


def expected_skipped(plan: Any, regions: Any, spec: Any = None) -> Any:
    """``plan`` with :attr:`~models.RunPlan.skipped` set to the tiles a slide's tissue mask leaves
    unrun (its background tiles but those of the first batch that holds any), when ``regions`` has a mask, and
    the warning of a slide whose mpp is missing or implausible. Counted once per pass: once for a
    ``spec`` that flips inside each tile (:func:`models.execution.execute.flips_in_tiles`)."""
    import dataclasses

    resolution = getattr(regions, "resolution", None)
    note = None if resolution is None else resolution.note
    if note is not None:  # the X-Tilewise-Warning of a slide without a usable mpp
        said = f"{note}; read at level 0 as it is"
        plan = dataclasses.replace(plan, warning=f"{plan.warning}; {said}" if plan.warning else said)
    mask = getattr(regions, "mask", None)
    if mask is None or getattr(regions, "glass", None) is None:
        return plan
    flags = background_tiles(plan.grid, mask)
    batch = int(plan.batch_size)
    # the engine runs a batch whole but for values an earlier batch ran: the first batch holding
    # background tiles runs them all (tiling.reuse), every later one is a copy
    first = next((flags[i : i + batch] for i in range(0, len(flags), batch) if any(flags[i : i + batch])), [])
    skipped = sum(flags) - sum(first)
    from models.execution.execute import flips_in_tiles

    passes = 1 if spec is not None and flips_in_tiles(spec) else len(plan.flips)
    return dataclasses.replace(plan, skipped=skipped * passes)


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


def _plausible(mpp: Any, source: str) -> tuple[float | None, str | None]:
    try:
        value = float(mpp)
    except (TypeError, ValueError):
        return None, f"the slide declares no mpp ({source})"
    if not math.isfinite(value) or not MPP_RANGE[0] <= value <= MPP_RANGE[1]:
        return None, (
            f"the slide's mpp {value:.4g} um/px ({source}) is implausible (outside {MPP_RANGE[0]}-"
            f"{MPP_RANGE[1]} um/px)"
        )
    return value, None


def is_slide_tiff(path: Path) -> bool:
    """Whether the TIFF at ``path`` is a slide (see the module docstring): its first series also
    has axes ``YX`` or ``YXS`` and dtype uint8, what the slide readers return (a channel-first
    ``CYX`` or a 16-bit fluorescence pyramid is read as any other TIFF); ``False`` for any file
    tifffile cannot open."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            if series.axes not in ("YX", "YXS") or np.dtype(series.dtype) != np.uint8:
                return False
            if any(getattr(tif, flag, False) for flag in _SLIDE_FLAGS):
                return True
            return bool(series.is_pyramidal and len(series.levels) > 1 and tif.pages.first.is_tiled)
    except Exception:  # noqa: BLE001 - not a readable TIFF: not a slide
        return False


def probe_slide(path: Path) -> SlideInfo | None:
    """The :class:`SlideInfo` of a TIFF-family slide, ``None`` when ``path`` is no slide.

    Raises:
        UnusableInputError: a slide that neither reader opens (named, with the reason).
    """
    if not is_slide_tiff(path):
        return None
    try:
        import tiffslide
    except ImportError:  # the `slides` extra is absent: tifffile's own levels
        return _probe_tifffile(path)
    try:
        with tiffslide.TiffSlide(path) as slide:
            props = slide.properties
            levels = tuple(
                (int(w), int(h), float(d))
                for (w, h), d in zip(slide.level_dimensions, slide.level_downsamples, strict=True)
            )
            mpp, note = _plausible(props.get("tiffslide.mpp-x"), "tiffslide.mpp-x")
            vendor = props.get("tiffslide.vendor") or "generic-tiff"
    except Exception as exc:  # noqa: BLE001 - named below
        raise UnusableInputError(f"a slide that tiffslide cannot open: {type(exc).__name__}: {exc}") from exc
    return SlideInfo("tiffslide", str(vendor), levels, mpp, note)


def _probe_tifffile(path: Path) -> SlideInfo:
    import tifffile

    with tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        axes = series.axes
        shapes = [lvl.shape for lvl in series.levels]
        w0 = shapes[0][axes.index("X")]
        levels = tuple(
            (int(s[axes.index("X")]), int(s[axes.index("Y")]), w0 / s[axes.index("X")]) for s in shapes
        )
        vendor = next((f[3:] for f in _SLIDE_FLAGS if getattr(tif, f, False)), "generic-tiff")
        page = tif.pages.first
        mpp, note = None, "tifffile reads no slide mpp (install the `slides` extra for tiffslide)"
        if page.tags.get("XResolution") is not None and page.tags.get("ResolutionUnit") is not None:
            num, den = page.tags["XResolution"].value
            unit = int(page.tags["ResolutionUnit"].value)
            per_cm = {2: 2.54, 3: 1.0}.get(unit)
            if per_cm and num:
                mpp, note = _plausible(1e4 * per_cm / (num / den), "the XResolution tag")
    return SlideInfo("tifffile", vendor, levels, mpp, note)


def open_slide(path: Path, info: SlideInfo | None = None) -> _Slide:
    """The slide at ``path`` opened with its reader (``info.reader``); a DICOM-WSI file or an MRXS
    index (no TIFF) through OpenSlide.

    Raises:
        UnusableInputError: no reader opens it (the message names the format and the missing extra).
    """
    if info is None:
        info = probe_slide(path)
    if info is None or info.reader == "openslide":
        return _OpenSlide(path)
    if info.reader == "tiffslide":
        return _TiffSlide(path, info)
    return _TifffileSlide(path, info)


class _Slide:
    """One open slide: :attr:`info` and :meth:`read` of a level's region as ``(h, w, 3)`` uint8."""

    info: SlideInfo
    #: the pixels' dtype (uint8 for brightfield RGB; uint16 for some fluorescence slides)
    dtype: np.dtype[Any] = np.dtype(np.uint8)

    def level_shape(self, level: int) -> tuple[int, int]:
        """``(height, width)`` of ``level``."""
        w, h, _ = self.info.levels[level]
        return h, w

    def read(self, level: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release the file."""


def _rgb(block: np.ndarray) -> np.ndarray:
    """``(h, w, 3)`` uint8 from a level's ``(h, w[, S])`` block (grey repeated, alpha dropped)."""
    if block.ndim == 2:
        block = block[..., None]
    if block.shape[-1] == 1:
        block = np.repeat(block, 3, axis=-1)
    return np.ascontiguousarray(block[..., :3])


class _TiffSlide(_Slide):
    def __init__(self, path: Path, info: SlideInfo) -> None:
        import tiffslide

        self.info = info
        self._slide = tiffslide.TiffSlide(path)
        self._group = self._slide.zarr_group
        self.dtype = np.dtype(self._group["0"].dtype)
        self._lock = threading.Lock()
        self.tiles = TileCache()  # decoded stored tiles: each decoded once while regions share it

    def read(self, level: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        with self._lock:  # one zarr store, one file handle
            return _rgb(read_tiles(self._group[str(level)], y0, y1, x0, x1, self.tiles, level))

    def close(self) -> None:
        self.tiles.clear()
        self._slide.close()


class _TifffileSlide(_Slide):
    def __init__(self, path: Path, info: SlideInfo) -> None:
        import tifffile
        import zarr

        self.info = info
        self._stores = [
            tifffile.imread(path, aszarr=True, series=0, level=k) for k in range(len(info.levels))
        ]
        self._arrays = [zarr.open(s, mode="r") for s in self._stores]
        self.dtype = np.dtype(self._arrays[0].dtype)
        self._lock = threading.Lock()
        self.tiles = TileCache()  # decoded stored tiles: each decoded once while regions share it

    def read(self, level: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        with self._lock:
            return _rgb(read_tiles(self._arrays[level], y0, y1, x0, x1, self.tiles, level))

    def close(self) -> None:
        self.tiles.clear()
        for store in self._stores:
            store.close()


class _OpenSlide(_Slide):
    def __init__(self, path: Path, what: str = "not a TIFF-family slide") -> None:
        try:
            import openslide
        except ImportError:
            raise UnusableInputError(f"{what}: DICOM-WSI and MRXS need the `openslide` extra") from None
        try:
            self._slide = openslide.OpenSlide(str(path))
        except openslide.OpenSlideError as exc:
            raise UnusableInputError(f"{path.name}: OpenSlide cannot open it: {exc}") from exc
        props = self._slide.properties
        levels = tuple(
            (int(w), int(h), float(d))
            for (w, h), d in zip(self._slide.level_dimensions, self._slide.level_downsamples, strict=True)
        )
        mpp, note = _plausible(props.get("openslide.mpp-x"), "openslide.mpp-x")
        self.info = SlideInfo("openslide", props.get("openslide.vendor"), levels, mpp, note)

    def read(self, level: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        d = self.info.levels[level][2]
        rgba = np.asarray(self._slide.read_region((round(x0 * d), round(y0 * d)), level, (x1 - x0, y1 - y0)))
        rgb = rgba[..., :3].copy()
        rgb[rgba[..., 3] == 0] = 255  # transparent (beyond the scanned area): white, as OpenSlide shows it
        return rgb

    def close(self) -> None:
        self._slide.close()


@dataclass(frozen=True)
class Resolution:
    """Where a slide is read: ``level``, resampled by ``factor`` (target mpp / level mpp; 1: as it
    is), giving ``shape`` ``(H, W)`` at ``mpp`` microns per pixel (``None`` when unknown)."""

    level: int
    factor: float
    shape: tuple[int, int]
    mpp: float | None
    note: str | None = None


def choose_resolution(info: SlideInfo, spec_mpp: float | None, mpp: Any, level: int | None) -> Resolution:
    """The level and resampling of a request (see the module docstring).

    Args:
        info: the slide.
        spec_mpp: the model's trained mpp (the spec's ``mpp``), or ``None``.
        mpp: the request's ``mpp``: ``None`` or ``"model"`` (the spec's), or a number.
        level: the request's ``level`` (excludes ``mpp``).

    Raises:
        UnusableInputError: a level the slide lacks; a target mpp on a slide without a plausible
            one (the message says to give ``level``); a target finer than :data:`MIN_MPP_RATIO`
            times the slide's level-0 mpp (the read shape is thus at most twice level 0 per side).
    """
    if level is not None:
        if not 0 <= level < len(info.levels):
            raise UnusableInputError(f"level={level}: the slide has levels 0-{len(info.levels) - 1}")
        w, h, d = info.levels[level]
        return Resolution(level, 1.0, (h, w), None if info.mpp is None else info.mpp * d)
    target = spec_mpp if mpp is None or str(mpp) == "model" else float(mpp)
    w0, h0, _ = info.levels[0]
    if target is None:
        return Resolution(0, 1.0, (h0, w0), info.mpp, info.mpp_note)
    if info.mpp is None:
        why = "the model's" if mpp is None or str(mpp) == "model" else "the requested"
        raise UnusableInputError(
            f"{info.mpp_note}; {why} mpp {target:g} um/px cannot be matched without guessing: give level=N "
            f"(levels: {', '.join(f'{k}: {w}x{h}' for k, (w, h, _) in enumerate(info.levels))})"
        )
    if not math.isfinite(target) or target < info.mpp * MIN_MPP_RATIO:
        why = "the model's" if mpp is None or str(mpp) == "model" else "the requested"
        raise UnusableInputError(
            f"{why} mpp {target:g} um/px is finer than this slide holds: level 0 is {info.mpp:g} um/px, "
            f"and a slide is upsampled at most {1 / MIN_MPP_RATIO:g}x (mpp >= {info.mpp * MIN_MPP_RATIO:g}); "
            "ask for a coarser mpp or a level"
        )
    fine = [k for k, (_, _, d) in enumerate(info.levels) if info.mpp * d <= target * (1 + MPP_SAME)]
    k = max(fine, key=lambda j: info.levels[j][2]) if fine else 0
    w, h, d = info.levels[k]
    factor = target / (info.mpp * d)
    if abs(factor - 1) <= MPP_SAME:
        return Resolution(k, 1.0, (h, w), info.mpp * d)
    shape = (max(1, round(h / factor)), max(1, round(w / factor)))
    return Resolution(k, factor, shape, target)


class TissueMask:
    """Tissue on a low level: saturation (HSV) above Otsu's threshold (clamped to 0.02-0.08, so a
    slide that is all tissue is never split in two), dark (mean optical density above 0.25) or
    further than :data:`GLASS_TOLERANCE` from the glass's colour (the median of the rest), dilated
    by 2 mask pixels, holes filled; and the glass colour, read at the background pixel farthest
    from tissue.

    Args:
        thumb: ``(h, w, 3)`` uint8, the whole slide at a low resolution.
        out_shape: ``(H, W)`` of the image the regions are asked in.

    Notes:
        Memory: the thumbnail (at most :data:`MASK_SIDE` squared times 3 bytes, 12 MiB) and an
        int32 integral image of the mask (16 MiB at most).

    Source:
        Otsu on saturation: CLAM (Lu et al., Nature BME 2021) ``segmentTissue``; scikit-image's
        ``threshold_otsu`` and ``rgb2hsv``.
    """

    def __init__(self, thumb: np.ndarray, out_shape: tuple[int, int]) -> None:
        from scipy import ndimage
        from skimage.color import rgb2hsv
        from skimage.filters import threshold_otsu

        sat = rgb2hsv(thumb)[..., 1]
        threshold = float(threshold_otsu(sat)) if float(np.ptp(sat)) > 0 else 1.0
        threshold = min(max(threshold, 0.02), 0.08)
        density = -np.log10(np.maximum(thumb.astype(np.float32), 1.0) / 255.0).mean(axis=-1)
        tissue = (sat > threshold) | (density > 0.25)
        if not tissue.all():  # and any colour away from the glass's (unstained but not empty)
            glass = np.median(thumb[~tissue], axis=0)
            tissue |= np.abs(thumb.astype(np.float32) - glass).max(axis=-1) > GLASS_TOLERANCE
        # holes (a lumen, a fat cell) are tissue: only glass open to the slide's edge is skipped
        self.tissue = ndimage.binary_fill_holes(ndimage.binary_dilation(tissue, iterations=2))
        self.thumb_shape = tuple(int(n) for n in tissue.shape)
        self.out_shape = out_shape
        self._sum = np.pad(self.tissue.astype(np.int32).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
        self.fraction = float(self.tissue.mean())
        background = ~self.tissue
        self.far: tuple[float, float] | None = None
        if background.any():  # the glass pixel farthest from tissue, as a fraction of the image
            dist = ndimage.distance_transform_edt(np.pad(background, 1))[1:-1, 1:-1]
            ty, tx = np.unravel_index(int(np.argmax(dist)), dist.shape)
            self.far = ((ty + 0.5) / self.thumb_shape[0], (tx + 0.5) / self.thumb_shape[1])

    def background_grid(self, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """:meth:`background` of every box ``ys[i] x xs[j]`` (``ys``: ``(n, 2)`` rows ``[y0, y1)``,
        ``xs``: ``(m, 2)``) at once: ``(n, m)`` bool."""
        (H, W), (h, w) = self.out_shape, self.thumb_shape

        def thumb_span(spans: np.ndarray, n_out: int, n_thumb: int) -> tuple[np.ndarray, np.ndarray]:
            a = np.clip(spans[:, 0], 0, None) * n_thumb // n_out  # floor, integer exact
            b = -(-np.minimum(spans[:, 1], n_out) * n_thumb // n_out)  # ceil
            return a, np.maximum(b, a + 1)

        ty0, ty1 = thumb_span(np.asarray(ys, np.int64).reshape(-1, 2), H, h)
        tx0, tx1 = thumb_span(np.asarray(xs, np.int64).reshape(-1, 2), W, w)
        s = self._sum
        total = s[ty1[:, None], tx1[None]] - s[ty0[:, None], tx1[None]] - s[ty1[:, None], tx0[None]]
        return (total + s[ty0[:, None], tx0[None]]) == 0

    def background(self, y0: int, y1: int, x0: int, x1: int) -> bool:
        """Whether the region ``[y0, y1) x [x0, x1)`` (out pixels, clipped to the image) has no tissue."""
        H, W = self.out_shape
        h, w = self.thumb_shape
        ty0, ty1 = math.floor(max(y0, 0) * h / H), math.ceil(min(y1, H) * h / H)
        tx0, tx1 = math.floor(max(x0, 0) * w / W), math.ceil(min(x1, W) * w / W)
        ty1, tx1 = max(ty1, ty0 + 1), max(tx1, tx0 + 1)
        s = self._sum
        return int(s[ty1, tx1] - s[ty0, tx1] - s[ty1, tx0] + s[ty0, tx0]) == 0


def thumbnail(slide: _Slide, max_side: int = MASK_SIDE) -> np.ndarray:
    """The whole slide as ``(h, w, 3)`` uint8 with ``max(h, w) <= max_side``: the coarsest level,
    read in row strips and block-averaged by an integer factor ``k`` when it is still larger
    (``h = ceil(H / k)``: the last block of each axis is ragged, averaged over what it holds, so a
    level thinner than ``k`` still gives one row)."""
    level = len(slide.info.levels) - 1
    H, W = slide.level_shape(level)
    k = max(1, math.ceil(max(H, W) / max_side))
    h, w = -(-H // k), -(-W // k)
    out = np.zeros((h, w, 3), np.uint8)
    rows = max(k, (16 << 20) // max(W * 3, 1) // k * k)
    cols = np.arange(0, W, k)
    col_n = np.diff(np.append(cols, W)).astype(np.float32)
    for y in range(0, H, rows):
        block = slide.read(level, y, min(y + rows, H), 0, W).astype(np.float32)
        starts = np.arange(0, block.shape[0], k)
        if k > 1:
            row_n = np.diff(np.append(starts, block.shape[0])).astype(np.float32)
            sums = np.add.reduceat(np.add.reduceat(block, starts, axis=0), cols, axis=1)
            block = sums / (row_n[:, None, None] * col_n[None, :, None])
        out[y // k : y // k + len(starts)] = np.round(block).astype(np.uint8)
    return out


class SlideRegions(RegionSource):
    """A slide read by region at one :class:`Resolution`: ``(3, H, W)``, uint8 when a level is
    read as it is, float32 when resampled. With a ``mask``, a region wholly outside the tissue is
    ``glass`` (per channel) and is not read.

    Args:
        slide: the open slide (closed by :meth:`close`).
        resolution: the level and resampling.
        mask: the tissue mask (``mask=auto``), or ``None`` (every region is read).
    """

    def __init__(self, slide: _Slide, resolution: Resolution, mask: TissueMask | None = None) -> None:
        self.slide = slide
        self.resolution = resolution
        self.shape = (3, *resolution.shape)
        self.dtype = slide.dtype if resolution.factor == 1.0 else np.dtype(np.float32)
        self.slab_axis = 0
        self.mask = mask
        self.glass: np.ndarray | None = None
        if mask is not None and mask.far is not None:
            fy, fx = mask.far
            H, W = resolution.shape
            cy, cx = int(fy * H), int(fx * W)
            patch = self._read(max(cy - 4, 0), min(cy + 4, H), max(cx - 4, 0), min(cx + 4, W))
            self.glass = np.median(patch.reshape(3, -1), axis=1).astype(self.dtype)
        self.regions_skipped = 0

    def close(self) -> None:
        """Close the slide."""
        self.slide.close()

    def __getitem__(self, key: Any) -> np.ndarray:
        from service.regions import _full

        c, ys, xs = _full(key, 3)
        H, W = self.resolution.shape
        y0, y1, _ = ys.indices(H)
        x0, x1, _ = xs.indices(W)
        if self.glass is not None and self.mask is not None and self.mask.background(y0, y1, x0, x1):
            self.regions_skipped += 1
            block = np.broadcast_to(self.glass[:, None, None], (3, max(y1 - y0, 0), max(x1 - x0, 0)))
            return np.ascontiguousarray(block[c])
        return np.ascontiguousarray(self._read(y0, y1, x0, x1)[c])

    def _read(self, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        level, f = self.resolution.level, self.resolution.factor
        if y1 <= y0 or x1 <= x0:
            return np.zeros((3, max(y1 - y0, 0), max(x1 - x0, 0)), self.dtype)
        if f == 1.0:
            return np.moveaxis(self.slide.read(level, y0, y1, x0, x1), -1, 0)
        Hs, Ws = self.slide.level_shape(level)
        (iy, jy, wy), (ix, jx, wx) = _taps(y0, y1, f, Hs), _taps(x0, x1, f, Ws)
        r0, r1, c0, c1 = int(iy.min()), int(jy.max()) + 1, int(ix.min()), int(jx.max()) + 1
        block = self.slide.read(level, r0, r1, c0, c1).astype(np.float32)
        rows = block[iy - r0] * (1 - wy)[:, None, None] + block[jy - r0] * wy[:, None, None]
        out = rows[:, ix - c0] * (1 - wx)[None, :, None] + rows[:, jx - c0] * wx[None, :, None]
        return np.moveaxis(out.astype(np.float32), -1, 0)


def _taps(a: int, b: int, f: float, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps of output pixels ``a .. b - 1`` on a source axis of ``n`` pixels:
    ``(lower index, upper index, weight of the upper)``, pixel centres aligned."""
    pos = np.clip((np.arange(a, b, dtype=np.float64) + 0.5) * f - 0.5, 0, n - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    return lo, hi, (pos - lo).astype(np.float32)


def open_slide_regions(path: Path, info: SlideInfo, resolution: Resolution, mask: bool) -> SlideRegions:
    """The slide at ``path`` as a :class:`SlideRegions` at ``resolution``, with a tissue mask made
    from a low level when ``mask`` (skipped with a log line when scikit-image is absent)."""
    slide = open_slide(path, info)
    tissue = None
    if mask:
        try:
            tissue = TissueMask(thumbnail(slide), resolution.shape)
        except ImportError:
            logger.warning("mask=auto needs scikit-image (the `slides` extra): every tile is read")
    return SlideRegions(slide, resolution, tissue)


def background_tiles(grid: Any, mask: TissueMask) -> list[bool]:
    """Per tile of ``grid`` (C order): whether its whole read region (halo and padding included,
    as :func:`tiling.reuse.read_box` gives it) lies outside the tissue; ``grid`` is 2D ``(H, W)``.
    One integral-image look-up per tile, vectorized: a million tiles cost milliseconds."""
    spans = [np.array([(s - a.pad_lo, s - a.pad_lo + a.tile) for s in a.starts], np.int64) for a in grid.axes]
    return mask.background_grid(spans[0], spans[1]).ravel().tolist()

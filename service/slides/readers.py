"""Slide readers: a slide's levels, mpp and vendor, and its pixels by level and region (issue 21 item 1).

Shapes: regions are ``(h, w, 3)`` uint8 (RGB) at the level read; levels are listed
``[width, height, downsample]`` as slide readers do.

A TIFF is a *slide* by content, not by name: tifffile flags it as a slide format (SVS, NDPI, SCN,
Philips, BIF, QPI) or it is tiled with several pyramid levels (SubIFDs of an OME-TIFF, or
reduced-resolution pages of a generic tiled TIFF), and its pixels are 8-bit ``YX`` or ``YXS``.
The reader is chosen per file and named in the plan: ``tiffslide`` (the TIFF family; BSD, pure
Python on tifffile), else ``tifffile`` (its own pyramid levels, when the ``slides`` extra is
absent), and ``openslide`` (extra ``openslide``) for what no TIFF reader opens (DICOM-WSI, MRXS).
Regions are read lazily through the level's zarr store (only the tiles a region touches are
decoded); nothing decodes a whole level. A slide whose mpp is missing or implausible (outside
:data:`MPP_RANGE`: a 72 dpi resolution tag read as 352.8 um/px) is never guessed
(:mod:`service.slides.resolution`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import UnusableInputError
from service.slides.tilecache import TileCache, read_tiles

if TYPE_CHECKING:
    import zarr

    from service.codecs.volume import Probe

__all__ = [
    "MPP_RANGE",
    "SlideInfo",
    "WSI_SOP_CLASS",
    "is_slide_tiff",
    "open_slide",
    "probe_dicom_wsi",
    "probe_slide",
    "slide_info",
    "slide_probe",
]

#: Plausible microns per pixel of a slide level 0 (40x is about 0.25, 1.25x about 8).
MPP_RANGE = (0.02, 20.0)
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


def slide_probe(info: SlideInfo, kind: str = "tiff") -> Probe:
    """The :class:`~service.codecs.Probe` of a slide: level 0 ``(H, W)``, 3 channels, uint8; its
    ``info`` holds ``slide: true``, :meth:`SlideInfo.describe`'s keys (``mpp_note`` too) and
    ``level_used`` 0 (what a request with no ``mpp`` or ``level`` reads for a model without an
    ``mpp``; :func:`service.slides.request.set_level_used` sets a request's)."""
    from service.codecs.volume import Probe

    w, h, _ = info.levels[0]
    return Probe(kind, (h, w), 3, np.dtype(np.uint8), w * h * 3,
                 {"slide": True, **info.describe(), "mpp_note": info.mpp_note, "level_used": 0})  # fmt: skip


#: SOP class of DICOM whole-slide images (VL Whole Slide Microscopy Image Storage).
WSI_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.77.1.6"


def probe_dicom_wsi(path: Path) -> Probe | None:
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
        mpp: float | None = None
        note: str | None = "tifffile reads no slide mpp (install the `slides` extra for tiffslide)"
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
        self.dtype = np.dtype(self._level(0).dtype)
        self._lock = threading.Lock()
        self.tiles = TileCache()  # decoded stored tiles: each decoded once while regions share it

    def _level(self, level: int) -> zarr.Array[Any]:
        import zarr

        array = self._group[str(level)]
        assert isinstance(array, zarr.Array)  # tiffslide's group holds one array per level
        return array

    def read(self, level: int, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
        with self._lock:  # one zarr store, one file handle
            return _rgb(read_tiles(self._level(level), y0, y1, x0, x1, self.tiles, level))

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
        self._arrays = [zarr.open_array(s, mode="r") for s in self._stores]
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

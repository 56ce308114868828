"""Image headers: what a PNG, JPEG or TIFF holds (size, channels, dtype, orientation), no pixel decoded.

One job: :func:`probe_image`, from the PNG ``IHDR`` chunk, Pillow's lazy ``Image.open`` and
tifffile's page shapes; plus the helpers the decoders share with it (``_malformed``, lazy opening,
TIFF layout). See :mod:`service.codecs.images` for the readers it chooses between.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image, JpegImagePlugin, PngImagePlugin, TiffImagePlugin

from service.codecs.volume import Probe
from service.errors import (
    DecodeError,
    ServiceError,
    UnusableInputError,
)
from service.sniff import Sniffed

__all__ = ["probe_image", "tiff_layout"]

logger = logging.getLogger("service.codecs.images")

_GREY_MODES = {"L", "I", "F", "I;16", "I;16B", "I;16L", "I;16N", "1", "LA", "La"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: PNG colour type: (channels after decoding, samples per pixel in the file)
_PNG_COLOUR_TYPES = {0: (1, 1), 2: (3, 3), 3: (3, 1), 4: (1, 2), 6: (3, 4)}
_PNG_BIT_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_EXIF_ORIENTATION = 0x0112


@contextlib.contextmanager
def _malformed(kind: str) -> Iterator[None]:
    """Translate whatever a foreign decoder raises on a malformed file into :class:`DecodeError`.

    Pillow, tifffile and libpng raise a wide range of types on crafted input (``ZeroDivisionError``,
    ``AssertionError``, ``TypeError`` ...): on untrusted bytes each is a fault of the file, a 422,
    never a 500. Our own errors and ``MemoryError`` pass through.
    """
    try:
        yield
    except (ServiceError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.info("%s decoder failed", kind, exc_info=True)
        raise DecodeError(f"corrupt or truncated {kind} file: {type(exc).__name__}: {exc}") from exc


def _png_ihdr(path: Path) -> tuple[int, int, int, int]:
    """``(width, height, bit depth, colour type)`` from a PNG's ``IHDR`` chunk.

    Raises:
        DecodeError: no valid ``IHDR`` first, or a zero width or height.
    """
    with open(path, "rb") as fh:
        head = fh.read(33)
    if len(head) < 33 or head[12:16] != b"IHDR" or struct.unpack(">I", head[8:12])[0] != 13:
        raise DecodeError("corrupt or truncated PNG file: no IHDR chunk where the format puts it")
    width, height, depth, colour = struct.unpack(">IIBB", head[16:26])
    if width == 0 or height == 0:
        raise DecodeError(f"corrupt PNG header: {width}x{height} pixels (every axis needs at least one)")
    if colour not in _PNG_COLOUR_TYPES or depth not in _PNG_BIT_DEPTHS[colour]:
        raise DecodeError(f"corrupt PNG header: bit depth {depth} with colour type {colour}")
    return width, height, depth, colour


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1..8) known without decoding pixels; 1 when absent."""
    if img.format == "PNG":  # Pillow's PNG getexif() decodes the image: read eXIf only if already seen
        raw = img.info.get("exif")
        if not raw:
            return 1
        exif = Image.Exif()
        exif.load(raw)
    else:
        exif = img.getexif()
    value = exif.get(_EXIF_ORIENTATION, 1)
    return int(value) if isinstance(value, int) and 1 <= value <= 8 else 1


_PLUGINS: dict[str, Callable[[str], Image.Image]] = {
    "png": PngImagePlugin.PngImageFile,
    "jpeg": JpegImagePlugin.JpegImageFile,
    "tiff": TiffImagePlugin.TiffImageFile,
}


def _open_lazily(path: Path, kind: str) -> Image.Image:
    """Pillow's header parse of ``kind`` (no pixel decoded), without its process-wide
    decompression-bomb check: the probe's own limits decide, with the caller's values.

    Raises:
        DecodeError: not a readable image of this kind.
    """
    with _malformed(kind.upper()):
        image: Image.Image = _PLUGINS[kind](str(path))
    return image


def _pillow_channels(mode: str) -> int:
    return 1 if mode in _GREY_MODES else 3


def _probe_pillow(path: Path, kind: str, png: tuple[int, int, int, int] | None) -> Probe:
    with _open_lazily(path, kind) as img, _malformed(kind.upper()):
        width, height = img.size
        mode, bands = img.mode, len(img.getbands())
        orientation = _orientation(img)
    if orientation >= 5:  # transposed for display
        width, height = height, width
    if width < 1 or height < 1:
        raise DecodeError(f"corrupt {kind.upper()} header: {width}x{height} pixels")
    dtype: np.dtype
    channels, dtype, reader = _pillow_channels(mode), np.dtype(np.uint8), "pillow"
    sample_bytes = bands * max(1, np.dtype(_pillow_dtype(mode)).itemsize)
    if png is not None:
        _, _, depth, colour = png
        channels, samples = _PNG_COLOUR_TYPES[colour]
        if depth == 16:
            dtype = np.dtype(np.uint16)
            reader = "pillow" if colour == 0 else "imagecodecs"  # Pillow has no 16-bit colour mode
        sample_bytes = samples * max(1, depth // 8)
    else:
        dtype = np.dtype(_pillow_dtype(mode))
    return Probe(
        kind=kind,
        spatial_shape=(height, width),
        channels=channels,
        dtype=dtype,
        nbytes=width * height * sample_bytes,
        info={"reader": reader, "mode": mode, "orientation": orientation, "bit_depth": png and png[2]},
    )


def _pillow_dtype(mode: str) -> type:
    if mode.startswith("I;16"):
        return np.uint16
    return {"I": np.int32, "F": np.float32}.get(mode, np.uint8)


def tiff_layout(axes: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, list[int], int | None]:
    """``(spatial shape, channels, kept axes, channel axis among them)`` of a tifffile series.

    Raises:
        DecodeError: an axis of length 0.
        UnusableInputError: neither an image nor a volume.
    """
    if any(n < 1 for n in shape):
        raise DecodeError(f"corrupt TIFF: axes {axes!r} of shape {shape} (every axis needs at least one)")
    keep = [i for i, (a, n) in enumerate(zip(axes, shape, strict=True)) if n > 1 or a in "YX"]
    kept = "".join(axes[i] for i in keep)
    channel = next((kept.index(a) for a in "SC" if a in kept), None)
    spatial = tuple(shape[i] for j, i in enumerate(keep) if j != channel)
    channels = shape[keep[channel]] if channel is not None else 1
    if len(spatial) not in (2, 3):
        raise UnusableInputError(f"TIFF with axes {axes!r} and shape {shape} is neither 2D nor 3D")
    return spatial, channels, keep, channel


#: tifffile flags of formats whose extra series are known extras (slide pyramids, labels, macros).
_MULTI_SERIES_FORMATS = ("is_svs", "is_ndpi", "is_scn", "is_ome", "is_philips", "is_bif", "is_qpi")


def _check_one_series(tif: tifffile.TiffFile) -> None:
    """Refuse a plain TIFF whose pages make several images (pages that differ in shape or type):
    only the first would be read, the others silently dropped.

    Raises:
        UnusableInputError: more than one series in a TIFF that is not a slide or OME format.
    """
    if len(tif.series) < 2 or any(getattr(tif, flag, False) for flag in _MULTI_SERIES_FORMATS):
        return
    shapes = [tuple(int(n) for n in s.shape) for s in tif.series[:4]]
    more = f" and {len(tif.series) - 4} more" if len(tif.series) > 4 else ""
    raise UnusableInputError(
        f"TIFF of {len(tif.pages)} pages holds {len(tif.series)} images of shapes "
        f"{', '.join(map(str, shapes))}{more}; tilewise reads one image, or one volume of pages of one "
        "shape and type: split the file"
    )


def _probe_tiff(path: Path) -> Probe:
    from service.slides import probe_slide, slide_probe

    slide = probe_slide(path)
    if slide is not None:  # a pyramidal slide by content: its level 0, read by region
        return slide_probe(slide)
    with _malformed("TIFF"), tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        axes, shape = series.axes, tuple(int(n) for n in series.shape)
        dtype = np.dtype(series.dtype)
        single_page = len(tif.pages) == 1
        _check_one_series(tif)
    spatial, channels, _, _ = tiff_layout(axes, shape)
    if min(spatial) < 2:
        raise UnusableInputError(
            f"TIFF of shape {shape} (axes {axes!r}) is a {'x'.join(map(str, spatial))} image: an image needs "
            "at least 2 pixels per axis (1x1 pages are not stacked into a column)"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    info = {"reader": "tifffile", "axes": axes, "shape": shape}
    if single_page and len(spatial) == 2 and dtype in (np.dtype(np.uint8), np.dtype(bool)):
        try:
            pillow = _probe_pillow(path, "tiff", None)
        except DecodeError as exc:
            logger.info("Pillow cannot open this TIFF (%s); tifffile reads it", exc)
        else:
            if pillow.dtype == np.uint8:
                return Probe("tiff", pillow.spatial_shape, pillow.channels, pillow.dtype, nbytes, pillow.info)
    return Probe("tiff", spatial, channels, dtype.newbyteorder("="), nbytes, info)


def probe_image(path: Path, sniffed: Sniffed) -> Probe:
    """What a PNG, JPEG or TIFF declares, from its header alone (no pixel is decoded).

    Raises:
        DecodeError: a corrupt or truncated header, or an axis of length 0.
        UnusableInputError: a TIFF layout that is neither an image nor a volume.
    """
    if sniffed.kind == "tiff":
        return _probe_tiff(path)
    png = _png_ihdr(path) if sniffed.kind == "png" else None
    return _probe_pillow(path, sniffed.kind, png)

"""PNG, JPEG and TIFF reading and PNG / TIFF / NPY writing.

Every read starts with :func:`probe_image`, from the header alone: the PNG ``IHDR`` chunk,
Pillow's lazy ``Image.open`` (size, mode, EXIF orientation; no pixel decoded) and tifffile's page
shapes and sample format. :func:`decode_image` checks that against the limits first, then picks
the reader that represents the samples exactly:

==================================================  ============================================
Input                                               Reader
==================================================  ============================================
8-bit PNG / JPEG, 16-bit grey PNG                   Pillow (EXIF orientation applied)
16-bit PNG with colour or alpha                     imagecodecs' libpng (Pillow cuts it to 8 bits)
single-page 8-bit or bilevel TIFF                   Pillow (tifffile if Pillow cannot)
other TIFF: 16/32/64-bit, signed, float, stacks     tifffile (honours ``SampleFormat``)
==================================================  ============================================

Pillow's decompression-bomb guard stays on: :func:`configure_pillow` only moves its threshold
(``TILEWISE_MAX_IMAGE_PIXELS``, whose default is Pillow's own). Alpha is dropped, palettes become RGB.

Labels are written as palette PNGs (mode ``P``): the pixel values stay the label ids, and
:data:`LABEL_PALETTE` gives each id its own colour, so a 0/1 mask is visible in any viewer.
"""

from __future__ import annotations

import colorsys
import contextlib
import logging
import math
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image, ImageOps, JpegImagePlugin, PngImagePlugin, TiffImagePlugin

from service.codecs.volume import DecodedVolume, Probe
from service.errors import (
    BadParameterError,
    DecodeError,
    PayloadTooLargeError,
    ServiceError,
    UnusableInputError,
)
from service.sniff import Sniffed

__all__ = [
    "LABEL_PALETTE",
    "configure_pillow",
    "decode_image",
    "encode_npy",
    "encode_png",
    "encode_tiff",
    "label_image",
    "probe_image",
]

logger = logging.getLogger(__name__)

_GREY_MODES = {"L", "I", "F", "I;16", "I;16B", "I;16L", "I;16N", "1", "LA", "La"}
_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)
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


def _label_palette() -> list[tuple[int, int, int]]:
    """256 distinct colours: 0 black (background), 1..6 the primaries and secondaries, then hues
    a golden angle apart, cycling through three brightness levels."""
    colours = [(0, 0, 0), (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]
    seen = set(colours)
    i = 0
    while len(colours) < 256:
        i += 1
        hue = (i * 0.618033988749895) % 1.0
        value = (1.0, 0.75, 0.5)[i % 3]
        rgb = tuple(round(c * 255) for c in colorsys.hsv_to_rgb(hue, 0.85, value))
        if rgb not in seen:
            seen.add(rgb)
            colours.append(rgb)  # type: ignore[arg-type]
    return colours


#: RGB colour of each label id in a label PNG (index = label id).
LABEL_PALETTE: list[tuple[int, int, int]] = _label_palette()


def configure_pillow(max_image_pixels: int) -> None:
    """Set Pillow's decompression-bomb threshold (process-wide; it warns above, fails at twice)."""
    Image.MAX_IMAGE_PIXELS = max_image_pixels


# -- probing ----------------------------------------------------------------------------------------


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


_PLUGINS = {
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


def _tiff_layout(axes: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, list[int], int | None]:
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


def _probe_tiff(path: Path) -> Probe:
    with _malformed("TIFF"), tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        axes, shape = series.axes, tuple(int(n) for n in series.shape)
        dtype = np.dtype(series.dtype)
        single_page = len(tif.pages) == 1
    spatial, channels, _, _ = _tiff_layout(axes, shape)
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


# -- decoding ---------------------------------------------------------------------------------------


def _pillow_array(img: Image.Image) -> np.ndarray:
    """Pixels of a loaded image as ``(C, H, W)``: grey modes give C=1, colour modes C=3."""
    mode = img.mode
    if mode == "1":
        img = img.convert("L")
    elif mode in {"LA", "La", "PA"}:
        img = img.getchannel(0) if mode != "PA" else img.convert("RGBA").convert("RGB")
    elif mode in {"RGBA", "RGBa", "RGBX"}:
        img = img.convert("RGB")
    elif img.mode not in _GREY_MODES and img.mode != "RGB":
        img = img.convert("RGB")  # P, CMYK, YCbCr, LAB, HSV
    array = np.asarray(img)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if array.ndim == 2:
        return array[None]
    return np.ascontiguousarray(np.moveaxis(array, -1, 0))


def _decode_with_pillow(path: Path, sniffed: Sniffed) -> DecodedVolume | None:
    """Decode with Pillow; ``None`` for a TIFF that Pillow cannot decode (use tifffile)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the probe checked the size
            img = Image.open(path)
        with img:
            info: dict[str, Any] = {"mode": img.mode, "source": "pillow"}
            if "dpi" in img.info:
                info["dpi"] = tuple(float(v) for v in img.info["dpi"])
            img.load()
            upright = ImageOps.exif_transpose(img)
            data = _pillow_array(upright)
    except _BOMB as exc:
        raise PayloadTooLargeError(f"image exceeds the decompression-bomb limit: {exc}") from exc
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure on untrusted bytes is the file's (see _malformed)
        if sniffed.kind == "tiff":
            logger.info("Pillow cannot read this TIFF (%s); trying tifffile", exc)
            return None
        raise DecodeError(f"corrupt or truncated {sniffed.kind.upper()} file: {exc}") from exc
    return DecodedVolume(data=data, kind=sniffed.kind, info=info)


def _orient(array: np.ndarray, orientation: int) -> np.ndarray:
    """Apply EXIF ``orientation`` to ``(H, W, ...)``, as :func:`PIL.ImageOps.exif_transpose` does."""
    if orientation == 2:  # FLIP_LEFT_RIGHT
        return array[:, ::-1]
    if orientation == 3:  # ROTATE_180
        return array[::-1, ::-1]
    if orientation == 4:  # FLIP_TOP_BOTTOM
        return array[::-1]
    if orientation == 5:  # TRANSPOSE
        return array.swapaxes(0, 1)
    if orientation == 6:  # ROTATE_270 (counter-clockwise), i.e. 90 degrees clockwise
        return np.rot90(array, -1)
    if orientation == 7:  # TRANSVERSE
        return array[::-1, ::-1].swapaxes(0, 1)
    if orientation == 8:  # ROTATE_90 (counter-clockwise)
        return np.rot90(array, 1)
    return array


def _decode_png16(path: Path, probe: Probe) -> DecodedVolume:
    """A 16-bit PNG with colour or alpha, every bit kept (libpng through imagecodecs)."""
    import imagecodecs

    with _malformed("PNG"):
        array = imagecodecs.png_decode(path.read_bytes())
    if array.ndim == 3:
        array = array[..., :1] if array.shape[-1] == 2 else array[..., :3]  # drop alpha
    else:
        array = array[..., None]
    array = _orient(array, int(probe.info.get("orientation", 1)))
    data = np.ascontiguousarray(np.moveaxis(array, -1, 0)).astype(np.uint16, copy=False)
    with _open_lazily(path, "png") as img:
        dpi = img.info.get("dpi")
    info: dict[str, Any] = {"mode": probe.info.get("mode"), "source": "imagecodecs"}
    if dpi:
        info["dpi"] = tuple(float(v) for v in dpi)
    return DecodedVolume(data=data, kind="png", info=info)


def _decode_with_tifffile(path: Path) -> DecodedVolume:
    """Decode a TIFF with tifffile: every sample format, multi-channel, page stacks."""
    with _malformed("TIFF"):
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            axes, shape = series.axes, tuple(int(n) for n in series.shape)
            array = series.asarray()
        _, _, keep, channel = _tiff_layout(axes, shape)
        array = array.reshape([shape[i] for i in keep])
    array = np.moveaxis(array, channel, 0) if channel is not None else array[None]
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return DecodedVolume(data=np.ascontiguousarray(array), kind="tiff", info={"source": "tifffile"})


def decode_image(
    path: Path,
    sniffed: Sniffed,
    *,
    max_voxels: int | None = None,
    max_image_pixels: int | None = None,
    max_bytes: int | None = None,
) -> DecodedVolume:
    """Read a PNG, JPEG or TIFF into a :class:`DecodedVolume` of shape ``(C, H, W)``.

    A multi-page TIFF becomes a volume ``(C, pages, H, W)``. The limits are checked from the
    header (:func:`probe_image`) before any pixel is decoded.

    Raises:
        PayloadTooLargeError: more pixels than ``max_image_pixels``, samples than ``max_voxels``
            or bytes once decompressed than ``max_bytes``.
        DecodeError: a corrupt or truncated file.
        UnusableInputError: a TIFF layout that is neither an image nor a volume.
    """
    probe = probe_image(path, sniffed)
    probe.check_limits(max_voxels=max_voxels, max_image_pixels=max_image_pixels, max_bytes=max_bytes)
    reader = probe.info["reader"]
    volume: DecodedVolume | None = None
    if reader == "imagecodecs":
        volume = _decode_png16(path, probe)
    elif reader == "pillow":
        volume = _decode_with_pillow(path, sniffed)
    if volume is None:
        volume = _decode_with_tifffile(path)
    logger.info(
        "decoded %s shape=%s dtype=%s (%s)",
        sniffed.kind.upper(),
        volume.data.shape,
        volume.data.dtype,
        volume.info.get("source"),
    )
    return volume


# -- encoding ---------------------------------------------------------------------------------------


def _planar(array: np.ndarray, spatial_dims: int) -> tuple[np.ndarray, int]:
    """Add the channel axis to labels; return ``(C, *spatial)`` and C."""
    if array.ndim == spatial_dims:
        array = array[None]
    return array, int(array.shape[0])


def _squeeze_to_2d(array: np.ndarray) -> np.ndarray:
    """``(C, H, W, 1)`` (a single-slice NIfTI) to ``(C, H, W)``; other shapes unchanged."""
    while array.ndim > 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return array


def label_image(labels: np.ndarray) -> Image.Image:
    """uint8 labels ``(H, W)`` as a palette image: values stay the ids, colours :data:`LABEL_PALETTE`."""
    image = Image.fromarray(np.ascontiguousarray(labels, dtype=np.uint8))
    image.putpalette([c for rgb in LABEL_PALETTE for c in rgb])  # "L" becomes "P", data unchanged
    return image


def encode_png(volume: DecodedVolume, array: np.ndarray, path: Path) -> None:
    """Write a 2D output as PNG.

    uint8 labels with one channel become a palette PNG (mode ``P``: values are the label ids,
    :data:`LABEL_PALETTE` their colours); with three, an 8-bit RGB PNG. Float values: one channel
    becomes a 16-bit grey PNG (values in [0, 1] scaled to 0..65535, others rounded and clipped to
    0..65535); three channels an 8-bit RGB PNG (0..1 scaled to 0..255).

    Raises:
        BadParameterError: a 3D output, or a channel count PNG cannot hold.
    """
    planar, channels = _planar(array, volume.spatial_dims)
    planar = _squeeze_to_2d(planar)
    if planar.ndim != 3:
        raise BadParameterError(f"format=png needs a 2D output, got spatial shape {planar.shape[1:]}")
    if planar.dtype == np.uint8 and channels == 1:
        image = label_image(planar[0])
    elif planar.dtype == np.uint8 and channels == 3:
        image = Image.fromarray(np.ascontiguousarray(np.moveaxis(planar, 0, -1)))
    elif channels == 1:
        values = planar[0].astype(np.float64)
        if values.size and values.min() >= 0.0 and values.max() <= 1.0:
            values = values * 65535.0
        image = Image.fromarray(np.clip(np.rint(values), 0, 65535).astype(np.uint16))
    elif channels == 3:
        values = np.moveaxis(planar, 0, -1).astype(np.float64)
        if values.size and values.min() >= 0.0 and values.max() <= 1.0:
            values = values * 255.0
        image = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8))
    else:
        raise BadParameterError(f"format=png holds 1 or 3 channels, the output has {channels}; use tiff")
    kwargs: dict[str, Any] = {}
    if "dpi" in volume.info:
        kwargs["dpi"] = volume.info["dpi"]
    image.save(path, format="PNG", **kwargs)


def encode_tiff(volume: DecodedVolume, array: np.ndarray, path: Path) -> None:
    """Write an output as TIFF with its dtype (uint8 labels, float32 values).

    One channel is written as ``(*spatial)``, several as planar ``(C, *spatial)``; the layout
    is recorded in tifffile's shape metadata so ``tifffile.imread`` gives it back.
    """
    planar, channels = _planar(array, volume.spatial_dims)
    if volume.kind != "nifti":
        planar = _squeeze_to_2d(planar)
    data = planar[0] if channels == 1 else planar
    kwargs: dict[str, Any] = {"photometric": "minisblack"}
    if channels > 1 and data.ndim == 3:
        kwargs["planarconfig"] = "separate"
    if "dpi" in volume.info:
        kwargs["resolution"] = tuple(volume.info["dpi"])
        kwargs["resolutionunit"] = "INCH"
    tifffile.imwrite(path, np.ascontiguousarray(data), **kwargs)


def encode_npy(volume: DecodedVolume, array: np.ndarray, path: Path) -> None:  # noqa: ARG001
    """Write the output array as ``.npy``: labels ``(*spatial)``, values ``(C, *spatial)``."""
    np.save(path, np.ascontiguousarray(array), allow_pickle=False)

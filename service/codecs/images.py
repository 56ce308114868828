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

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image, ImageOps

from service.codecs.image_encode import (
    LABEL_PALETTE,
    encode_npy,
    encode_png,
    encode_tiff,
    label_image,
)
from service.codecs.image_probe import (
    _GREY_MODES,
    _malformed,
    _open_lazily,
    probe_image,
    tiff_layout,
)
from service.codecs.volume import DecodedVolume, Probe
from service.errors import DecodeError, PayloadTooLargeError
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

_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)


def configure_pillow(max_image_pixels: int) -> None:
    """Set Pillow's decompression-bomb threshold (process-wide; it warns above, fails at twice)."""
    Image.MAX_IMAGE_PIXELS = max_image_pixels


# -- decoding --------------------------------------------------------------------------------------


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
        _, _, keep, channel = tiff_layout(axes, shape)
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

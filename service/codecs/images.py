"""PNG, JPEG and TIFF reading (Pillow, tifffile as fallback) and PNG / TIFF / NPY writing.

Pillow's decompression-bomb guard stays on: :func:`configure_pillow` only moves its threshold
(``TILEWISE_MAX_IMAGE_PIXELS``), and :func:`decode_image` refuses images above the limit from their
header, before any pixel is decoded. JPEG (and any image with an EXIF orientation tag) is
transposed to its display orientation, so outputs overlay the image as viewers show it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image, ImageOps, UnidentifiedImageError

from service.codecs.volume import DecodedVolume
from service.errors import BadParameterError, DecodeError, PayloadTooLargeError, UnusableInputError
from service.sniff import Sniffed

__all__ = ["configure_pillow", "decode_image", "encode_npy", "encode_png", "encode_tiff"]

logger = logging.getLogger(__name__)

_GREY_MODES = {"L", "I", "F", "I;16", "I;16B", "I;16L", "I;16N"}
_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)


def configure_pillow(max_image_pixels: int) -> None:
    """Set Pillow's decompression-bomb threshold (process-wide; it warns above, fails at twice)."""
    Image.MAX_IMAGE_PIXELS = max_image_pixels


def _check_size(width: int, height: int, *, max_voxels: int | None, max_image_pixels: int | None) -> None:
    pixels = width * height
    if max_image_pixels is not None and pixels > max_image_pixels:
        raise PayloadTooLargeError(
            f"image of {width}x{height} = {pixels} pixels exceeds max_image_pixels={max_image_pixels}"
        )
    if max_voxels is not None and pixels > max_voxels:
        raise PayloadTooLargeError(
            f"image of {width}x{height} = {pixels} pixels exceeds max_voxels={max_voxels}"
        )


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


def _decode_with_pillow(
    path: Path, sniffed: Sniffed, *, max_voxels: int | None, max_image_pixels: int | None
) -> DecodedVolume | None:
    """Decode with Pillow; ``None`` for a TIFF that Pillow cannot represent (use tifffile)."""
    try:
        with Image.open(path) as img:
            _check_size(*img.size, max_voxels=max_voxels, max_image_pixels=max_image_pixels)
            if sniffed.kind == "tiff" and getattr(img, "n_frames", 1) > 1:
                return None  # a stack: tifffile reads every page
            info: dict[str, Any] = {"mode": img.mode, "source": "pillow"}
            if "dpi" in img.info:
                info["dpi"] = tuple(float(v) for v in img.info["dpi"])
            img.load()
            upright = ImageOps.exif_transpose(img)
            data = _pillow_array(upright)
    except _BOMB as exc:
        raise PayloadTooLargeError(f"image exceeds the decompression-bomb limit: {exc}") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        if sniffed.kind == "tiff":
            logger.info("Pillow cannot read this TIFF (%s); trying tifffile", exc)
            return None
        raise DecodeError(f"corrupt or truncated {sniffed.kind.upper()} file: {exc}") from exc
    return DecodedVolume(data=data, kind=sniffed.kind, info=info)


def _decode_with_tifffile(
    path: Path, *, max_voxels: int | None, max_image_pixels: int | None
) -> DecodedVolume:
    """Decode a TIFF with tifffile: 16/32-bit and float samples, multi-channel, page stacks."""
    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            axes, shape = series.axes, tuple(int(n) for n in series.shape)
            sizes = dict(zip(axes, shape, strict=True))
            _check_size(
                sizes.get("X", 1),
                sizes.get("Y", 1),
                max_voxels=None,
                max_image_pixels=max_image_pixels,
            )
            if max_voxels is not None and math.prod(shape) > max_voxels:
                raise PayloadTooLargeError(f"TIFF of shape {shape} ({axes}) exceeds max_voxels={max_voxels}")
            array = series.asarray()
    except (PayloadTooLargeError, UnusableInputError):
        raise
    except (tifffile.TiffFileError, OSError, ValueError, KeyError, IndexError) as exc:
        raise DecodeError(f"corrupt or truncated TIFF file: {exc}") from exc
    keep = [i for i, (a, n) in enumerate(zip(axes, shape, strict=True)) if n > 1 or a in "YX"]
    array = array.reshape([shape[i] for i in keep])
    axes = "".join(axes[i] for i in keep)
    channel = next((axes.index(a) for a in "SC" if a in axes), None)
    if channel is not None:
        array = np.moveaxis(array, channel, 0)
    else:
        array = array[None]
    if array.ndim not in (3, 4):
        raise UnusableInputError(f"TIFF with axes {series.axes!r} and shape {shape} is neither 2D nor 3D")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return DecodedVolume(data=np.ascontiguousarray(array), kind="tiff", info={"source": "tifffile"})


def decode_image(
    path: Path, sniffed: Sniffed, *, max_voxels: int | None = None, max_image_pixels: int | None = None
) -> DecodedVolume:
    """Read a PNG, JPEG or TIFF into a :class:`DecodedVolume` of shape ``(C, H, W)``.

    A multi-page TIFF becomes a volume ``(C, pages, H, W)``.

    Raises:
        PayloadTooLargeError: more pixels than ``max_image_pixels`` or ``max_voxels``.
        DecodeError: a corrupt or truncated file.
        UnusableInputError: a TIFF layout that is neither an image nor a volume.
    """
    volume = _decode_with_pillow(path, sniffed, max_voxels=max_voxels, max_image_pixels=max_image_pixels)
    if volume is None:
        volume = _decode_with_tifffile(path, max_voxels=max_voxels, max_image_pixels=max_image_pixels)
    logger.info(
        "decoded %s shape=%s dtype=%s (%s)",
        sniffed.kind.upper(),
        volume.data.shape,
        volume.data.dtype,
        volume.info.get("source"),
    )
    return volume


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


def encode_png(volume: DecodedVolume, array: np.ndarray, path: Path) -> None:
    """Write a 2D output as PNG.

    uint8 labels become an 8-bit grey PNG. Float values: one channel becomes a 16-bit grey PNG
    (values in [0, 1] scaled to 0..65535, others rounded and clipped to 0..65535); three channels
    an 8-bit RGB PNG (0..1 scaled to 0..255).

    Raises:
        BadParameterError: a 3D output, or a channel count PNG cannot hold.
    """
    planar, channels = _planar(array, volume.spatial_dims)
    planar = _squeeze_to_2d(planar)
    if planar.ndim != 3:
        raise BadParameterError(f"format=png needs a 2D output, got spatial shape {planar.shape[1:]}")
    if planar.dtype == np.uint8 and channels in (1, 3):
        image = Image.fromarray(planar[0] if channels == 1 else np.moveaxis(planar, 0, -1))
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

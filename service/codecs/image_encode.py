"""Image outputs: write a result as PNG (label palettes, 16-bit grey, RGB), TIFF or NPY.

One job: the encoders and :data:`LABEL_PALETTE`, the colour of each label id in a label PNG.
"""

from __future__ import annotations

import colorsys
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from PIL import Image

from service.codecs.volume import DecodedVolume
from service.errors import BadParameterError

__all__ = [
    "LABEL_PALETTE",
    "encode_geojson",
    "encode_npy",
    "encode_ome_tiff",
    "encode_ome_zarr",
    "encode_png",
    "encode_tiff",
    "label_image",
]


def _label_palette() -> list[tuple[int, int, int]]:
    """256 distinct colours: 0 black (background), 1..7 Okabe and Ito's colour-blind-safe set
    (orange, sky blue, bluish green, yellow, blue, vermillion, reddish purple; Okabe & Ito 2008,
    "Color Universal Design"), then hues a golden angle apart, cycling through three brightness
    levels. ``service/web/js/palette.js`` builds the same list."""
    colours = [(0, 0, 0), (230, 159, 0), (86, 180, 233), (0, 158, 115), (240, 228, 66), (0, 114, 178),
               (213, 94, 0), (204, 121, 167)]  # fmt: skip
    seen = set(colours)
    i = 0
    while len(colours) < 256:
        i += 1
        hue = (i * 0.618033988749895) % 1.0
        value = (1.0, 0.75, 0.5)[i % 3]
        r, g, b = (round(c * 255) for c in colorsys.hsv_to_rgb(hue, 0.85, value))
        rgb = (r, g, b)
        if rgb not in seen:
            seen.add(rgb)
            colours.append(rgb)
    return colours


#: RGB colour of each label id in a label PNG (index = label id).
LABEL_PALETTE: list[tuple[int, int, int]] = _label_palette()


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


def encode_png(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write a 2D output as PNG.

    uint8 labels with one channel become a palette PNG (mode ``P``: values are the label ids,
    :data:`LABEL_PALETTE` their colours); uint16 labels (257 to 65,536 classes) a 16-bit grey PNG
    of the ids; wider labels are refused by name. With three channels, an 8-bit RGB PNG. Float
    values: one channel becomes a 16-bit grey PNG (values in [0, 1] scaled to 0..65535, others
    rounded and clipped to 0..65535); three channels an 8-bit RGB PNG (0..1 scaled to 0..255).

    Raises:
        BadParameterError: a 3D output, or a channel count PNG cannot hold.
    """
    planar, channels = _planar(array, volume.spatial_dims)
    planar = _squeeze_to_2d(planar)
    if planar.ndim != 3:
        raise BadParameterError(f"format=png needs a 2D output, got spatial shape {planar.shape[1:]}")
    if planar.dtype == np.uint8 and channels == 1:
        image = label_image(planar[0])
    elif planar.dtype == np.uint16 and channels == 1:  # labels of 257 to 65,536 classes: 16-bit grey
        image = Image.fromarray(np.ascontiguousarray(planar[0]))
    elif planar.dtype.kind in "ui" and planar.dtype.itemsize > 2:
        raise BadParameterError(
            f"format=png holds labels up to 65535 (16-bit); this output has {planar.dtype} labels "
            "(more than 65,536 classes): use tiff or nii.gz"
        )
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
    if provenance is not None:  # tEXt "tilewise" (service.provenance)
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        info.add_text("tilewise", provenance.json())
        kwargs["pnginfo"] = info
    image.save(path, format="PNG", **kwargs)


def encode_tiff(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write an output as TIFF with its dtype (uint8 labels, float32 values).

    One channel is written as ``(*spatial)``, several as planar ``(C, *spatial)``; the layout
    is recorded in tifffile's shape metadata so ``tifffile.imread`` gives it back.
    """
    planar, channels = _planar(array, volume.spatial_dims)
    if not volume.is_volume:
        planar = _squeeze_to_2d(planar)
    data = planar[0] if channels == 1 else planar
    kwargs: dict[str, Any] = {"photometric": "minisblack"}
    if channels > 1 and data.ndim == 3:
        kwargs["planarconfig"] = "separate"
    if "dpi" in volume.info:
        kwargs["resolution"] = tuple(volume.info["dpi"])
        kwargs["resolutionunit"] = "INCH"
    # tiled and compressed, BigTIFF from 4 GB (DESIGN "third wave"), as streamed outputs are
    kwargs.update(tile=(256, 256), compression="zlib", bigtiff=data.nbytes >= 2**32 - 2**25)
    if provenance is not None:  # in tifffile's JSON ImageDescription, next to "shape"
        kwargs["metadata"] = {"tilewise": provenance.as_dict()}
    tifffile.imwrite(path, np.ascontiguousarray(data), **kwargs)


def _output_2d(volume: DecodedVolume, array: np.ndarray, fmt: str) -> tuple[np.ndarray, bool]:
    """``(H, W)`` labels or ``(C, H, W)`` values of a 2D output (a one-slice NIfTI squeezed), and
    whether they are labels (no channel axis).

    Raises:
        BadParameterError: the output is not 2D.
    """
    labels = array.ndim == volume.spatial_dims
    planar = _squeeze_to_2d(_planar(array, volume.spatial_dims)[0])
    if planar.ndim != 3:
        raise BadParameterError(f"format={fmt} needs a 2D output; this one has shape {array.shape}")
    return (planar[0] if labels else planar), labels


def _input_2d(volume: DecodedVolume) -> tuple[int, ...]:
    """The input's ``(H, W)`` (a single-slice NIfTI ``(X, Y, 1)`` squeezed, as its output is)."""
    shape = list(volume.spatial_shape)
    while len(shape) > 2 and shape[-1] == 1:
        shape.pop()
    return tuple(shape[-2:])


def _output_mpp(volume: DecodedVolume, data: np.ndarray) -> tuple[float, float] | None:
    """Microns per pixel ``(y, x)`` of a 2D output ``data`` (its last two axes): the input's mpp
    (or dpi) times input pixels per output pixel, as the streamed writers have it (a model's
    ``scale`` changes the pixel size); ``None`` when the input says none."""
    from service.pyramid import output_mpp

    return output_mpp(volume.info, _input_2d(volume), tuple(data.shape[-2:]))


def encode_ome_tiff(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write a 2D output as a tiled pyramidal OME-TIFF (:func:`service.pyramid.write_ome_tiff`):
    labels reduced by mode, values by mean; the input's mpp (or dpi) recorded, scaled to the
    output's pixels."""
    from service.pyramid import write_ome_tiff

    data, labels = _output_2d(volume, array, "ome.tiff")
    write_ome_tiff(data, path, labels=labels, mpp=_output_mpp(volume, data), provenance=provenance)


def encode_ome_zarr(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write a 2D output as a zip of a multiscale OME-Zarr group (:func:`service.omezarr.write_ome_zarr`),
    the mpp as :func:`encode_ome_tiff` records it."""
    from service.omezarr import write_ome_zarr

    data, labels = _output_2d(volume, array, "ome.zarr")
    write_ome_zarr(data, path, labels=labels, mpp=_output_mpp(volume, data), provenance=provenance)


def encode_geojson(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:
    """Write the objects of a 2D label output as GeoJSON (:func:`service.objects.write_geojson`).

    Raises:
        BadParameterError: the output is not a 2D label image.
    """
    from service.objects import write_geojson

    data, labels = _output_2d(volume, array, "geojson")
    if not labels:
        raise BadParameterError("format=geojson writes objects of a label output (add output=labels)")
    names = None if provenance is None else provenance.labels
    in_shape = _input_2d(volume)  # coordinates in input pixels, as the streamed writer gives them
    scale = (in_shape[0] / data.shape[-2], in_shape[1] / data.shape[-1])
    write_geojson(data, path, names=names, provenance=provenance, scale=scale)


def encode_npy(volume: DecodedVolume, array: np.ndarray, path: Path, provenance: Any = None) -> None:  # noqa: ARG001
    """Write the output array as ``.npy``: labels ``(*spatial)``, values ``(C, *spatial)``."""
    np.save(path, np.ascontiguousarray(array), allow_pickle=False)

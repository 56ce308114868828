"""Streamed writes: outputs written as the engine's rows finish, never held whole (issue 20 item 3).

:func:`open_output` gives an :class:`OutputTarget`: ``array`` is the engine's ``out`` (labels
``(*spatial)``, values ``(C, *spatial)``), a :class:`~service.paged.PagedMemmap` on disk, and
:meth:`OutputTarget.finish` makes the file. The bytes are what :func:`service.codecs.encode`
writes for the same array (same header, layout and dtype), except TIFF, which is tiled:

- ``nii``: the header is written first (the input NIfTI's, copied as ``encode_nifti`` does), the
  voxels are mapped in place after it in NIfTI's order, and tiles land there directly.
- ``nii.gz``: the same ``.nii`` in the request's folder, then compressed to the output as a
  stream (a NIfTI's slabs along its last axis finish only when the last tile row does, so
  compression cannot start earlier; the temporary is the output's uncompressed size).
- ``npy``: the ``.npy`` file itself, memory-mapped.
- ``tiff`` (2D): a raw temporary, then a tiled (256 x 256) zlib-compressed TIFF written tile by tile
  from it; BigTIFF when the data reach 4 GB (:data:`BIGTIFF_BYTES`), never a broken classic TIFF.
- ``ome.tiff`` (2D): a raw temporary, then a pyramidal OME-TIFF (:mod:`service.pyramid`: level 0
  tile by tile, each coarser level reduced from level 0's finished bands in that same pass).
- ``ome.zarr`` (2D): the same levels in a zip of a multiscale OME-Zarr group (:mod:`service.omezarr`).
- ``geojson`` (2D labels): a raw temporary, then its objects joined across slabs
  (:mod:`service.objects`).

``png`` and 3D ``tiff`` outputs are not streamed (:func:`why_not_streamed_output`).
:func:`output_disk_bytes` is what a streamed output needs on disk (the dry run's ``disk_bytes``).
"""

from __future__ import annotations

import gzip
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.paged import PagedMemmap, open_paged, unit_to_uint8

__all__ = [
    "BIGTIFF_BYTES",
    "TIFF_TILE",
    "OutputTarget",
    "open_output",
    "output_disk_bytes",
    "check_output_dtype",
    "output_dtype",
    "to_output_dtype",
    "why_not_streamed_output",
]

logger = logging.getLogger(__name__)

#: Data bytes from which a TIFF is written as BigTIFF (classic TIFF offsets are 32-bit).
BIGTIFF_BYTES = 2**32 - 2**25
#: Tile edge of a streamed TIFF (pixels).
TIFF_TILE = 256
_COPY_CHUNK = 16 << 20
#: Formats of 2D outputs only (``geojson``: of labels only).
_TWO_D_FORMATS = ("ome.tiff", "ome.zarr", "geojson")


def why_not_streamed_output(fmt: str, spatial_dims: int) -> str | None:
    """Why an output of ``fmt`` cannot be written as it finishes (a sentence), or ``None``."""
    if fmt == "png":
        return "PNG is one compressed stream of whole rows: it is encoded from the whole output"
    if fmt == "tiff" and spatial_dims != 2:
        return "a 3D TIFF output is encoded whole"
    if fmt in _TWO_D_FORMATS and spatial_dims != 2:  # pragma: no cover - refused by check_output_dtype
        return f"a {fmt} output is 2D only"
    return None


def _nifti_shape(
    volume_info: dict[str, Any], spatial: tuple[int, ...], channels: int, labels: bool
) -> tuple[int, ...]:
    """The output's NIfTI shape, as :func:`service.codecs.nifti._to_nifti_layout` makes it."""
    if labels or channels == 1:
        shape = tuple(volume_info.get("shape") or spatial)
        if len(shape) > len(spatial) and math.prod(shape) == math.prod(spatial):
            return shape
        return spatial
    return (*spatial, 1, channels) if len(spatial) == 2 else (*spatial, channels)


def output_disk_bytes(fmt: str, spatial: tuple[int, ...], channels: int, dtype: Any) -> int:
    """Bytes of disk a streamed output needs at its largest: the data (uncompressed; a compressed
    output's temporary plus, at worst, as much again for the compressed file) plus headers."""
    data: int = math.prod(spatial) * channels * np.dtype(dtype).itemsize
    compressed = fmt in ("nii.gz", "tiff", "ome.tiff", "ome.zarr", "geojson")
    pyramid = data // 3 if fmt in ("ome.tiff", "ome.zarr") else 0  # the coarser levels' temporaries
    return data * (2 if compressed else 1) + pyramid + (1 << 20)


@dataclass
class OutputTarget:
    """Where the engine writes (``array``) and how it becomes the output file (:meth:`finish`).

    Attributes:
        array: labels ``(*spatial)`` or values ``(C, *spatial)`` on disk.
        path: the output file.
        fmt: its format.
    """

    array: PagedMemmap
    path: Path
    fmt: str
    _root: PagedMemmap
    _temporary: Path | None = None
    _tiff: dict[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> PagedMemmap:
        """The mapped file itself (its memory order is the output's: Fortran for a NIfTI)."""
        return self._root

    def finish(self) -> Path:
        """Flush and write the output file; remove the temporaries. Returns :attr:`path`."""
        self._root.flush()
        if self.fmt == "nii.gz":
            assert self._temporary is not None
            _gzip(self._temporary, self.path)
        elif self.fmt == "tiff":
            _write_tiff(
                self.array, self.path, dpi=self._tiff.get("dpi"), provenance=self._tiff.get("provenance")
            )
        elif self.fmt in ("ome.tiff", "ome.zarr"):
            from service.omezarr import write_ome_zarr
            from service.pyramid import write_ome_tiff

            write = write_ome_tiff if self.fmt == "ome.tiff" else write_ome_zarr
            assert self._temporary is not None
            tiff = self._tiff
            write(self.array, self.path, workdir=self._temporary.parent, labels=bool(tiff.get("labels")),
                  mpp=tiff.get("mpp"), provenance=tiff.get("provenance"))  # fmt: skip
        elif self.fmt == "geojson":
            from service.objects import write_geojson

            provenance = self._tiff.get("provenance")
            names = None if provenance is None else provenance.labels
            scale = self._tiff.get("scale") or (1.0, 1.0)
            write_geojson(self.array, self.path, names=names, provenance=provenance, scale=scale)
        self.close()
        return self.path

    def close(self) -> None:
        """Unmap the array and remove the temporary (the output file stays)."""
        mm = getattr(self._root, "_mmap", None)
        self.array = self._root = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # pragma: no cover - a view still alive; the GC closes it
                pass
        if self._temporary is not None:
            self._temporary.unlink(missing_ok=True)


def open_output(
    fmt: str,
    path: Path,
    workdir: Path,
    spatial: tuple[int, ...],
    channels: int,
    dtype: Any,
    *,
    labels: bool,
    nifti: dict[str, Any] | None = None,
    dpi: Any = None,
    unit_to_uint8: bool = False,
    provenance: Any = None,
    mpp: tuple[float, float] | None = None,
    scale: tuple[float, float] | None = None,
) -> OutputTarget:
    """Open the output of ``fmt`` at ``path`` for an engine output of ``spatial`` and ``channels``.

    Args:
        fmt: ``nii``, ``nii.gz``, ``npy``, ``tiff``, ``ome.tiff``, ``ome.zarr`` or ``geojson`` (2D).
        path: the output file.
        workdir: the request's folder (temporaries).
        spatial, channels, dtype: the output's spatial shape, channel count and dtype.
        labels: a label map (``(*spatial)``, one channel).
        nifti: for NIfTI outputs of a NIfTI input: ``header`` (the input's nibabel header),
            ``version`` (1 or 2) and ``shape`` (the input's NIfTI shape).
        dpi: a TIFF's resolution (from the input), or ``None``.
        unit_to_uint8: probabilities written as ``round(255 * p)`` (``output_dtype=uint8``).
        provenance: who made the output (:class:`service.provenance.Provenance`): NIfTI
            ``descrip`` and extension, TIFF ImageDescription, OME annotation; ``None``: not said.
        mpp: microns per pixel ``(y, x)`` of the output, recorded in an ``ome.tiff`` or ``ome.zarr``.
        scale: input (level-0) pixels per output pixel ``(y, x)``: ``geojson`` coordinates are
            given in input pixels.
    """
    target = _open(fmt, path, workdir, spatial, channels, dtype, labels, nifti, dpi, provenance)
    target._tiff.update(mpp=mpp, labels=labels, scale=scale)
    target._root._unit_to_uint8 = unit_to_uint8
    target.array._unit_to_uint8 = unit_to_uint8
    return target


def _open(
    fmt: str, path: Path, workdir: Path, spatial: tuple[int, ...], channels: int, dtype: Any, labels: bool,
    nifti: dict[str, Any] | None, dpi: Any, provenance: Any = None,
) -> OutputTarget:  # fmt: skip
    dtype = np.dtype(dtype)
    spatial = tuple(int(n) for n in spatial)
    if fmt in ("nii", "nii.gz"):
        raw = path if fmt == "nii" else workdir / "output-raw.nii"
        info = {**(nifti or {}), "provenance": provenance}
        shape = _nifti_shape(info, spatial, channels, labels)
        offset, stored = _write_nifti_header(raw, info, shape, dtype)
        root = open_paged(raw, stored, shape, mode="r+", offset=offset, order="F")
        if labels or channels == 1:
            grid = root.reshape(spatial, order="F")
            array = grid if labels else grid[None]
        else:
            array = np.moveaxis(root.reshape((*spatial, channels), order="F"), -1, 0)
        assert isinstance(array, PagedMemmap)  # reshape, moveaxis and [None] keep the subclass
        return OutputTarget(array, path, fmt, root, None if fmt == "nii" else raw)
    if fmt == "npy":
        shape = spatial if labels else (channels, *spatial)
        npy = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        offset = int(npy.offset)
        del npy
        root = open_paged(path, dtype, shape, mode="r+", offset=offset)
        return OutputTarget(root, path, fmt, root)
    if fmt in ("tiff", *_TWO_D_FORMATS):
        raw = workdir / "output-raw.bin"
        shape = spatial if labels else (channels, *spatial)
        root = open_paged(raw, dtype, shape, mode="w+")
        return OutputTarget(root, path, fmt, root, raw, {"dpi": dpi, "provenance": provenance})
    raise ValueError(f"format {fmt!r} is not written as a stream")


def output_dtype(params: Any, labels: bool, n_classes: int = 256) -> np.dtype[Any]:
    """The output's dtype: labels in the smallest unsigned integer holding ``n_classes`` labels
    (:func:`models.transforms.preprocess.label_dtype`: uint8 up to 256); probabilities per ``output_dtype``
    (float32 default)."""
    if labels:
        from models.transforms.preprocess import label_dtype

        return np.dtype(label_dtype(n_classes))
    return np.dtype(str(params.output_dtype or "float32"))


def check_output_dtype(fmt: str, params: Any, spec: Any = None) -> None:
    """Refuse an ``output_dtype`` that the format cannot store and, given the model's ``spec``, an
    output the format cannot hold.

    Raises:
        BadParameterError: ``float16`` for a NIfTI or OME-TIFF output (neither has a half-precision
            type); ``ome.tiff``, ``ome.zarr`` or ``geojson`` for a model whose output is not 2D;
            ``geojson`` for probabilities (objects are made from labels).
    """
    from service.errors import BadParameterError

    if str(params.output_dtype or "") == "float16" and fmt in ("nii", "nii.gz", "ome.tiff"):
        kind = (
            "OME-TIFF (OME has no half-precision pixel type)"
            if fmt == "ome.tiff"
            else "NIfTI (no half-precision type)"
        )
        raise BadParameterError(
            f"output_dtype=float16 cannot be stored in {kind}: use format=tiff or npy, or output_dtype=uint8"
        )
    if spec is None or fmt not in _TWO_D_FORMATS:
        return
    if int(spec.spatial_dims) != 2:
        raise BadParameterError(
            f"format={fmt} needs a 2D output; model {spec.name!r} is 3D (use nii.gz or tiff)"
        )
    defaults = getattr(spec, "defaults", None)
    output = str(params.output or (defaults.output if defaults is not None else "probabilities"))
    if fmt == "geojson" and output != "labels":
        raise BadParameterError(
            "format=geojson writes objects of a label output; this request's output is "
            f"{output} (add output=labels, or use format=ome.tiff or tiff)"
        )


def to_output_dtype(array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """A whole probability output in ``dtype`` (``uint8``: ``round(255 * clip(p, 0, 1))``)."""
    if array.dtype == dtype:
        return array
    if dtype == np.uint8:
        return unit_to_uint8(array)
    return array.astype(dtype)


def _write_nifti_header(
    path: Path, info: dict[str, Any], shape: tuple[int, ...], dtype: np.dtype[Any]
) -> tuple[int, np.dtype[Any]]:
    """Write the NIfTI header (and extensions) of the output and size the file; returns the
    voxels' byte offset and stored dtype (in the header's byte order). The header is the input's,
    as :func:`service.codecs.nifti.encode_nifti` writes it (geometry kept, data type and shape
    set, scaling reset, display range cleared); without an input NIfTI, a NIfTI-1 header with an
    identity affine and both codes 0."""
    import nibabel as nib

    source = info.get("header")
    if source is None:
        image = nib.Nifti1Image(np.zeros((1,) * len(shape), dtype), np.eye(4))  # type: ignore[no-untyped-call]
        header = image.header
    else:
        header = source.copy()
        header.set_data_dtype(dtype)
        header.set_slope_inter(1.0, 0.0)
        header["cal_min"] = 0.0
        header["cal_max"] = 0.0
        cls = nib.Nifti2Image if int(info.get("version", 1)) == 2 else nib.Nifti1Image
        image = cls(np.zeros((1,) * len(shape), dtype), None, header=header)  # type: ignore[no-untyped-call]
        header = image.header
    header.set_data_shape(shape)  # type: ignore[no-untyped-call]
    image.update_header()  # type: ignore[no-untyped-call]
    header.set_data_shape(shape)  # type: ignore[no-untyped-call]
    header["scl_slope"], header["scl_inter"] = 1.0, 0.0  # what nibabel's writer stores for unscaled data
    if info.get("provenance") is not None:  # descrip and the JSON extension (service.provenance)
        from service.codecs.nifti import stamp_provenance

        stamp_provenance(header, info["provenance"])
    if len(header.extensions):  # the voxels start after the header and its extensions
        size = int(header["sizeof_hdr"]) + 4 + header.extensions.get_sizeondisk()  # type: ignore[no-untyped-call]
        header.set_data_offset(max(size, int(header.get_data_offset())))  # type: ignore[no-untyped-call]
    with open(path, "wb") as fh:
        header.write_to(fh)  # type: ignore[no-untyped-call]
        offset = int(header.get_data_offset())  # type: ignore[no-untyped-call]
        if fh.tell() < offset:
            fh.write(b"\0" * (offset - fh.tell()))
        fh.truncate(offset + math.prod(shape) * dtype.itemsize)
    return offset, np.dtype(header.get_data_dtype())  # type: ignore[no-untyped-call]  # the input's byte order (big-endian stays)


def _gzip(source: Path, target: Path) -> None:
    """Compress ``source`` into ``target`` as a stream (nibabel's level)."""
    with open(source, "rb") as src, open(target, "wb") as raw:
        # as nibabel writes .nii.gz: no name, mtime 0 (the same bytes for the same output), level 1
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) as dst:
            while chunk := src.read(_COPY_CHUNK):
                dst.write(chunk)


def _write_tiff(array: PagedMemmap, path: Path, *, dpi: Any = None, provenance: Any = None) -> None:
    """A tiled, zlib-compressed (Big)TIFF of ``array`` (``(H, W)`` or ``(C, H, W)``), tile by tile."""
    import tifffile

    planes = array[None] if array.ndim == 2 else array
    channels, height, width = (int(n) for n in planes.shape)
    t = TIFF_TILE

    def tiles() -> Any:
        for c in range(channels):
            for y in range(0, height, t):
                for x in range(0, width, t):
                    block = np.asarray(planes[c, y : y + t, x : x + t])
                    if block.shape != (t, t):
                        block = np.pad(block, ((0, t - block.shape[0]), (0, t - block.shape[1])))
                    yield block

    kwargs: dict[str, Any] = {"photometric": "minisblack"}
    if channels > 1:
        kwargs["planarconfig"] = "separate"
    if dpi is not None:
        kwargs["resolution"] = tuple(dpi)
        kwargs["resolutionunit"] = "INCH"
    if provenance is not None:  # in tifffile's JSON ImageDescription, as encode_tiff writes it
        kwargs["metadata"] = {"tilewise": provenance.as_dict()}
    shape = (height, width) if channels == 1 else (channels, height, width)  # as encode_tiff
    bigtiff = array.nbytes >= BIGTIFF_BYTES
    tifffile.imwrite(path, tiles(), shape=shape, dtype=array.dtype, tile=(t, t), compression="zlib",
                     bigtiff=bigtiff, **kwargs)  # fmt: skip
    logger.info("wrote a tiled %sTIFF %s %s", "Big" if bigtiff else "", shape, array.dtype)

"""Region reads: an input read by region, never whole, when its format allows it (issue 20 item 2).

:func:`open_regions` gives a :class:`RegionSource`: an array-like ``(C, *spatial)`` (``shape``,
``dtype``, ``source[slices]``) that reads only the voxels a tile or a slab asks for, with the
values :func:`service.codecs.decode` would give for them (NIfTI ``scl_slope``/``scl_inter``
applied, native byte order, the same channel layout):

- NIfTI ``.nii``: through nibabel's array-proxy machinery (:func:`nibabel.fileslice.fileslice`,
  file reads of the blocks a slice needs; the file is opened per read, so reads may come from
  another thread). ``.nii.gz`` cannot be read by region: it is decompressed once, as a stream,
  to a temporary ``.nii`` in the request's folder, then read like one.
- TIFF and BigTIFF: by tile or strip, through tifffile's zarr store
  (``tifffile.imread(path, aszarr=True)`` opened with zarr), decoding only the tiles or strips
  a region touches.

What cannot be read by region (:func:`why_not_regions` says why, in a sentence): PNG and JPEG
(one compressed stream; they keep Pillow's decompression-bomb limit), a NIfTI whose data are not
one block after the header, TIFFs whose pixels Pillow would change on decoding (palette,
min-is-white, an orientation tag) and TIFF layouts other than one image or one page stack.
"""

from __future__ import annotations

import gzip
import logging
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import DecodeError

__all__ = ["NiftiRegions", "RegionSource", "TiffRegions", "full_slices", "open_regions", "why_not_regions"]

logger = logging.getLogger(__name__)

_COPY_CHUNK = 16 << 20


class RegionSource:
    """An input read by region: ``shape`` ``(C, *spatial)``, ``dtype``, ``source[(c, *spatial)]``
    with slices only (steps of 1). ``slab_axis`` is the spatial axis along which slabs are read
    cheapest (the file's slowest axis)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    slab_axis: int = 0

    @property
    def ndim(self) -> int:
        """``1 + spatial dims``."""
        return len(self.shape)

    def __getitem__(self, key: Any) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


def full_slices(key: Any, ndim: int) -> tuple[slice, ...]:
    """``key`` as one slice per axis of ``ndim`` (missing axes whole).

    Raises:
        TypeError: a key that is not slices with step 1.
    """
    key = key if isinstance(key, tuple) else (key,)
    key = tuple(key) + (slice(None),) * (ndim - len(key))
    if any(not isinstance(k, slice) or k.step not in (None, 1) for k in key):
        raise TypeError(f"region reads take slices with step 1, got {key}")
    return tuple(key)


class NiftiRegions(RegionSource):
    """A single-file NIfTI read by region (see the module docstring).

    Args:
        path: an uncompressed ``.nii``.
        header: the input's :class:`~service.codecs.Probe` (spatial shape, channels).
    """

    def __init__(self, path: Path, header: Any) -> None:
        import nibabel as nib

        klass = nib.Nifti2Image if int(header.info.get("nifti_version", 1)) == 2 else nib.Nifti1Image
        holder = nib.fileholders.FileHolder(filename=str(path))  # any name: uploads have no suffix
        try:
            try:
                image = klass.from_file_map({"image": holder, "header": holder})  # type: ignore[no-untyped-call]
            except nib.spatialimages.HeaderDataError as exc:
                if "vox offset" not in str(exc):
                    raise
                image = _with_offset_fixed(klass, path)  # as service.codecs.nifti reads it
        except (OSError, ValueError, nib.spatialimages.HeaderDataError) as exc:
            raise DecodeError(f"corrupt NIfTI header: {exc}") from exc
        proxy = image.dataobj
        self.path = path
        self.nifti_header = image.header
        self.offset = int(proxy.offset)
        self.stored = np.dtype(proxy.dtype)
        spatial, channels = tuple(header.spatial_shape), int(header.channels)
        self.file_shape = (*spatial, channels)  # Fortran order, as decode reshapes it
        # the loaded header's scaling is moved into the proxy (nibabel resets the header's fields)
        slope, inter = float(np.asarray(proxy.slope)), float(np.asarray(proxy.inter))
        self.slope, self.inter = (slope, inter) if np.isfinite(slope) and slope != 0 else (1.0, 0.0)
        sample = self._scaled(np.zeros(1, self.stored))
        self.dtype = sample.dtype
        self.shape = (channels, *spatial)
        self.slab_axis = len(spatial) - 1
        needed = self.offset + int(np.prod(self.file_shape)) * self.stored.itemsize
        if path.stat().st_size < needed:
            raise DecodeError(
                f"truncated NIfTI: the header declares {needed - self.offset} bytes of voxels from byte "
                f"{self.offset}, the file has {path.stat().st_size} bytes"
            )

    def _scaled(self, raw: np.ndarray) -> np.ndarray:
        import nibabel as nib

        data = raw if raw.dtype.isnative else raw.astype(raw.dtype.newbyteorder("="))
        with np.errstate(over="ignore", invalid="ignore"):
            data = nib.volumeutils.apply_read_scaling(data, self.slope, self.inter)
            if data.dtype.kind == "f" and data.dtype != np.float32:
                data = data.astype(np.float32)
        return data

    def __getitem__(self, key: Any) -> np.ndarray:
        from nibabel.fileslice import fileslice

        c, *spatial = full_slices(key, self.ndim)
        with open(self.path, "rb") as fh:
            raw = fileslice(fh, (*spatial, c), self.file_shape, self.stored, self.offset, order="F")  # type: ignore[no-untyped-call]
        return np.ascontiguousarray(np.moveaxis(self._scaled(np.asarray(raw)), -1, 0))


class TiffRegions(RegionSource):
    """A TIFF or BigTIFF read by tile or strip through tifffile's zarr store (series 0, level 0).

    Args:
        path: the TIFF.
        header: the input's :class:`~service.codecs.Probe` (unused: the series is read again).
    """

    def __init__(self, path: Path, header: Any) -> None:  # noqa: ARG002 - one signature for both readers
        import tifffile
        import zarr

        from service.codecs.image_probe import tiff_layout

        self.path = path
        store = tifffile.imread(path, aszarr=True, series=0, level=0)
        self._store = store
        self.array = zarr.open_array(store, mode="r")
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            axes, shape = str(series.axes), tuple(int(n) for n in series.shape)
        if tuple(self.array.shape) != shape:
            raise DecodeError(f"TIFF series of shape {shape}, zarr store of {tuple(self.array.shape)}")
        spatial, channels, keep, channel = tiff_layout(axes, shape)
        self.keep, self.channel = keep, channel
        self.series_shape = shape
        self.dtype = np.dtype(self.array.dtype).newbyteorder("=")
        self.shape = (channels, *spatial)
        self.slab_axis = 0

    def close(self) -> None:
        """Close the file handle of the zarr store."""
        self._store.close()

    def __getitem__(self, key: Any) -> np.ndarray:
        c, *spatial = full_slices(key, self.ndim)
        index: list[Any] = [slice(None)] * len(self.series_shape)
        kept = list(spatial)
        if self.channel is not None:
            kept.insert(self.channel, c)
        for axis, k in zip(self.keep, kept, strict=True):
            index[axis] = k
        block = np.asarray(self.array[tuple(index)])
        block = block.reshape([block.shape[a] for a in self.keep])
        if self.channel is not None:
            block = np.moveaxis(block, self.channel, 0)
        else:
            block = block[None][c]
        if not block.dtype.isnative:
            block = block.astype(block.dtype.newbyteorder("="))
        return np.ascontiguousarray(block)


def why_not_regions(path: Path, header: Any) -> str | None:
    """Why the input of ``header`` cannot be read by region (a sentence), or ``None`` when it can."""
    kind = header.kind
    if kind == "nifti":
        return None
    if kind != "tiff":
        return f"{kind.upper()} is one compressed stream: it is decoded whole"
    import importlib.util

    if importlib.util.find_spec("zarr") is None:  # pragma: no cover - a base dependency
        return "zarr is not installed: TIFF is decoded whole"
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            page = tif.pages.first
            series = tif.series[0]
            photometric = int(page.photometric)
            orientation = page.tags.get("Orientation")
            if series.dtype == np.bool_ or page.bitspersample == 1:
                return "a bilevel TIFF is decoded whole"
            if photometric not in (1, 2):  # MINISBLACK, RGB
                return "a palette or min-is-white TIFF is decoded whole (its colours are converted)"
            if orientation is not None and int(orientation.value) != 1:
                return "a TIFF with an orientation tag is decoded whole (it is turned first)"
            if not series.is_pyramidal and len(series.levels) > 1:  # pragma: no cover - odd files
                return "a TIFF series of several levels is decoded whole"
    except Exception as exc:  # noqa: BLE001 - the whole decode names the fault
        return f"the TIFF cannot be opened by region ({type(exc).__name__})"
    return None


def open_regions(path: Path, header: Any, workdir: Path) -> RegionSource:
    """The input at ``path`` (of ``header``) as a :class:`RegionSource`; a ``.nii.gz`` is inflated
    once into ``workdir`` first (disk: its decompressed size, :attr:`Probe.nbytes`).

    Raises:
        DecodeError: a truncated or corrupt file.
    """
    if header.kind == "tiff":
        return TiffRegions(path, header)
    from service.sniff import sniff_gzipped

    if sniff_gzipped(path):
        plain = workdir / "input-inflated.nii"
        _inflate(path, plain, int(header.nbytes))
        path = plain
    return NiftiRegions(path, header)


def _inflate(source: Path, target: Path, declared: int) -> None:
    """Decompress ``source`` (gzip) to ``target`` as a stream, at most ``declared`` bytes plus one
    chunk (a file that inflates beyond its header's size is cut there: the rest is never read).

    Raises:
        DecodeError: a corrupt gzip stream.
    """
    import zlib

    written = 0
    try:
        with gzip.open(source, "rb") as src, open(target, "wb") as dst:
            while written <= declared:
                chunk = src.read(_COPY_CHUNK)
                if not chunk:
                    break
                dst.write(chunk)
                written += len(chunk)
    except (OSError, EOFError, zlib.error) as exc:
        raise DecodeError(f"corrupt or truncated NIfTI (gzip): {exc}") from exc
    logger.info("inflated a .nii.gz input to %d bytes on disk for region reads", written)


def _with_offset_fixed(klass: Any, path: Path) -> Any:
    """The image of a single-file NIfTI whose ``vox_offset`` lies inside its header (e.g. 100), read
    as :func:`service.codecs.nifti.decode_nifti` reads it: the data starts right after the header
    (nibabel's rule), never inside it."""
    import nibabel as nib

    with open(path, "rb") as f:
        header = klass.header_class.from_fileobj(f, check=False)
    size = int(header["sizeof_hdr"])
    header["vox_offset"] = max(int(float(header["vox_offset"])), size + 4)
    proxy = nib.arrayproxy.ArrayProxy(str(path), header)  # type: ignore[no-untyped-call]
    return klass(proxy, None, header)

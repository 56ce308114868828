"""Format detection from a file's first bytes (magic numbers), never from its name.

Standard library only: the server's codecs (:mod:`service.codecs`) and the batch client
(:mod:`service.client`) both use it, so a folder of thousands of files is walked cheaply, without
numpy, nibabel, torch or FastAPI; at most 544 bytes are read per file (inflated from the start of
the gzip stream for ``.nii.gz``).

==========  =====================================================================
Kind        Magic
==========  =====================================================================
``nifti``   ``sizeof_hdr`` 348 and ``n+1`` at byte 344 (NIfTI-1), or 540 and ``n+2`` at
            byte 4 (NIfTI-2), either byte order, plain or inside gzip
``png``     ``89 50 4E 47 0D 0A 1A 0A``
``jpeg``    ``FF D8 FF``
``tiff``    ``II*\\0``, ``MM\\0*`` (classic) or ``II+\\0``, ``MM\\0+`` (BigTIFF)
``dicom``   ``DICM`` at byte 128, after the 128-byte preamble (checked first: the preamble may
            itself look like a TIFF header, as in pydicom's ``CT_small.dcm``). Read as a series
            by :mod:`service.codecs.dicom` (the ``dicom`` extra); the batch client skips single
            DICOM files with advice (:data:`UNSUPPORTED_KINDS`).
==========  =====================================================================

A ``.nii.gz`` cut short before its header could be read still counts as NIfTI, so that the server
reports it as corrupt (422) rather than as an unknown format (415), and the batch client sends it
and reports the server's error.
"""

from __future__ import annotations

import logging
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "DICOM_ADVICE",
    "KINDS",
    "SLIDE_KINDS",
    "UNSUPPORTED_KINDS",
    "Sniffed",
    "slide_kind",
    "sniff",
    "sniff_bytes",
    "sniff_file",
    "sniff_gzipped",
]

logger = logging.getLogger(__name__)

#: Every input kind tilewise reads.
KINDS = ("nifti", "png", "jpeg", "tiff")
#: Kinds :func:`sniff` recognizes only to refuse them with a useful message (HTTP 415; the batch
#: client lists them as ``skipped``).
UNSUPPORTED_KINDS = ("dicom",)
#: What to do with a DICOM file instead of sending it.
DICOM_ADVICE = (
    "DICOM is read as a series with the `dicom` extra (pip install 'tilewise[dicom]'): send the series' "
    "folder (`tilewise infer FOLDER`), a zip, or its files as several multipart `file` parts; the batch "
    "client reads a study from a PACS (`tilewise batch --dicomweb URL --study UID`). Or convert it to "
    "NIfTI first (e.g. `dcm2niix -z y -o OUT_DIR DICOM_DIR`) and send the .nii.gz"
)

_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG = b"\xff\xd8\xff"
_TIFF = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, both byte orders
_DICOM_MAGIC = b"DICM"
_DICOM_OFFSET = 128  # after the preamble (free content: often zeros, sometimes a TIFF header)
_GZIP = b"\x1f\x8b"
_NIFTI1_MAGIC = b"n+1\x00"
_NIFTI1_PAIR_MAGIC = b"ni1\x00"
_NIFTI2_MAGIC = b"n+2\x00"
_HEAD = 544  # enough for the NIfTI-2 header's magic (offset 4) and the NIfTI-1 one (offset 344)


@dataclass(frozen=True, slots=True)
class Sniffed:
    """What a file's first bytes say it is.

    Attributes:
        kind: one of :data:`KINDS` or :data:`UNSUPPORTED_KINDS`.
        nifti_version: 1 or 2 for NIfTI, else 0.
        gzipped: whether the NIfTI is gzip-compressed (``.nii.gz``).
        byteorder: ``"<"`` or ``">"`` for NIfTI, else ``""``.
    """

    kind: str
    nifti_version: int = 0
    gzipped: bool = False
    byteorder: str = ""


def _sniff_nifti(head: bytes, *, gzipped: bool) -> Sniffed | None:
    """Recognize a single-file NIfTI-1 (``n+1``) or NIfTI-2 (``n+2``) header in ``head``."""
    if len(head) < 4:
        return None
    for order in ("<", ">"):
        (size,) = struct.unpack(f"{order}i", head[:4])
        if gzipped and len(head) < 348 and size in (348, 540):
            # A truncated .nii.gz: the header itself is cut short. Claim NIfTI so that the
            # decoder reports it as corrupt (422) rather than as an unknown format (415).
            return Sniffed("nifti", 1 if size == 348 else 2, gzipped, order)
        if size == 348 and head[344:348] in (_NIFTI1_MAGIC, _NIFTI1_PAIR_MAGIC):
            if head[344:348] == _NIFTI1_PAIR_MAGIC:
                return None  # header of a .hdr/.img pair: the voxels are not in this file
            return Sniffed("nifti", 1, gzipped, order)
        if size == 540 and head[4:8] == _NIFTI2_MAGIC:
            return Sniffed("nifti", 2, gzipped, order)
    return None


def sniff_bytes(head: bytes) -> Sniffed | None:
    """Identify an uncompressed prefix of a file (at least 544 bytes for NIfTI-2).

    Returns:
        the detected format, or ``None`` when the bytes match no supported format.
    """
    if head[_DICOM_OFFSET : _DICOM_OFFSET + 4] == _DICOM_MAGIC:
        return Sniffed("dicom")
    if head.startswith(_PNG):
        return Sniffed("png")
    if head.startswith(_JPEG):
        return Sniffed("jpeg")
    if head[:4] in _TIFF:
        return Sniffed("tiff")
    return _sniff_nifti(head, gzipped=False)


def sniff(path: str | Path) -> Sniffed | None:
    """Identify the file at ``path`` by content, looking inside gzip for ``.nii.gz``.

    Returns:
        the detected format, or ``None`` when the content is no supported format (also for an
        empty file, or a gzip stream too short or too corrupt to hold a NIfTI header).

    Raises:
        OSError: when the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(_HEAD)
    if head.startswith(_GZIP):
        inner, complete = _gunzip_head(path)
        found = _sniff_nifti(inner, gzipped=True)
        if found is None and not complete and len(inner) < 348:
            # Cut short (or corrupt) before a header could be read: most likely a truncated
            # .nii.gz, so let the NIfTI decoder report it as corrupt (422) rather than 415.
            return Sniffed("nifti", 0, True, "<")
        return found
    return sniff_bytes(head)


def sniff_file(path: str | Path) -> str | None:
    """The kind of the file at ``path`` (one of :data:`KINDS` or :data:`UNSUPPORTED_KINDS`), or
    ``None``: :func:`sniff` without the details.

    Raises:
        OSError: when the file cannot be read.
    """
    found = sniff(path)
    return None if found is None else found.kind


def sniff_gzipped(path: str | Path) -> bool:
    """Whether :func:`sniff` finds the file at ``path`` inside gzip (a ``.nii.gz``); ``False`` too
    when it finds no supported format.

    Raises:
        OSError: when the file cannot be read.
    """
    found = sniff(path)
    return found is not None and found.gzipped


def _gunzip_head(path: str | Path) -> tuple[bytes, bool]:
    """The first bytes of a gzip stream's content, as far as a truncated stream allows, and
    whether the stream was readable that far (complete, or not cut short before them)."""
    inflater = zlib.decompressobj(wbits=31)  # 31: expect a gzip header
    out = b""
    complete = False
    try:
        with open(path, "rb") as fh:
            while len(out) < _HEAD:
                chunk = fh.read(65536)
                if not chunk:
                    break
                out += inflater.decompress(inflater.unconsumed_tail + chunk, _HEAD - len(out))
                if inflater.eof:
                    complete = True
                    break
    except zlib.error as exc:
        logger.debug("corrupt gzip stream while sniffing %s: %s", path, exc)
    return out, complete or len(out) >= _HEAD


#: What :func:`slide_kind` tells apart, from the first IFD of a TIFF.
SLIDE_KINDS = ("svs", "ndpi", "ome-tiff", "tiled-tiff")
_TAG_SUBFILE, _TAG_BITS, _TAG_DESCRIPTION, _TAG_SPP = 254, 258, 270, 277
_TAG_TILE_WIDTH, _TAG_SUBIFDS, _TAG_SAMPLE_FORMAT, _TAG_NDPI = 322, 330, 339, 65420
_IFD_MAX_ENTRIES = 4096
_OME_SIZES = re.compile(rb"<(?:\w+:)?Pixels\b[^>]*>", re.S)


def slide_kind(path: str | Path) -> str | None:
    """Which slide layout a TIFF is, from its first IFD and the next one's subfile type (no
    decoding; a few kilobytes read), by the rule the server reads slides by
    (:func:`service.slides.is_slide_tiff`).

    ``svs`` (ImageDescription starts with ``Aperio``), ``ndpi`` (Hamamatsu's tag 65420),
    ``ome-tiff`` (ImageDescription holds ``<OME``) or ``tiled-tiff`` (any other), each only when it
    is a pyramid of 8-bit unsigned pixels (SVS and NDPI always): TileWidth present, several levels
    (a SubIFDs tag, or a next IFD of reduced resolution, NewSubfileType bit 0), and for an OME-TIFF
    one plane (SizeZ, SizeT 1; SizeC the samples per pixel: ``YX`` or ``YXS``); else ``None`` (a
    flat or single-level TIFF, a channel-first or 16-bit pyramid, or not a TIFF).

    Raises:
        OSError: when the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(16)
        if head[:4] not in _TIFF:
            return None
        order = "<" if head[:2] == b"II" else ">"
        big = head[2:4] in (b"+\x00", b"\x00+")
        if len(head) < (16 if big else 8):
            return None
        offset = struct.unpack(order + ("Q" if big else "I"), head[8:16] if big else head[4:8])[0]
        tags, next_ifd = _read_ifd(fh, offset, order, big)
        if tags is None:
            return None
        if _TAG_NDPI in tags:
            return "ndpi"
        text = _value(fh, tags.get(_TAG_DESCRIPTION), order, big, 4096)
        if text.startswith(b"Aperio"):
            return "svs"
        spp = _numbers(fh, tags.get(_TAG_SPP), order, big) or [1]
        bits = _numbers(fh, tags.get(_TAG_BITS), order, big) or [1]
        formats = _numbers(fh, tags.get(_TAG_SAMPLE_FORMAT), order, big) or [1]
        if any(b != 8 for b in bits) or any(f != 1 for f in formats) or _TAG_TILE_WIDTH not in tags:
            return None
        ome = b"<OME" in text
        if ome:
            pixels = _OME_SIZES.search(text)
            sizes = {k: int(v) for k, v in re.findall(rb'\b(Size[CZT])="(\d+)"', pixels[0])} if pixels else {}
            if sizes.get(b"SizeZ", 1) > 1 or sizes.get(b"SizeT", 1) > 1 or sizes.get(b"SizeC", 1) > spp[0]:
                return None
        levels = _TAG_SUBIFDS in tags
        if not levels and next_ifd:
            following, _ = _read_ifd(fh, next_ifd, order, big)
            subfile = _numbers(fh, (following or {}).get(_TAG_SUBFILE), order, big)
            levels = bool(subfile and subfile[0] & 1)
        if not levels:
            return None
        return "ome-tiff" if ome else "tiled-tiff"


_Entry = tuple[int, int, bytes]
_TYPES = {1: "B", 3: "H", 4: "I", 16: "Q", 13: "I", 18: "Q"}  # BYTE SHORT LONG LONG8 IFD IFD8


def _read_ifd(fh: BinaryIO, offset: int, order: str, big: bool) -> tuple[dict[int, _Entry] | None, int]:
    """The tags of the IFD at ``offset`` (``tag: (type, count, inline value)``) and the next IFD's offset."""
    count_fmt, entry_size, value_fmt = ("Q", 20, "Q") if big else ("H", 12, "I")
    fh.seek(offset)
    raw = fh.read(8 if big else 2)
    if len(raw) < (8 if big else 2):
        return None, 0
    (count,) = struct.unpack(order + count_fmt, raw)
    entries = fh.read(min(count, _IFD_MAX_ENTRIES) * entry_size)
    tags: dict[int, _Entry] = {}
    for k in range(len(entries) // entry_size):
        entry = entries[k * entry_size : (k + 1) * entry_size]
        tag, _type = struct.unpack(order + "HH", entry[:4])
        (n,) = struct.unpack(order + value_fmt, entry[4 : 12 if big else 8])
        tags[tag] = (_type, n, entry[12:] if big else entry[8:])
    tail = fh.read(8 if big else 4) if count <= _IFD_MAX_ENTRIES else b""
    next_ifd = struct.unpack(order + value_fmt, tail)[0] if len(tail) == (8 if big else 4) else 0
    return tags, next_ifd


def _value(fh: BinaryIO, entry: _Entry | None, order: str, big: bool, limit: int, size: int = 1) -> bytes:
    """The raw bytes of a tag's value (at most ``limit``; ``size`` bytes per item), inline or not."""
    if entry is None:
        return b""
    _type, n, value = entry
    inline = 8 if big else 4
    nbytes = n * size
    if nbytes <= inline:
        return value[:nbytes]
    fh.seek(struct.unpack(order + ("Q" if big else "I"), value[:inline])[0])
    return fh.read(min(nbytes, limit))


def _numbers(fh: BinaryIO, entry: _Entry | None, order: str, big: bool) -> list[int]:
    """An integer tag's values (at most 64), ``[]`` when absent or not an integer type."""
    if entry is None or entry[0] not in _TYPES:
        return []
    fmt = _TYPES[entry[0]]
    size = struct.calcsize(fmt)
    raw = _value(fh, (entry[0], min(entry[1], 64), entry[2]), order, big, 64 * size, size)
    return list(struct.unpack(f"{order}{len(raw) // size}{fmt}", raw[: len(raw) // size * size]))

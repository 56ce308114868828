"""Which files a tilewise server can read, told from their first bytes (magic numbers).

Standard library only (no numpy, nibabel, torch or FastAPI), so ``tilewise batch`` can walk a folder
of thousands of files cheaply: at most 544 bytes are read per file (inflated from the start of the
gzip stream for ``.nii.gz``). The server decodes with its own codecs; this only picks candidates.

==========  =====================================================================
Kind        Magic
==========  =====================================================================
``nifti``   ``sizeof_hdr`` 348 and ``n+1`` at byte 344 (NIfTI-1), or 540 and ``n+2`` at
            byte 4 (NIfTI-2), either byte order, plain or inside gzip
``png``     ``89 50 4E 47 0D 0A 1A 0A``
``jpeg``    ``FF D8 FF``
``tiff``    ``II*\\0``, ``MM\\0*`` (classic) or ``II+\\0``, ``MM\\0+`` (BigTIFF)
==========  =====================================================================
"""

from __future__ import annotations

import logging
import struct
import zlib
from pathlib import Path

__all__ = ["KINDS", "sniff_file", "sniff_head"]

logger = logging.getLogger(__name__)

#: Every kind :func:`sniff_file` recognizes.
KINDS = ("nifti", "png", "jpeg", "tiff")

_HEAD_BYTES = 544  # the NIfTI-1 magic ends at byte 348, the NIfTI-2 header is 540 bytes long
_GZIP = b"\x1f\x8b"
_PREFIXES = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),
    (b"MM\x00+", "tiff"),
)


def _is_nifti(head: bytes) -> bool:
    """Whether ``head`` starts with a single-file NIfTI-1 or NIfTI-2 header (either byte order)."""
    if len(head) < 8:
        return False
    for order in "<>":
        (sizeof_hdr,) = struct.unpack(f"{order}i", head[:4])
        if sizeof_hdr == 348 and head[344:348] == b"n+1\x00":
            return True
        if sizeof_hdr == 540 and head[4:8] == b"n+2\x00":
            return True
    return False


def sniff_head(head: bytes) -> str | None:
    """Identify a file from its first (uncompressed) bytes.

    Args:
        head: the file's first bytes, at least 544 of them for NIfTI-2.

    Returns:
        one of :data:`KINDS`, or ``None`` when the bytes match none of them.
    """
    for prefix, kind in _PREFIXES:
        if head.startswith(prefix):
            return kind
    return "nifti" if _is_nifti(head) else None


def _gunzip_head(path: Path) -> bytes:
    """Up to 544 bytes from the start of a gzip stream; fewer when the stream is cut short."""
    inflater = zlib.decompressobj(wbits=31)  # 31: gzip wrapper
    out = b""
    try:
        with path.open("rb") as fh:
            while len(out) < _HEAD_BYTES and not inflater.eof:
                chunk = fh.read(16384)
                if not chunk:
                    break
                out += inflater.decompress(inflater.unconsumed_tail + chunk, _HEAD_BYTES - len(out))
    except zlib.error as exc:
        logger.debug("%s: corrupt gzip stream (%s)", path, exc)
    return out


def sniff_file(path: str | Path) -> str | None:
    """Identify the file at ``path`` by content (never by name).

    A gzip file is a candidate only when its content starts with a NIfTI header (``.nii.gz``).

    Returns:
        one of :data:`KINDS`, or ``None`` for anything else (text, DICOM, an empty file, ...).

    Raises:
        OSError: when the file cannot be read.
    """
    path = Path(path)
    with path.open("rb") as fh:
        head = fh.read(_HEAD_BYTES)
    if head.startswith(_GZIP):
        return "nifti" if _is_nifti(_gunzip_head(path)) else None
    return sniff_head(head)

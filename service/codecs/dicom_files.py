"""Where the files of a DICOM upload are: a folder, a ``.zip``, or one file.

Each file is read header first (``stop_before_pixels``): a folder of thousands of slices is
grouped, sorted and checked (:mod:`service.codecs.dicom`) before one pixel is decoded. Zip members
are read in memory, never extracted, so no temporary file is left and no member path is ever used
as a path on the server. Files that are not DICOM (a ``README``, ``.DS_Store``) and DICOM objects
without pixels (``DICOMDIR``, reports, structure sets) are skipped and counted.

Imports pydicom (the ``dicom`` extra); never torch or FastAPI.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import DecodeError, DicomSeriesError, PayloadTooLargeError

__all__ = ["DicomFile", "ZIP_MAGIC", "is_dicom_source", "list_dicom_files"]

logger = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
_DICOM_OFFSET = 128
_MAX_MEMBERS = 100_000


@dataclass(frozen=True, slots=True)
class DicomFile:
    """One DICOM object of an upload: its header (no pixels) and how to read it whole.

    Attributes:
        name: its name inside the upload (relative path or zip member name), for messages.
        header: the pydicom dataset without pixel data.
        where: the file's path, or ``(zip path, member name)``.
    """

    name: str
    header: Any
    where: Path | tuple[Path, str]

    def read(self) -> Any:
        """The whole dataset, pixels included (pydicom ``Dataset``).

        Raises:
            DecodeError: the file cannot be read again (changed, corrupt pixel data).
        """
        import pydicom

        try:
            if isinstance(self.where, tuple):
                with zipfile.ZipFile(self.where[0]) as archive:
                    return pydicom.dcmread(io.BytesIO(archive.read(self.where[1])))
            return pydicom.dcmread(self.where)
        except Exception as exc:  # noqa: BLE001 - pydicom raises many kinds on corrupt input
            raise DecodeError(f"DICOM file {self.name} cannot be read: {exc}") from exc


def _is_dicom_head(head: bytes) -> bool:
    return head[_DICOM_OFFSET : _DICOM_OFFSET + 4] == b"DICM"


def is_dicom_source(path: Path) -> bool:
    """Whether ``path`` is a folder, a zip, or a DICOM file (``DICM`` at byte 128): what
    :func:`list_dicom_files` reads."""
    if path.is_dir():
        return True
    with open(path, "rb") as fh:
        head = fh.read(_DICOM_OFFSET + 4)
    return head.startswith(ZIP_MAGIC) or _is_dicom_head(head)


def _header(source: Any, name: str) -> Any | None:
    """The dataset without pixels, or ``None`` for a file that is no DICOM object with pixels."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(source, stop_before_pixels=True)
    except InvalidDicomError:
        return None
    except Exception as exc:  # noqa: BLE001 - a DICM file pydicom cannot parse is a corrupt upload
        raise DecodeError(f"DICOM file {name} is corrupt: {exc}") from exc
    return ds


def _folder_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield str(path.relative_to(root)), path


def list_dicom_files(path: Path, *, max_bytes: int | None = None) -> tuple[list[DicomFile], list[str]]:
    """The DICOM objects with pixel data in a folder, a zip, or one file, headers only.

    Args:
        path: a folder (read recursively, symbolic links not followed), a ``.zip`` (by content),
            or one DICOM file.
        max_bytes: refuse a zip whose members declare more bytes once inflated (a zip bomb).

    Returns:
        ``(files, skipped)``: the objects that hold pixels, and a note per kind of skipped file.

    Raises:
        DicomSeriesError: nothing in the upload holds DICOM pixel data.
        PayloadTooLargeError: a zip inflating beyond ``max_bytes``.
        DecodeError: a corrupt zip or DICOM file.
    """
    found: list[DicomFile] = []
    not_dicom = no_pixels = 0
    if path.is_dir():
        entries: list[tuple[str, Any, Any]] = [(n, p, p) for n, p in _folder_files(path)]
    elif _is_zip(path):
        entries = list(_zip_entries(path, max_bytes))
    else:
        entries = [("the input", path, path)]
    for name, source, where in entries:
        if source is None:
            not_dicom += 1
            continue
        if isinstance(source, Path):
            with open(source, "rb") as fh:
                if not _is_dicom_head(fh.read(_DICOM_OFFSET + 4)):
                    not_dicom += 1
                    continue
        ds = _header(source, name)
        if ds is None:
            not_dicom += 1
            continue
        if "Rows" not in ds or "Columns" not in ds or "BitsAllocated" not in ds:  # read up to the pixels
            no_pixels += 1
            continue
        found.append(DicomFile(name, ds, where))
    skipped = []
    if not_dicom:
        skipped.append(f"{not_dicom} file(s) that are not DICOM skipped")
    if no_pixels:
        skipped.append(f"{no_pixels} DICOM object(s) without pixel data skipped (DICOMDIR, reports ...)")
    if not found:
        raise DicomSeriesError(
            "no pixel data: the upload holds no DICOM image" + (f" ({'; '.join(skipped)})" if skipped else "")
        )
    logger.info("DICOM upload: %d image object(s); %s", len(found), "; ".join(skipped) or "nothing skipped")
    return found, skipped


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == ZIP_MAGIC


def _zip_entries(path: Path, max_bytes: int | None) -> Iterator[tuple[str, Any, Any]]:
    """``(name, BytesIO, (path, name))`` of every DICOM member of the zip at ``path``."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DecodeError(f"corrupt zip: {exc}") from exc
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if len(members) > _MAX_MEMBERS:
            raise PayloadTooLargeError(f"the zip has {len(members)} files; at most {_MAX_MEMBERS} are read")
        declared = sum(m.file_size for m in members)
        if max_bytes is not None and declared > max_bytes:
            raise PayloadTooLargeError(
                f"the zip declares {declared} bytes once inflated; the limit is max_bytes={max_bytes}"
            )
        for member in members:
            try:
                with archive.open(member) as fh:
                    head = fh.read(_DICOM_OFFSET + 4)
                    if not _is_dicom_head(head):
                        yield member.filename, None, None
                        continue
                    data = head + fh.read()
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise DecodeError(f"corrupt zip member {member.filename}: {exc}") from exc
            yield member.filename, io.BytesIO(data), (path, member.filename)

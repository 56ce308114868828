"""Request bodies streamed to a temporary file, never wholly into memory, with a byte limit.

The body is either the raw file (``curl --data-binary @scan.nii.gz``) or a multipart form whose
field ``file`` holds it (``curl -F file=@scan.nii.gz``); multipart is parsed on the fly as chunks
arrive. Several ``file`` parts (the files of a DICOM series: ``curl -F file=@a.dcm -F file=@b.dcm``)
become a folder at the given path, one file per part (``00000.dcm``, ...).
The limit is enforced while reading: a declared ``Content-Length`` over the limit is refused
before a byte is read, and an undeclared (chunked) body is cut off as soon as it passes the limit.
File writes run in worker threads, so the event loop never blocks on disk I/O.

A slow or stalled sender cannot hold the server: uploads in progress are bounded by their own
count (:class:`UploadSlots`, 503 beyond, apart from the inference queue: a request takes an
inference slot only once its body has arrived), and each must keep a minimum average rate after
a grace period and never pause longer than ``idle_s`` (408 ``upload_timeout`` otherwise).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from service.errors import (
    BadParameterError,
    EmptyBodyError,
    PayloadTooLargeError,
    QueueFullError,
    UploadTimeoutError,
)

__all__ = ["Pace", "UploadSlots", "receive_upload"]

logger = logging.getLogger(__name__)

FILE_FIELD = "file"


class _FilePart:
    """Callbacks of python-multipart's push parser that keep the data of the ``file`` field."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, bytes]] = []  # (index of the file part, data)
        self.count = 0
        self.found = False
        self.finished = False
        self._active = False
        self._field = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._field = self._value = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field = self._value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if options.get(b"name") == FILE_FIELD.encode():
            self.found = self._active = True
            self.count += 1

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._active:
            self.pending.append((self.count - 1, bytes(data[start:end])))

    def _part_end(self) -> None:
        if self._active:
            self._active = False
            self.finished = True


@dataclass(frozen=True, slots=True)
class Pace:
    """How fast an upload must arrive.

    Attributes:
        min_rate: bytes per second the upload must average once ``grace_s`` has passed (0: none).
        grace_s: seconds from the first byte read before the minimum rate applies.
        idle_s: the longest pause between two chunks (seconds).
    """

    min_rate: int = 0
    grace_s: float = 10.0
    idle_s: float = 30.0

    def deadline(self, started: float, received: int, now: float) -> tuple[float, str]:
        """When the next chunk must have arrived (monotonic seconds), and why."""
        idle = now + self.idle_s
        if self.min_rate <= 0:
            return idle, f"no data for {self.idle_s:g} s"
        slow = started + max(self.grace_s, received / self.min_rate)
        if slow < idle:
            return slow, f"slower than upload_min_rate={self.min_rate} bytes/s after {self.grace_s:g} s"
        return idle, f"no data for {self.idle_s:g} s"


class UploadSlots:
    """At most ``limit`` uploads in progress at once (each held while its body arrives).

    Raises :class:`~service.errors.QueueFullError` (503 with ``Retry-After``) when all are taken.
    """

    def __init__(self, limit: int, *, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold one slot for the duration of the ``with`` block."""
        with self._lock:
            if self.active >= self.limit:
                raise QueueFullError(
                    f"{self.active} uploads are in progress (max_uploads={self.limit}); "
                    f"retry in {self.retry_after_s} s",
                    retry_after_s=self.retry_after_s,
                )
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1


def _part_path(path: Path, index: int) -> Path:
    return path.with_name(f".{path.name}.part{index:05d}")


def _gather_parts(path: Path, count: int) -> None:
    """The file parts as one folder at ``path`` (``00000.dcm`` ...), empty parts left out."""
    path.rename(_part_path(path, 0))
    path.mkdir()
    for index in range(count):
        part = _part_path(path, index)
        if part.exists():
            if part.stat().st_size:
                part.rename(path / f"{index:05d}.dcm")
            else:
                part.unlink()


def _too_large(received: int, limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"the upload is larger than max_upload_bytes={limit} (stopped reading after {received} bytes)"
    )


async def receive_upload(
    request: Request, path: Path, *, max_bytes: int, pace: Pace | None = None
) -> tuple[Path, int]:
    """Stream the request's file to ``path``, at no less than ``pace``.

    Returns:
        ``(path, body_bytes)``: the file, and the number of body bytes received.

    Raises:
        PayloadTooLargeError: the body exceeds ``max_bytes`` (declared or counted).
        EmptyBodyError: an empty body, or a multipart form without a non-empty ``file`` field.
        BadParameterError: a multipart content type without a boundary.
        UploadTimeoutError: the body paused longer than ``pace.idle_s``, or averaged less than
            ``pace.min_rate`` after ``pace.grace_s`` (408).
    """
    pace = pace or Pace()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"Content-Length {declared} exceeds max_upload_bytes={max_bytes}; nothing was read"
        )
    content_type, options = parse_options_header(request.headers.get("content-type"))
    parser: MultipartParser | None = None
    part: _FilePart | None = None
    if content_type == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            raise BadParameterError("multipart/form-data without a boundary")
        part = _FilePart()
        parser = MultipartParser(boundary, part.callbacks())  # type: ignore[arg-type]
    received = 0
    written = 0
    started = time.monotonic()
    chunks = request.stream().__aiter__()
    extra: tuple[int, Any] | None = None  # the open file of a file part after the first
    async with await anyio.open_file(path, "wb") as sink:
        while True:
            deadline, why = pace.deadline(started, received, time.monotonic())
            try:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise UploadTimeoutError(
                    f"the upload stalled: {why} ({received} bytes in {time.monotonic() - started:.1f} s)"
                ) from None
            if not chunk:
                continue
            received += len(chunk)
            if received > max_bytes:
                raise _too_large(received, max_bytes)
            if parser is None or part is None:
                await sink.write(chunk)
                written += len(chunk)
                continue
            try:
                parser.write(chunk)
            except MultipartParseError as exc:
                raise BadParameterError(f"malformed multipart body: {exc}") from exc
            for index, data in part.pending:
                if index > 0 and (extra is None or extra[0] != index):  # the next file of a series
                    if extra is not None:
                        await extra[1].aclose()
                    extra = (index, await anyio.open_file(_part_path(path, index), "wb"))
                await (sink if index == 0 else extra[1]).write(data)  # type: ignore[index]
                written += len(data)
            part.pending.clear()
    if extra is not None:
        await extra[1].aclose()
    if parser is not None and part is not None:
        try:
            parser.finalize()
        except MultipartParseError as exc:
            raise BadParameterError(f"malformed multipart body: {exc}") from exc
        if not part.found:
            raise EmptyBodyError(f"the multipart form has no field {FILE_FIELD!r}")
        if part.count > 1:
            await anyio.to_thread.run_sync(_gather_parts, path, part.count)
    if written == 0:
        raise EmptyBodyError(
            "the request has an empty body: send the file (raw or as multipart field 'file')"
        )
    logger.info("received upload of %d bytes (%d file bytes)", received, written)
    return path, received

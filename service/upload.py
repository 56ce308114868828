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
inference slot only once its body has arrived) and by their count per client
(``TILEWISE_MAX_UPLOADS_PER_CLIENT``, :mod:`service.clients`), and each must keep a minimum average
rate after a grace period and never pause longer than ``idle_s`` (408 ``upload_timeout``
otherwise). The minimum rate rises with the share of upload slots taken (:func:`rate_factor`: x1
up to half of them, then linearly to x4 when all are), so that senders just above the minimum
cannot hold every slot for long: at 16 KiB/s, 16 uploads that fill 16 slots must each average
64 KiB/s once their grace period is over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
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

__all__ = ["MAX_RATE_FACTOR", "Pace", "UploadSlots", "rate_factor", "receive_upload"]

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


#: The minimum upload rate when every upload slot is taken, times ``upload_min_rate``.
MAX_RATE_FACTOR = 4.0


def rate_factor(pressure: float) -> float:
    """The factor of ``upload_min_rate`` at ``pressure`` (the share of upload slots taken, 0..1):
    1 up to 0.5, then linear up to :data:`MAX_RATE_FACTOR` at 1.

    >>> rate_factor(0.25), rate_factor(0.75), rate_factor(1.0)
    (1.0, 2.5, 4.0)
    """
    excess = min(1.0, max(0.0, (pressure - 0.5) / 0.5))
    return 1.0 + (MAX_RATE_FACTOR - 1.0) * excess


@dataclass(frozen=True, slots=True)
class Pace:
    """How fast an upload must arrive.

    Attributes:
        min_rate: bytes per second the upload must average once ``grace_s`` has passed (0: none),
            times :func:`rate_factor` of ``pressure()``.
        grace_s: seconds from the first byte read before the minimum rate applies.
        idle_s: the longest pause between two chunks (seconds).
        pressure: the share of upload slots taken now (:meth:`UploadSlots.pressure`); ``None``: 0.
    """

    min_rate: int = 0
    grace_s: float = 10.0
    idle_s: float = 30.0
    pressure: Callable[[], float] | None = None

    def deadline(self, started: float, received: int, now: float) -> tuple[float, str]:
        """When the next chunk must have arrived (monotonic seconds), and why."""
        idle = now + self.idle_s
        if self.min_rate <= 0:
            return idle, f"no data for {self.idle_s:g} s"
        pressure = self.pressure() if self.pressure is not None else 0.0
        factor = rate_factor(pressure)
        rate = self.min_rate * factor
        slow = started + max(self.grace_s, received / rate)
        if slow < idle:
            why = f"slower than upload_min_rate={self.min_rate} bytes/s after {self.grace_s:g} s"
            if factor > 1.0:
                why = (
                    f"slower than {rate:.0f} bytes/s after {self.grace_s:g} s ({factor:.1f} x "
                    f"upload_min_rate={self.min_rate}: {pressure:.0%} of the upload slots are taken)"
                )
            return slow, why
        return idle, f"no data for {self.idle_s:g} s"


class UploadSlots:
    """At most ``limit`` uploads in progress at once (each held while its body arrives), and at
    most ``per_client`` of one client.

    Raises :class:`~service.errors.QueueFullError` (503 with ``Retry-After``) when all are taken,
    or the client's are.
    """

    def __init__(self, limit: int, *, retry_after_s: int = 1, per_client: int | None = None) -> None:
        self.limit = limit
        self.per_client = per_client
        self.retry_after_s = retry_after_s
        self.active = 0
        self._clients: dict[str, int] = {}
        self._lock = threading.Lock()

    def pressure(self) -> float:
        """The share of slots taken now (0..1)."""
        return self.active / self.limit

    @contextmanager
    def hold(self, client: str | None = None) -> Iterator[None]:
        """Hold one slot, of ``client`` (:func:`service.clients.client_of`), for the ``with`` block."""
        with self._lock:
            if self.active >= self.limit:
                raise QueueFullError(
                    f"{self.active} uploads are in progress (max_uploads={self.limit}); "
                    f"retry in {self.retry_after_s} s",
                    retry_after_s=self.retry_after_s,
                )
            mine = self._clients.get(client, 0) if client is not None else 0
            if self.per_client is not None and client is not None and mine >= self.per_client:
                raise QueueFullError(
                    f"this client has {mine} uploads in progress (TILEWISE_MAX_UPLOADS_PER_CLIENT="
                    f"{self.per_client}); retry in {self.retry_after_s} s",
                    retry_after_s=self.retry_after_s,
                )
            self.active += 1
            if client is not None:
                self._clients[client] = mine + 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
                if client is not None:
                    self._clients[client] -= 1
                    if not self._clients[client]:
                        del self._clients[client]


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

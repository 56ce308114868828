"""Typed, retrying httpx client for the tilewise HTTP API (``/v1/models``, ``/v1/models/{name}/infer``,
and the jobs of :mod:`service.client.jobs`).

Every httpx exception is translated here, at one boundary, into :mod:`service.client.errors`.
Uploads stream from disk in 1 MiB chunks with a ``Content-Length`` header, and answers stream to
disk, so memory stays flat whatever the file size. A failed attempt is retried from the start of
the file (a raw body cannot be resumed), after :func:`service.client.retry.backoff_delay`.

One :class:`TilewiseClient` is safe to share between threads: httpx's connection pool is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import quote

import httpx

from service.client.errors import ClientError, Interrupted, ServerError, TransportFailure, UnknownModelError
from service.client.jobs import JobsMixin
from service.client.retry import backoff_delay, parse_retry_after
from service.client.settings import ClientSettings

__all__ = ["InferAnswer", "TilewiseClient"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_CHUNK_BYTES = 1 << 20
_MAX_ERROR_BODY = 64 * 1024  # bytes of an error answer kept for the message
_USER_AGENT = "tilewise-batch/0.1"


@dataclass(frozen=True, slots=True)
class InferAnswer:
    """What one successful inference request returned (the body itself is on disk).

    Attributes:
        attempts: requests made, retries included.
        bytes_out: bytes of the answer written to disk.
        content_type: the answer's ``Content-Type`` (``""`` when absent).
        filename: the file name suggested by ``Content-Disposition``, if any.
        format: the output format the server wrote (``X-Tilewise-Format``), if it said.
    """

    attempts: int
    bytes_out: int
    content_type: str
    filename: str | None
    format: str | None = None


def _file_chunks(fh: BinaryIO, abort: threading.Event | None = None) -> Iterator[bytes]:
    """Yield a file's bytes in 1 MiB chunks (httpx sends each as it comes).

    Raises:
        Interrupted: ``abort`` is set (checked before each chunk).
    """
    while chunk := fh.read(_CHUNK_BYTES):
        _check(abort)
        yield chunk


def _check(abort: threading.Event | None) -> None:
    """Raise :class:`Interrupted` when ``abort`` is set."""
    if abort is not None and abort.is_set():
        raise Interrupted("interrupted")


def _disposition_filename(value: str | None) -> str | None:
    """The ``filename="..."`` of a ``Content-Disposition`` header (base name only)."""
    if not value:
        return None
    for part in value.split(";"):
        key, _, val = part.strip().partition("=")
        if key.lower() == "filename" and val:
            return os.path.basename(val.strip().strip('"')) or None
    return None


def _server_error(response: httpx.Response, body: bytes) -> ServerError:
    """Build a :class:`ServerError` from an error answer and its (possibly cut) body."""
    code, detail = f"http_{response.status_code}", ""
    try:
        payload = json.loads(body)
    except ValueError:
        detail = body.decode("utf-8", "replace").strip()[:500]
    else:
        if isinstance(payload, dict):
            code = str(payload.get("error") or code)
            raw = payload.get("detail", "")
            detail = raw if isinstance(raw, str) else json.dumps(raw)
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    return ServerError(response.status_code, code, detail, retry_after)


def save_answer(response: httpx.Response, dest: Path, abort: threading.Event | None) -> InferAnswer:
    """Stream a 200 answer's body into ``dest`` (fsync'ed): its :class:`InferAnswer` (1 attempt).

    Raises:
        ServerError: the answer is not a 200 (its JSON error, when it has one).
        Interrupted: ``abort`` was set while reading.
    """
    if response.status_code != 200:
        raise _server_error(response, _read_error_body(response))
    bytes_out = 0
    _check(abort)
    with dest.open("wb") as out:
        for chunk in response.iter_bytes(_CHUNK_BYTES):
            _check(abort)
            out.write(chunk)
            bytes_out += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return InferAnswer(
        attempts=1,
        bytes_out=bytes_out,
        content_type=response.headers.get("content-type", ""),
        filename=_disposition_filename(response.headers.get("content-disposition")),
        format=response.headers.get("x-tilewise-format") or None,
    )


def _read_error_body(response: httpx.Response) -> bytes:
    """Up to 64 KiB of a streamed error answer."""
    body = b""
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) >= _MAX_ERROR_BODY:
            break
    return body[:_MAX_ERROR_BODY]


class TilewiseClient(JobsMixin):
    """Client of one tilewise server (or load balancer).

    Args:
        settings: URL, API key, timeout and retry policy.
        transport: httpx transport to use instead of the network (tests pass ``httpx.MockTransport``).
        sleep: function used to wait between attempts (tests pass a fake).
        rng: random source for the backoff jitter.

    Example:
        >>> with TilewiseClient(ClientSettings(url="http://127.0.0.1:8000")) as client:  # doctest: +SKIP
        ...     answer = client.infer_to_file(Path("scan.nii.gz"), Path("out.nii.gz"), "gaussian-3d")
    """

    def __init__(
        self,
        settings: ClientSettings,
        *,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        headers = {"User-Agent": _USER_AGENT}
        if settings.api_key is not None:
            headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
        timeout_s = settings.timeout_s
        self._http = httpx.Client(
            base_url=settings.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0), pool=None),
            limits=httpx.Limits(
                max_connections=settings.concurrency + 1,
                max_keepalive_connections=settings.concurrency,
            ),
            transport=transport,
            follow_redirects=False,
        )
        self._sleep = sleep
        self._rng = rng or random.Random()

    def __enter__(self) -> TilewiseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # -- retry loop -------------------------------------------------------------------------------

    def _with_retries(
        self, what: str, attempt: Callable[[], _T], abort: threading.Event | None = None
    ) -> tuple[_T, int]:
        """Call ``attempt`` until it succeeds, a non-retryable error occurs or retries run out.

        Returns:
            ``(result, attempts)``.

        Raises:
            ClientError: the last failure, with ``attempts`` set.
            Interrupted: ``abort`` was set (no retry then).
        """
        retries, retry_for = self.settings.retries, self.settings.retry_for_s
        waited, n = 0.0, 0
        while True:
            n += 1
            try:
                _check(abort)
                return attempt(), n
            except ClientError as exc:
                exc.attempts = n
                if abort is not None and abort.is_set() and not isinstance(exc, Interrupted):
                    raise Interrupted(f"interrupted (last attempt: {exc})") from exc
                if not exc.retryable or (n > retries and waited >= retry_for):
                    raise
                if n == 1 and isinstance(exc.__cause__, httpx.ConnectError):
                    logger.warning(
                        "%s: no server answers at %s (%s); retrying for up to %.0f s (--retry-for)",
                        what, self.settings.url, exc.__cause__, max(retry_for, 0.0),
                    )  # fmt: skip
                delay = backoff_delay(
                    n,
                    base_s=self.settings.backoff_base_s,
                    max_s=self.settings.backoff_max_s,
                    retry_after_s=getattr(exc, "retry_after_s", None),
                    rng=self._rng,
                )
                if n > retries:  # retries spent: going on for retry_for_s
                    delay = min(delay, max(0.0, retry_for - waited)) or 0.0
                    logger.warning("%s: %s; retry %d in %.1f s (%.0f of %.0f s)", what, exc, n, delay,
                                   waited, retry_for)  # fmt: skip
                else:
                    logger.warning("%s: %s; retry %d/%d in %.1f s", what, exc, n, retries, delay)
                self._sleep(delay)
                waited += max(delay, 0.05)

    # -- endpoints --------------------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the served models with their specs and defaults.

        Raises:
            ServerError: error answer (e.g. 401 without the right API key).
            TransportFailure: the server stayed unreachable through every retry.
        """

        def attempt() -> list[dict[str, Any]]:
            try:
                response = self._http.get("/v1/models")
            except httpx.TransportError as exc:
                raise TransportFailure(f"{self.settings.url}: {type(exc).__name__}: {exc}") from exc
            if response.status_code != 200:
                raise _server_error(response, response.content[:_MAX_ERROR_BODY])
            payload = response.json()
            if isinstance(payload, dict):  # tolerate {"models": [...]}
                payload = payload.get("models", payload.get("data", []))
            if not isinstance(payload, list):
                raise ServerError(200, "bad_answer", "GET /v1/models did not return a list")
            return [m for m in payload if isinstance(m, dict)]

        models, _ = self._with_retries("GET /v1/models", attempt)
        return models

    def model_info(self, name: str) -> dict[str, Any]:
        """The ``/v1/models`` entry of model ``name``.

        Raises:
            UnknownModelError: the server does not serve ``name`` (message lists what it serves).
        """
        models = self.list_models()
        for info in models:
            if info.get("name") == name:
                return info
        names = ", ".join(sorted(str(m.get("name")) for m in models)) or "none"
        raise UnknownModelError(404, "unknown_model", f"model {name!r} is not served; served: {names}")

    def infer_to_file(
        self,
        source: Path,
        dest: Path,
        model: str,
        params: Mapping[str, str] | None = None,
        *,
        label: str | None = None,
        abort: threading.Event | None = None,
    ) -> InferAnswer:
        """``POST /v1/models/{model}/infer`` with ``source`` as the raw body; the answer goes to ``dest``.

        ``dest`` is overwritten on every attempt and holds the complete answer only when this
        returns; on failure its content is undefined (the caller writes to a temporary name).
        When ``abort`` is set, the upload and the download stop at the next chunk, no retry is
        made and ``dest`` is not created any more.

        Args:
            source: input file, streamed from disk.
            dest: where to write the answer body.
            model: model name.
            params: inference query parameters (``tile``, ``halo``, ``format`` ...).
            label: name of the file in retry log lines (default: ``source``'s name).
            abort: set by another thread to abandon the request.

        Raises:
            Interrupted: ``abort`` was set.
            ServerError: an error answer (after retries for 429/502/503/504).
            TransportFailure: no complete answer through every retry.
            OSError: ``source`` cannot be read or ``dest`` cannot be written.
        """
        path = f"/v1/models/{quote(model, safe='')}/infer"
        query = dict(params or {})

        def attempt() -> InferAnswer:
            size = source.stat().st_size
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            try:
                with source.open("rb") as fh:
                    with self._http.stream(
                        "POST", path, params=query, content=_file_chunks(fh, abort), headers=headers
                    ) as response:
                        return save_answer(response, dest, abort)
            except httpx.TransportError as exc:
                raise TransportFailure(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc

        answer, attempts = self._with_retries(label or source.name, attempt, abort)
        return dataclasses.replace(answer, attempts=attempts)

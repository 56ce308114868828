"""The jobs API from the client side: submit a file, poll its progress, download its result.

:class:`JobsMixin` gives :class:`~service.client.api.TilewiseClient` its job methods.
:meth:`~JobsMixin.run_job` is what ``tilewise batch --jobs`` does per file:

1. ``POST /v1/jobs?model=...`` with the file and an ``Idempotency-Key`` made for this file, the
   same on every retry, so that a retried submission (its answer lost, or a 503) makes one job;
2. ``GET /v1/jobs/{id}`` every :data:`POLL_S` until the job ends, each poll retried like any request
   (connection errors, 502/503/504): when the replica running the job dies, another one takes it
   over (``TILEWISE_JOB_LEASE_S``), and every replica answers for every job;
3. ``GET /v1/jobs/{id}/result``, streamed to the caller's file and retried from the start.

``abort`` (a second Ctrl-C) cancels the job (``DELETE``, best effort) and raises
:class:`~service.client.errors.Interrupted`.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from service.client.errors import ClientError, Interrupted, JobFailedError, ServerError, TransportFailure

if TYPE_CHECKING:
    from service.client.api import InferAnswer

__all__ = ["POLL_S", "JobsMixin"]

#: Seconds between two status polls of a job.
POLL_S = 0.5
_FINISHED = ("done", "failed", "cancelled")


def _check(abort: threading.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise Interrupted("interrupted")


def _job_path(job_id: str) -> str:
    return f"/v1/jobs/{quote(job_id, safe='')}"


class JobsMixin:
    """Job methods of :class:`~service.client.api.TilewiseClient` (which provides ``_http``,
    ``_with_retries``, ``_sleep`` and ``settings``)."""

    _http: httpx.Client
    settings: Any
    _sleep: Callable[[float], None]
    _with_retries: Callable[..., Any]

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One request whose answer is a JSON object (2xx), errors translated."""
        from service.client.api import _server_error

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise TransportFailure(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        if response.status_code // 100 != 2:
            raise _server_error(response, response.content[: 64 * 1024])
        payload = response.json()
        if not isinstance(payload, dict):
            raise ServerError(response.status_code, "bad_answer", f"{method} {path} did not return an object")
        return payload

    def submit_job(
        self,
        source: Path,
        model: str,
        params: Mapping[str, str] | None = None,
        *,
        key: str | None = None,
        label: str | None = None,
        abort: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/jobs`` with ``source`` as the raw body; returns the job's status.

        Args:
            key: the ``Idempotency-Key`` (default: a new UUID), sent on every retry.
        """
        from service.client.api import _file_chunks

        key = key or uuid.uuid4().hex
        query = {"model": model, **dict(params or {})}

        def attempt() -> dict[str, Any]:
            size = source.stat().st_size
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Length": str(size),
                "Idempotency-Key": key,
            }
            with source.open("rb") as fh:
                body = _file_chunks(fh, abort)
                return self._json("POST", "/v1/jobs", params=query, content=body, headers=headers)

        job, _ = self._with_retries(f"{label or source.name}: submit", attempt, abort)
        return dict(job)

    def job_status(self, job_id: str, *, abort: threading.Event | None = None) -> dict[str, Any]:
        """``GET /v1/jobs/{id}`` (retried)."""
        status, _ = self._with_retries(f"job {job_id}", lambda: self._json("GET", _job_path(job_id)), abort)
        return dict(status)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """``DELETE /v1/jobs/{id}`` (retried); the job stops before its next batch."""
        status, _ = self._with_retries(f"cancel {job_id}", lambda: self._json("DELETE", _job_path(job_id)))
        return dict(status)

    def download_result(
        self, job_id: str, dest: Path, *, abort: threading.Event | None = None
    ) -> InferAnswer:
        """``GET /v1/jobs/{id}/result`` into ``dest`` (retried from the start; fsync'ed)."""
        from service.client.api import save_answer

        def attempt() -> InferAnswer:
            try:
                with self._http.stream("GET", f"{_job_path(job_id)}/result") as response:
                    return save_answer(response, dest, abort)
            except httpx.TransportError as exc:
                raise TransportFailure(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc

        answer: InferAnswer
        answer, attempts = self._with_retries(f"job {job_id}: result", attempt, abort)
        return dataclasses.replace(answer, attempts=attempts)

    def run_job(
        self,
        source: Path,
        dest: Path,
        model: str,
        params: Mapping[str, str] | None = None,
        *,
        label: str | None = None,
        abort: threading.Event | None = None,
        on_progress: Callable[[int, int | None], object] | None = None,
    ) -> InferAnswer:
        """Submit ``source`` as a job, follow it to its end and write its result to ``dest``.

        Args:
            on_progress: called with ``(tiles_done, tiles_total)`` after every poll that changed them.

        Raises:
            JobFailedError: the job failed or was cancelled.
            ServerError: a request was refused.
            TransportFailure: the server stayed unreachable through every retry of one request.
            Interrupted: ``abort`` was set (the job is cancelled on the server, best effort).
        """
        job = self.submit_job(source, model, params, label=label, abort=abort)
        job_id = str(job["id"])
        seen: tuple[Any, Any] | None = None
        try:
            while True:
                if on_progress is not None and (job.get("tiles_done"), job.get("tiles_total")) != seen:
                    seen = (job.get("tiles_done"), job.get("tiles_total"))
                    on_progress(int(job.get("tiles_done") or 0), job.get("tiles_total"))
                state = job.get("state")
                if state in _FINISHED:
                    break
                self._sleep(POLL_S)
                _check(abort)
                job = self.job_status(job_id, abort=abort)
        except Interrupted:
            try:
                self.cancel_job(job_id)
            except ClientError:
                pass
            raise
        if state != "done":
            error = job.get("error") or {}
            code = str(error.get("error") or f"job_{state}")
            raise JobFailedError(job_id, code, str(error.get("detail") or f"the job was {state}"))
        return self.download_result(job_id, dest, abort=abort)

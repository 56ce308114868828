"""The jobs API: ``POST /v1/jobs``, ``GET /v1/jobs[/{id}[/events|/result]]``, ``DELETE /v1/jobs/{id}``.

Handlers only do HTTP; jobs live in :mod:`service.jobs`. Any replica that shares the jobs folder
answers every route for every job. A job belongs to the API key that submitted it (its name is the
record's ``owner``): other keys get 404 for it and do not see it listed; the ``admin`` key sees
every job (:mod:`service.security`). A submission is checked like a synchronous request (model,
parameters, budget, upload limits, the file's header and plan) before it becomes a job, and takes a
place in the device queue (503 when full).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import shutil
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from models.planning.params import InferenceParams, parse_query
from service.admission import admit, check_request
from service.budget import Budget
from service.clients import client_of
from service.deps import ExecutorDep, MetricsDep, RepositoryDep, SettingsDep
from service.errors import (
    BadParameterError,
    IdempotencyKeyReusedError,
    JobNotFoundError,
    JobStateError,
    NotReadyError,
)
from service.executor import Slot
from service.jobs import JobRecord, JobService, JobState, event_stream, job_status
from service.jobs.dicomweb_job import DICOMWEB_KEYS, dicomweb_request, pull_job_input
from service.jobs.store import INPUT_FILE
from service.precheck import Limits
from service.requestid import current_request_id
from service.routes.docs import error_doc, params_doc, result_content
from service.security import Principal, require_api_key
from service.upload import Pace, receive_upload

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter(tags=["jobs"])

#: ``Idempotency-Key``: visible ASCII, as in the IETF draft's examples (a UUID is typical).
_KEY_RE = re.compile(r"^[\x21-\x7e]{1,255}$")

_STATUS_EXAMPLE = {
    "id": "0f8c1e3a9b6d4e2f8a7c5b3d1e9f0a2b",
    "model": "gaussian-3d",
    "state": "running",
    "tiles_done": 12,
    "tiles_total": 40,
    "tiles_skipped": 0,
    "progress": 0.3,
    "eta_s": 8.5,
    "created": "2026-12-01T13:49:34.988Z",
    "started": "2026-12-01T13:49:35.102Z",
    "finished": None,
    "error": None,
    "params": {"tile": "64"},
    "stage": None,
}
_UNKNOWN = error_doc("unknown_job", "No job of this id (never submitted, or expired).")


def _service(request: Request) -> JobService:
    service: JobService | None = getattr(request.app.state, "jobs", None)
    if service is None:
        raise NotReadyError("the server is starting or stopping")
    return service


JobsDep = Annotated[JobService, Depends(_service)]
PrincipalDep = Annotated[Principal, Depends(require_api_key)]


def _accepted(record: JobRecord) -> JSONResponse:
    return JSONResponse(job_status(record), 202, headers={"Location": f"/v1/jobs/{record.id}"})


def _read_own(service: JobService, job_id: str, principal: Principal) -> JobRecord:
    """The job's record, when ``principal`` may see it.

    Raises:
        JobNotFoundError: no such job, or another key's (the same 404: ids are not disclosed).
    """
    record = service.store.read(job_id)
    if not principal.may_see(record.owner):
        raise JobNotFoundError(f"no job {job_id} (never submitted, or expired)")
    return record


def _same_job(
    service: JobService, job_id: str, model: str, query: dict[str, str], principal: Principal
) -> JobRecord:
    """The record of the job an idempotency key names, if it was made with this request's model
    and parameters."""
    record = _read_own(service, job_id, principal)
    if record.model != model or record.query != query:
        raise IdempotencyKeyReusedError(
            f"Idempotency-Key names job {job_id} (model {record.model}, parameters "
            f"{record.query}); this request has model {model}, parameters {query}"
        )
    return record


def _same_body(store: Any, job_id: str, key_hash: str, digest: str) -> None:
    """Refuse a retry whose body is not the one the key's job was made from (its SHA-256)."""
    first = store.key_digest(key_hash)
    if first is not None and first != digest:
        raise IdempotencyKeyReusedError(
            f"Idempotency-Key names job {job_id}, made from a body of sha256 {first[:16]}...; this "
            f"request's body has sha256 {digest[:16]}... (a new file needs a new key)"
        )


def _file_sha256(path: Path) -> str:
    """SHA-256 of an uploaded body: the file, or a folder's files (a DICOM series sent as several
    parts) by their sorted relative names and contents."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _parse(request: Request, repository: Any) -> tuple[str, InferenceParams]:
    items = request.query_params.multi_items()
    names = [value for key, value in items if key == "model"]
    if len(names) != 1:
        raise BadParameterError("give the model once: POST /v1/jobs?model=NAME&<inference parameters>")
    if any(key == "dry_run" for key, _ in items):
        raise BadParameterError("a job always runs; for a plan, POST /v1/models/{name}/infer?dry_run=true")
    label = str(repository.spec(names[0]).name)
    return label, parse_query([(k, v) for k, v in items if k not in ("model", *DICOMWEB_KEYS)])


_SUBMIT_OPENAPI = {
    "parameters": [
        {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
        *params_doc(exclude=("dry_run",)),  # a job always runs: refused with 400
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": "A retried submission with the same key (same model, parameters and body) "
            "returns the same job; another body or parameters: 409.",
            "schema": {"type": "string", "maxLength": 255},
        },
    ],
    "requestBody": {
        "required": True,
        "description": "The file, raw or as the multipart field `file` (as for the synchronous endpoint).",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary", "minLength": 1}},
                    "required": ["file"],
                }
            },
        },
    },
}


@router.post(
    "/jobs",
    status_code=202,
    openapi_extra=_SUBMIT_OPENAPI,
    responses={
        202: {"description": "The job (`Location: /v1/jobs/{id}`).", "content": {"application/json": {}}},
        400: error_doc("bad_parameter", "Missing model, invalid parameter or key, or an empty body."),
        404: error_doc("unknown_model", "No model of this name."),
        409: error_doc("idempotency_key_reused", "The key names a job of another model, parameters or body."),
        408: error_doc("upload_timeout", "The upload stalled, or arrived below the minimum rate."),
        413: error_doc("payload_too_large", "Upload, image or plan over the limits."),
        415: error_doc("unsupported_media_type", "Not a format tilewise reads (by content)."),
        422: error_doc("unusable_input", "Corrupt file, wrong dimensionality, or a plan over the limits."),
        503: error_doc(
            "queue_full",
            "The device queue is full (retry after `Retry-After` seconds); or `model_unavailable`: the "
            "model fails to load (as on the synchronous route).",
        ),
        507: error_doc("insufficient_storage", "The disk cannot hold the output and temporaries."),
    },
)
async def submit_job(
    request: Request,
    settings: SettingsDep,
    metrics: MetricsDep,
    repository: RepositoryDep,
    executor: ExecutorDep,
    service: JobsDep,
    principal: PrincipalDep,
) -> Response:
    """Submit a file as a job; watch it with GET /v1/jobs/{id} or /events."""
    state = request.app.state
    if not getattr(state, "ready", False):
        raise NotReadyError("models are not loaded (starting or shutting down)")
    store = service.store
    label, params = _parse(request, repository)
    dicomweb, params = dicomweb_request(request.query_params.multi_items(), params, settings)
    Budget.from_settings(settings).check_params(params)
    check_request(repository.spec(label), params)
    query = params.to_query()
    key = request.headers.get("idempotency-key")
    key_hash = None
    retried: JobRecord | None = None
    if key is not None:
        if not _KEY_RE.match(key):
            raise BadParameterError("Idempotency-Key must be 1 to 255 visible ASCII characters")
        key_hash = store.key_hash(key, principal.name)
        found = await anyio.to_thread.run_sync(store.find_key, key_hash)
        if found is not None:  # a retry: same model and parameters, then (once read) same body
            retried = await anyio.to_thread.run_sync(_same_job, service, found, label, query, principal)
    client = client_of(request)  # its share of the queue and of the upload slots
    if retried is None and not executor.has_room_for(client):
        raise executor.full_error() if executor.has_room() else executor.client_full_error()
    folder: Path | None = None
    slot: Slot | None = None
    try:
        with state.uploads.hold(client):
            job_id, job_folder = await anyio.to_thread.run_sync(store.new_folder)
            folder = job_folder
            pace = Pace(settings.upload_min_rate, settings.upload_grace_s, settings.upload_idle_s,
                        pressure=state.uploads.pressure)  # fmt: skip
            if dicomweb is not None:  # no body: the series comes from the DICOMweb server
                source, n_bytes = await anyio.to_thread.run_sync(
                    pull_job_input, settings, dicomweb, job_folder / INPUT_FILE
                )
            else:
                source, n_bytes = await receive_upload(
                    request, job_folder / INPUT_FILE, max_bytes=settings.max_upload_bytes, pace=pace
                )
        metrics.bytes_in.inc(n_bytes)
        digest = None
        if key_hash is not None:
            digest = await anyio.to_thread.run_sync(_file_sha256, job_folder / INPUT_FILE)
            if retried is not None:
                await anyio.to_thread.run_sync(_same_body, store, retried.id, key_hash, digest)
                return _accepted(retried)
        limits = Limits.from_settings(settings)
        await anyio.to_thread.run_sync(admit, repository, label, source, params, limits)
        slot = executor.reserve(client)
        record, lease = await anyio.to_thread.run_sync(
            service.create, job_id, label, query, key_hash, principal.name
        )
        if dicomweb is not None:  # what the runner stores back (service.jobs.dicomweb_job)
            record.dicomweb = dicomweb
            await anyio.to_thread.run_sync(functools.partial(store.write, record, durable=True))
        if key_hash is not None:
            bound = await anyio.to_thread.run_sync(store.bind_key, key_hash, job_id, digest)
            if bound != job_id:  # a concurrent submission with this key made the job first
                lease.release()
                await anyio.to_thread.run_sync(store.remove, job_id)
                folder = None
                same = await anyio.to_thread.run_sync(_same_job, service, bound, label, query, principal)
                assert digest is not None
                await anyio.to_thread.run_sync(_same_body, store, bound, key_hash, digest)
                return _accepted(same)
        service.enqueue(lease, slot)
        folder = None
        logger.info("request %s: job %s queued model=%s", current_request_id(), job_id, label)
        return _accepted(record)
    except ClientDisconnect:
        logger.info("request %s: client disconnected during a job upload", current_request_id())
        return Response(status_code=499)
    finally:
        if slot is not None:
            slot.release()  # a no-op once the job took it
        if folder is not None:
            await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, folder, ignore_errors=True))


@router.get("/jobs", responses={400: error_doc("bad_parameter", "`limit` is not an integer from 1 to 1000.")})
async def list_jobs(
    service: JobsDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="Most jobs listed.")] = 50,
) -> list[dict[str, Any]]:
    """List the most recent jobs of this key (every job for the admin key), newest first."""
    records = await anyio.to_thread.run_sync(
        functools.partial(service.store.recent, limit, principal.name, everyone=principal.admin)
    )
    return [job_status(r) for r in records]


@router.get(
    "/jobs/{job_id}",
    responses={200: {"content": {"application/json": {"example": _STATUS_EXAMPLE}}}, 404: _UNKNOWN},
)
async def get_job(job_id: str, service: JobsDep, principal: PrincipalDep) -> dict[str, Any]:
    """The job's state and progress; while queued on this replica, ``position`` (1 = next)."""
    status = job_status(await anyio.to_thread.run_sync(_read_own, service, job_id, principal))
    if status.get("state") == JobState.QUEUED.value:
        position = service.position(job_id)
        if position is not None:
            status["position"] = position
    return status


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "`text/event-stream`: one `progress` event per change (data: the job's "
            "status), then one `done`, `failed` or `cancelled` event.",
            "content": {"text/event-stream": {}},
        },
        404: _UNKNOWN,
    },
)
async def job_events(job_id: str, service: JobsDep, principal: PrincipalDep) -> StreamingResponse:
    """Follow the job as server-sent events until it ends."""
    store = service.store
    await anyio.to_thread.run_sync(_read_own, service, job_id, principal)  # 404 before the stream starts
    return StreamingResponse(
        event_stream(functools.partial(store.read, job_id)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _no_result(job_id: str, record: JobRecord) -> str:
    """Why job ``job_id`` has no result to download: it was cancelled, it failed, or not yet done."""
    state = record.state
    if state is JobState.CANCELLED:
        return f"job {job_id} was cancelled: it has no result (submit it again to get one)"
    if state is JobState.FAILED:
        return f"job {job_id} failed: it has no result (GET /v1/jobs/{job_id} says why)"
    return f"job {job_id} is {state.value}; its result exists once it is done"


@router.get(
    "/jobs/{job_id}/result",
    responses={
        200: {
            "description": "The output file, as the synchronous endpoint returns it (same headers).",
            "content": result_content(),
        },
        404: _UNKNOWN,
        409: error_doc("job_not_done", "The job is not done (yet, or it failed or was cancelled)."),
    },
)
async def job_result(job_id: str, service: JobsDep, principal: PrincipalDep) -> Response:
    """Download the job's result."""
    store = service.store
    record = await anyio.to_thread.run_sync(_read_own, service, job_id, principal)
    result = record.result
    if record.state is not JobState.DONE or result is None:
        raise JobStateError(_no_result(job_id, record))
    path = store.folder(job_id) / result.file
    if not path.is_file():
        raise JobNotFoundError(f"the result of job {job_id} has expired")
    return FileResponse(path, media_type=result.media_type, filename=result.filename, headers=result.headers)


@router.delete("/jobs/{job_id}", status_code=202, responses={404: _UNKNOWN})
async def cancel_job(job_id: str, service: JobsDep, principal: PrincipalDep) -> JSONResponse:
    """Cancel the job: it stops before its next batch (a finished job stays as it is)."""
    await anyio.to_thread.run_sync(_read_own, service, job_id, principal)
    await anyio.to_thread.run_sync(service.cancel, job_id)
    record = await anyio.to_thread.run_sync(service.store.read, job_id)
    return JSONResponse(job_status(record), 202)

"""``POST /v1/models/{name}/infer``: upload, queue, run the pipeline, answer with the file."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from models.planning.params import InferenceParams, parse_query
from service.admission import admit, check_request, load_model
from service.budget import Budget
from service.clients import client_of
from service.deadline import RunDeadline
from service.deps import ExecutorDep, MetricsDep, RepositoryDep, SettingsDep
from service.errors import NotReadyError
from service.executor import Slot
from service.http_errors import classify
from service.metrics import Metrics
from service.pipeline import InferenceResult, Limits, prepare_file, run_file
from service.requestid import current_request_id
from service.routes.docs import error_doc, params_doc, result_content
from service.stages import Prepared, RunOptions, execute, finish, result_headers
from service.upload import Pace, receive_upload

__all__ = ["router"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

router = APIRouter(tags=["models"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The output file, on the input's grid (same size; NIfTI: same affine, qform/sform "
        "codes, zooms and units). `X-Tilewise-*` headers describe it; `X-Tilewise-Plan` gives the plan "
        "that ran (`tile=96,96,96; halo=8,8,8; overlap=0,0,0; tiles=27; work=1.49`); `X-Tilewise-Seam` "
        "(`max=0.031; mean=0.0004; voxels=52000`), for a tile-dependent model or a given halo below a "
        "local model's receptive-field radius (not for `halo=auto` that met its tolerance: that output is "
        "within it of the whole pass), the largest and mean absolute difference between overlapping "
        "tiles' predictions where they overlap (not a distance to the whole pass), measured during the "
        "run; `X-Tilewise-Warning` says (one "
        "sentence) when a given halo is below a local model's receptive-field radius.",
        "content": {
            **result_content(),
            "application/json": {
                "schema": {"type": "object"},
                "example": {
                    "model": "gaussian-3d",
                    "input_shape": [192, 192, 192],
                    "model_shape": [192, 192, 192],
                    "tile": [60, 60, 60],
                    "halo": [8, 8, 8],
                    "overlap": [0, 0, 0],
                    "blend": "constant",
                    "batch_size": 2,
                    "tiles": 64,
                    "work": 1.95,
                    "peak_bytes": 103079215,
                    "eta_s": 14.2,
                    "tta": "none",
                    "tile_dependent": False,
                },
            },
        },
    },
    400: error_doc("bad_parameter", "Invalid, unknown or repeated query parameter, or an empty body."),
    401: error_doc("unauthorized", "Missing or wrong API key (when the server has one)."),
    404: error_doc("unknown_model", "No model of this name (the detail lists close matches)."),
    408: error_doc("upload_timeout", "The upload stalled, or arrived below the minimum rate."),
    413: error_doc(
        "payload_too_large",
        "Upload over max_upload_bytes, image over max_voxels (on the model grid too) / pixels / "
        "decompressed bytes / compression ratio, or a plan whose predicted memory is over "
        "max_request_bytes (`over_budget`).",
    ),
    415: error_doc("unsupported_media_type", "Not NIfTI-1/2, PNG, JPEG, TIFF or DICOM (by content)."),
    422: error_doc(
        "unusable_input",
        "Corrupt/truncated file, wrong dimensionality or channels, NaN-only, an implausible voxel "
        "size for the model; or a plan over max_batch_size / max_tiles / max_work / "
        "min_voxels_per_tile / max_request_seconds, or a run stopped past twice max_request_seconds "
        "(`over_budget`).",
    ),
    503: error_doc(
        "queue_full",
        "The device queue is full, or this client holds its share of it or of the upload slots; retry "
        "after `Retry-After` seconds.",
    ),
    507: error_doc(
        "insufficient_storage",
        "A streamed request (an input read by region): the disk cannot hold the output and temporaries.",
    ),
}

_OPENAPI = {
    "parameters": params_doc(),
    "requestBody": {
        "required": True,
        "description": "The image or volume: the raw file (`curl --data-binary @scan.nii.gz`) or a "
        "multipart form with the field `file` (`curl -F file=@scan.nii.gz`). The format is detected "
        "by content: NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG, TIFF, or a DICOM series (a zip, several "
        "multipart `file` parts, or one enhanced multi-frame object; 422 `dicom_series_invalid` names "
        "what makes it no one volume).",
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


class _CleanupFileResponse(FileResponse):
    """A file response that removes its temporary folder once sent (or when sending fails)."""

    def __init__(self, path: Path, *, cleanup: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await anyio.to_thread.run_sync(
                functools.partial(shutil.rmtree, self._cleanup, ignore_errors=True)
            )


def _loaded(repository: Any, name: str) -> Any:
    """The model, loaded (:func:`service.admission.load_model`: 503 when it fails to load)."""
    return load_model(repository, name)


def _dry_run(repository: Any, name: str, source: Path, params: InferenceParams, limits: Limits) -> Any:
    """Worker-thread dry run: the plan as JSON, the network not run (:mod:`service.dryrun`)."""
    from service.dryrun import dry_run

    return dry_run(_loaded(repository, name), source, params, limits)


def _prepare(
    repository: Any, name: str, source: Path, stem: Path, params: InferenceParams, limits: Limits
) -> Prepared | None:
    """Worker-thread first stage of a streamed request (region source, statistics, one plan,
    output opened), or ``None`` when the input is run whole on the device thread."""
    return prepare_file(_loaded(repository, name), source, stem, params, limits=limits)


def _execute(
    prepared: Prepared,
    metrics: Metrics,
    stop: threading.Event,
    batches: Any = None,
    queued_at: float | None = None,
    deadline: RunDeadline | None = None,
) -> Prepared:
    """Device-thread stage of a streamed request: only its tiled network passes (stopped past
    twice ``max_request_seconds`` by ``deadline``, 422)."""
    if queued_at is not None:
        metrics.stage_seconds.labels("queue").observe(time.perf_counter() - queued_at)
    model = prepared.model
    tiles = metrics.tiles.labels(model.spec.name)
    stopper = deadline.should_stop(stop.is_set) if deadline is not None else stop.is_set
    batch = int(prepared.plan.batch_size)
    shared = batches.bind(model, stopper, batch) if batches is not None else contextlib.nullcontext()
    try:
        running = deadline.running() if deadline is not None else contextlib.nullcontext()
        with shared, running:
            execute(prepared, RunOptions(tiles.inc, stopper))
    except BaseException:
        prepared.close()
        raise
    return prepared


def _finish(prepared: Prepared, metrics: Metrics) -> InferenceResult:
    """Worker-thread last stage of a streamed request: the file completed and described."""
    result: InferenceResult = finish(prepared)
    for stage, seconds in result.stages.items():
        metrics.stage_seconds.labels(stage).observe(seconds)
    model = prepared.model
    metrics.inference_seconds.labels(model.spec.name, str(model.spec.backend)).observe(result.seconds)
    metrics.tiles_skipped.labels(model.spec.name).inc(result.plan.skipped or 0)
    return result


def _precheck(repository: Any, name: str, source: Path, params: InferenceParams, limits: Limits) -> None:
    """Worker-thread admission of the uploaded file (:func:`service.admission.admit`: model, header,
    plan), before it takes a slot; the jobs route admits with the same function."""
    admit(repository, name, source, params, limits)


def _work(
    repository: Any,
    name: str,
    source: Path,
    stem: Path,
    params: InferenceParams,
    limits: Limits,
    metrics: Metrics,
    stop: threading.Event,
    batches: Any = None,
    queued_at: float | None = None,
) -> InferenceResult:
    """Executor-thread work of one request (load the model if needed, run the pipeline), then its
    metrics from the one plan. Tiles are counted batch by batch as they run."""
    if queued_at is not None:
        metrics.stage_seconds.labels("queue").observe(time.perf_counter() - queued_at)
    model = _loaded(repository, name)
    tiles = metrics.tiles.labels(model.spec.name)
    deadline = RunDeadline.of(limits)  # stops a run past twice max_request_seconds (422)
    stopper = deadline.should_stop(stop.is_set)
    shared = batches.bind(model, stopper) if batches is not None else contextlib.nullcontext()
    with shared, deadline.running():  # TILEWISE_SHARED_REQUESTS > 1: forward passes shared
        options = RunOptions(progress=tiles.inc, should_stop=stopper)
        result = run_file(model, source, stem, params, limits=limits, options=options)
    for stage, seconds in result.stages.items():
        metrics.stage_seconds.labels(stage).observe(seconds)
    metrics.inference_seconds.labels(model.spec.name, str(model.spec.backend)).observe(result.seconds)
    metrics.tiles_skipped.labels(model.spec.name).inc(result.plan.skipped or 0)
    return result


async def _await_job(future: concurrent.futures.Future[T], request: Request) -> T | None:
    """The job's result, or ``None`` when the client disconnects first (the job is cancelled
    if it has not started; the caller stops a running one)."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    job = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(disconnected())
    pending: set[asyncio.Future[Any]] = {job, watcher}
    try:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if job in done:
        return job.result()
    job.cancel()
    return None


@router.post("/models/{name}/infer", responses=_RESPONSES, openapi_extra=_OPENAPI)
async def infer(
    name: str,
    request: Request,
    settings: SettingsDep,
    metrics: MetricsDep,
    repository: RepositoryDep,
    executor: ExecutorDep,
) -> Response:
    """Run a model on an uploaded image or volume and return the output file.

    With `dry_run=true`, answer the plan as JSON instead, without running the network: tile, halo,
    overlap, blend, batch_size, tiles, work (voxels through the network per input voxel),
    peak_bytes (predicted peak memory) and eta_s (predicted network time).
    """
    started = time.perf_counter()
    label, status = "unknown", 500
    workdir: Path | None = None
    slot: Slot | None = None
    state = request.app.state
    stop = threading.Event()
    try:  # every outcome, refusals included, is counted in the finally clause
        if not getattr(state, "ready", False):
            raise NotReadyError("models are not loaded (starting or shutting down)")
        label = repository.spec(name).name  # 404 before reading the body
        params = parse_query(request.query_params.multi_items())
        limits = Limits.from_settings(settings)
        Budget.from_settings(settings).check_params(params)
        check_request(repository.spec(name), params)
        client = client_of(request)  # its share of the queue and of the upload slots
        if not params.dry_run and not executor.has_room_for(client):  # a hint: nothing read when full
            raise executor.full_error() if executor.has_room() else executor.client_full_error()
        # The body arrives under the upload bound (count, rate); only then does the request take
        # an inference slot, so slow senders never hold the device queue.
        with state.uploads.hold(client):
            workdir = await anyio.to_thread.run_sync(state.workroot.mkdtemp)
            assert workdir is not None  # a new folder (app.state is untyped)
            pace = Pace(settings.upload_min_rate, settings.upload_grace_s, settings.upload_idle_s,
                        pressure=state.uploads.pressure)  # fmt: skip
            source, n_bytes = await receive_upload(
                request, workdir / "input", max_bytes=settings.max_upload_bytes, pace=pace
            )
        metrics.bytes_in.inc(n_bytes)
        if params.dry_run:  # the plan only: no queue, no network
            answer = await anyio.to_thread.run_sync(_dry_run, repository, label, source, params, limits)
            status = 200
            return JSONResponse(answer)
        await anyio.to_thread.run_sync(_precheck, repository, label, source, params, limits)
        slot = executor.reserve(client)
        stem = workdir / "output"
        prepared = await anyio.to_thread.run_sync(_prepare, repository, label, source, stem, params, limits)
        logger.info("request %s queued model=%s on %s", current_request_id(), label, executor.device)
        batches = getattr(state, "batches", None)
        if prepared is None:  # decoded, run and encoded whole on the device thread
            run = (repository, label, source, stem, params, limits, metrics, stop, batches)
            work: Any = functools.partial(_work, *run, time.perf_counter())
        else:  # only the tiled passes on the device thread
            work = functools.partial(
                _execute, prepared, metrics, stop, batches, time.perf_counter(), RunDeadline.of(limits)
            )
        state.stops.add(stop)
        future = executor.submit_future(work, slot=slot)
        outcome = await _await_job(future, request)
        if prepared is not None and outcome is not None:
            outcome = await anyio.to_thread.run_sync(_finish, outcome, metrics)
        if prepared is not None and outcome is None:
            future.add_done_callback(lambda _: prepared.close())
        result = outcome
        if result is None:
            stop.set()  # a running job stops before its next batch
            logger.info("request %s: client disconnected; job %s", current_request_id(), _fate(future))
            if not future.done():  # still running: its thread removes the folder when it ends
                folder = workdir
                future.add_done_callback(lambda _: shutil.rmtree(folder, ignore_errors=True))
                workdir = None
            status = 499
            return Response(status_code=499)
        metrics.bytes_out.inc(result.size_bytes)
        response = _CleanupFileResponse(
            result.path,
            cleanup=workdir,
            media_type=result.media_type,
            filename=f"{Path(name).name}-output{result.path.name[len('output') :]}",
            headers=result_headers(label, result),
        )
        workdir, status = None, 200
        return response
    except ClientDisconnect:
        status = 499
        logger.info("request %s: client disconnected during upload", current_request_id())
        return Response(status_code=499)
    except Exception as exc:
        status = classify(exc).status
        raise
    finally:
        state.stops.discard(stop)
        if slot is not None:
            slot.release()  # a no-op once the job took the slot
        if workdir is not None:
            await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, workdir, ignore_errors=True))
        metrics.requests.labels(label, str(status)).inc()
        metrics.request_seconds.labels(label).observe(time.perf_counter() - started)


def _fate(future: concurrent.futures.Future[Any]) -> str:
    return "cancelled before it started" if future.cancelled() else "running: stops at its next batch"

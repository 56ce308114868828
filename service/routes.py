"""HTTP routes: health, readiness, metrics, the model list and synchronous inference."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from service.errors import NotReadyError
from service.executor import Slot
from service.http_errors import classify
from service.metrics import CONTENT_TYPE_LATEST
from service.params import BLENDS, FORMATS, OUTPUTS, parse_params
from service.pipeline import InferenceResult, run_file
from service.requestid import current_request_id
from service.security import require_api_key
from service.upload import receive_upload

__all__ = ["health_router", "v1_router"]

logger = logging.getLogger(__name__)

health_router = APIRouter(tags=["health"])
v1_router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_api_key)])


def _error(code: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"example": {"error": code, "detail": "...", "request_id": "..."}}},
    }


_INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The output file, on the input's grid (same size; NIfTI: same affine, qform/sform "
        "codes, zooms and units). `X-Tilewise-*` headers describe it.",
        "content": {
            t: {} for t in ("application/gzip", "image/png", "image/tiff", "application/octet-stream")
        },
    },
    400: _error("bad_parameter", "Invalid query parameter, or an empty body."),
    401: _error("unauthorized", "Missing or wrong API key (when the server has one)."),
    404: _error("unknown_model", "No model of this name (the detail lists close matches)."),
    413: _error("payload_too_large", "Upload over max_upload_bytes, or image over max_voxels / pixels."),
    415: _error("unsupported_media_type", "Not NIfTI-1/2, PNG, JPEG or TIFF (by content)."),
    422: _error("unusable_input", "Corrupt/truncated file, wrong dimensionality or channels, NaN-only."),
    503: _error("queue_full", "The device queue is full; retry after `Retry-After` seconds."),
}

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "The image or volume: the raw file (`curl --data-binary @scan.nii.gz`) or a "
        "multipart form with the field `file` (`curl -F file=@scan.nii.gz`). The format is detected "
        "by content: NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG, TIFF.",
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}},
                    "required": ["file"],
                }
            },
        },
    }
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


@health_router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@health_router.get("/readyz", responses={503: _error("not_ready", "Models not loaded (yet).")})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: models are loaded and warmed up, and the executor accepts work."""
    state = request.app.state
    if not getattr(state, "ready", False):
        return JSONResponse(
            {"error": "not_ready", "detail": "models are not loaded", "request_id": current_request_id()},
            status_code=503,
            headers={"Retry-After": str(state.settings.retry_after_s)},
        )
    return JSONResponse({"status": "ready", "models": state.repository.names(), "device": state.device})


@health_router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@v1_router.get("/models")
async def list_models(request: Request) -> list[dict[str, Any]]:
    """List the loaded models with their specs and defaults."""
    return [spec.info() for spec in request.app.state.repository.specs()]


@v1_router.get("/models/{name}", responses={404: _INFER_RESPONSES[404]})
async def get_model(name: str, request: Request) -> dict[str, Any]:
    """Describe one model."""
    info: dict[str, Any] = request.app.state.repository.spec(name).info()
    return info


async def _await_job(
    future: concurrent.futures.Future[InferenceResult], request: Request
) -> InferenceResult | None:
    """The job's result, or ``None`` when the client disconnects first (the job is cancelled
    if it has not started; a running job completes and its output is dropped)."""

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


def _job(name: str, source: Path, stem: Path, params: Any, state: Any, request_id: str) -> InferenceResult:
    """Executor-thread work for one request (load if needed, decode, run, encode), with metrics."""
    settings = state.settings
    model = state.repository.get(name)
    logger.info("request %s running model=%s on %s", request_id, name, state.device)
    result = run_file(
        model,
        source,
        stem,
        params,
        max_voxels=settings.max_voxels,
        max_image_pixels=settings.max_image_pixels,
    )
    state.metrics.inference_seconds.labels(model.spec.name, model.spec.backend).observe(result.seconds)
    if result.n_tiles is not None:
        state.metrics.tiles.labels(model.spec.name).inc(result.n_tiles)
    return result


@v1_router.post("/models/{name}/infer", responses=_INFER_RESPONSES, openapi_extra=_BODY_DOC)
async def infer(
    name: str,
    request: Request,
    tile: str | None = Query(
        None, description="Tile (network input) per axis, voxels: `128` or `128,128,64`."
    ),
    halo: str | None = Query(None, description="Discarded margin per side, voxels, per axis; or `auto`."),
    halo_tolerance: str | None = Query(None, description="Max truncation error accepted by `halo=auto`."),
    overlap: str | None = Query(None, description="Voxels shared by neighbouring tile cores (blended)."),
    blend: str | None = Query(None, description=f"Blend window: one of {', '.join(BLENDS)}."),
    batch_size: str | None = Query(None, description="Tiles per forward pass."),
    output: str | None = Query(None, description=f"Output kind: {' or '.join(OUTPUTS)}."),
    format: str | None = Query(  # noqa: A002 - the public parameter name
        None,
        description=f"Output format: one of {', '.join(FORMATS)}. Default: nii.gz for NIfTI input; "
        "png for labels and tiff (float32) for probabilities otherwise.",
    ),
) -> Response:
    """Run a model on an uploaded image or volume and return the output file."""
    del tile, halo, halo_tolerance, overlap, blend, batch_size, output, format  # read from the query
    state = request.app.state
    settings = state.settings
    started = time.perf_counter()
    label, status = "unknown", 500
    workdir: Path | None = None
    slot: Slot | None = None
    try:
        if not getattr(state, "ready", False):
            raise NotReadyError("models are not loaded (starting or shutting down)")
        label = state.repository.spec(name).name  # 404 before reading the body
        params = parse_params(dict(request.query_params))
        executor = state.executor
        # Hold a queue slot before reading the body: a full queue answers 503 with nothing read,
        # so concurrent uploads are bounded by the queue too, not only the jobs.
        slot = executor.reserve()
        workdir = Path(await anyio.to_thread.run_sync(_mkdtemp, settings.tmp_dir))
        source, n_bytes = await receive_upload(
            request, workdir / "input", max_bytes=settings.max_upload_bytes
        )
        state.metrics.bytes_in.inc(n_bytes)
        work = functools.partial(_job, label, source, workdir / "output", params, state, current_request_id())
        future = executor.submit_future(work, slot=slot)
        result = await _await_job(future, request)
        if result is None:
            logger.info("request %s: client disconnected; job %s", current_request_id(), _fate(future))
            if not future.done():  # still running: its thread removes the folder when it ends
                folder = workdir
                future.add_done_callback(lambda _: shutil.rmtree(folder, ignore_errors=True))
                workdir = None
            status = 499
            return Response(status_code=499)
        state.metrics.bytes_out.inc(result.size_bytes)
        response = _CleanupFileResponse(
            result.path,
            cleanup=workdir,
            media_type=result.media_type,
            filename=f"{Path(name).name}-output{result.path.name[len('output') :]}",
            headers={
                "X-Tilewise-Model": label,
                "X-Tilewise-Format": result.format,
                "X-Tilewise-Output": result.output_kind,
                "X-Tilewise-Shape": ",".join(str(n) for n in result.output_shape),
                "X-Tilewise-Dtype": result.output_dtype,
                "X-Tilewise-Seconds": f"{result.seconds:.3f}",
            },
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
        if slot is not None:
            slot.release()  # a no-op once the job took the slot
        if workdir is not None:
            await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, workdir, ignore_errors=True))
        state.metrics.requests.labels(label, str(status)).inc()
        state.metrics.request_seconds.labels(label).observe(time.perf_counter() - started)


def _mkdtemp(parent: Path | None) -> str:
    return tempfile.mkdtemp(prefix="tilewise-", dir=parent)


def _fate(future: concurrent.futures.Future[Any]) -> str:
    return "cancelled before it started" if future.cancelled() else "still running; output dropped"

"""The FastAPI application factory.

``create_app(settings)`` builds an app whose lifespan loads the model repository (built-in
models plus the specs in ``settings.models_dir``) and warms every model up, off the event loop,
before the server accepts requests; then starts the device executor. Run it with
``tilewise serve`` or ``uvicorn --factory service.app:create_app``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from starlette.responses import Response

from service.asgi import DrainMiddleware, HeadMiddleware, HeadSizeMiddleware
from service.clients import client_slots
from service.codecs import configure_pillow
from service.executor import DeviceExecutor
from service.guard import RequestGuardMiddleware
from service.http_errors import error_response, install_error_handlers, plain_error_response
from service.jobs import JobService, JobStore
from service.memory import fix_mmap_threshold, release_free_memory
from service.metrics import Metrics
from service.requestid import RequestIdMiddleware
from service.routes import health_router, v1_router
from service.routes.apidocs import install_docs
from service.routes.page import install_page
from service.security import KeyRing
from service.settings import Settings, get_settings, open_repository
from service.sharing import SharedBatches
from service.upload import UploadSlots
from service.workdir import WorkRoot

__all__ = ["create_app"]

_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})

logger = logging.getLogger(__name__)

_DESCRIPTION = """\
Seam-free tiled inference for large 2D images and 3D NIfTI volumes.

POST a file to `/v1/models/{name}/infer` (raw body or multipart field `file`); the response is the
output on the input's grid. Formats are detected by content: NIfTI-1/2 (`.nii`, `.nii.gz`), PNG,
JPEG, TIFF. Errors are JSON `{"error": code, "detail": text}`.
"""


def _device_name(settings: Settings) -> str:
    from models import resolve_device

    return str(resolve_device(settings.device))


def _load_repository(settings: Settings, built: Callable[[Any], object] | None = None) -> Any:
    """Build the model repository and warm it up (runs in a worker thread).

    A model that fails (spec, weights, warm-up check) is listed as unavailable with its reason;
    with ``TILEWISE_STRICT_MODELS=true`` the failure stops the start-up instead. ``built`` is
    given the repository before the warm-up (``/readyz`` then names the models still warming).
    Measurements stored by an earlier start are reused (:mod:`models.measure.measured`).
    """
    fix_mmap_threshold(settings.mmap_threshold_bytes)  # before the warm-up measures footprints
    repository = open_repository(settings)
    if built is not None:
        built(repository)
    names = repository.names()
    logger.info("loaded %d models on %s: %s", len(names), _device_name(settings), ", ".join(names))
    if settings.warmup:
        repository.warmup()
        logger.info("models warmed up")
    for name, why in sorted(repository.unavailable().items()):
        logger.error("model %s is unavailable: %s", name, why)
    release_free_memory()
    return repository


def _open_jobs(settings: Settings, executor: DeviceExecutor, app: FastAPI, metrics: Metrics) -> JobService:
    """The jobs of this process, in ``TILEWISE_JOBS_DIR`` (runs in a worker thread)."""
    root = settings.jobs_dir or Path(settings.tmp_dir or tempfile.gettempdir()) / "tilewise-jobs"
    store = JobStore(root)
    metrics.jobs_active.set_function(lambda: len(store.active()))
    return JobService(store, executor, lambda: app.state.repository, metrics, settings)


def create_app(settings: Settings | None = None, *, repository: Any = None) -> FastAPI:
    """Build the tilewise HTTP application.

    Args:
        settings: the configuration; ``get_settings()`` (the environment) when omitted.
        repository: an already loaded model repository (tests); built in the lifespan otherwise.
    """
    settings = settings or get_settings()
    keyring = KeyRing.from_settings(settings)  # a malformed key file stops here (ValueError)
    configure_pillow(settings.max_image_pixels)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ready = False
        app.state.draining = False
        app.state.workroot = await anyio.to_thread.run_sync(WorkRoot.open, settings.tmp_dir)
        repo = repository
        try:
            if repo is None:
                built = functools.partial(setattr, app.state, "warming")
                repo = await anyio.to_thread.run_sync(_load_repository, settings, built)
            device = await anyio.to_thread.run_sync(_device_name, settings)
        except BaseException:
            # a start that fails (TILEWISE_STRICT_MODELS, a bad device) leaves no folder and no open
            # lock file behind (the "ResourceWarning: unclosed file" of issue 25 item 17)
            await anyio.to_thread.run_sync(app.state.workroot.close)
            raise
        executor = DeviceExecutor(
            device,
            settings.queue_size,
            retry_after_s=settings.retry_after_s,
            on_depth=metrics.queue_depth.set,
            after_job=release_free_memory,
            workers=settings.shared_requests,
            client_slots=client_slots(settings),
        )
        batches = (
            SharedBatches(settings.batch_wait_ms / 1000, metrics) if settings.shared_requests > 1 else None
        )
        app.state.batches = batches
        app.state.repository = repo
        app.state.load_repository = functools.partial(_load_repository, settings)
        app.state.reload_lock = asyncio.Lock()
        app.state.executor = executor
        app.state.device = device
        jobs = await anyio.to_thread.run_sync(_open_jobs, settings, executor, app, metrics)
        jobs.batches = batches
        jobs.start()
        app.state.jobs = jobs
        app.state.ready = True
        logger.info(
            "tilewise ready: device=%s queue_size=%d max_upload_bytes=%d max_voxels=%d api_keys=%s",
            device,
            settings.queue_size,
            settings.max_upload_bytes,
            settings.max_voxels,
            ",".join(keyring.names()) or "off (anonymous: every client sees every job)",
        )
        try:
            yield
        finally:
            app.state.ready = False
            for stop in list(app.state.stops):  # a running job stops at its next batch
                stop.set()
            jobs.stop_all()  # a running job stops too; another replica takes it over
            executor.shutdown(wait=False)  # queued jobs are cancelled
            await anyio.to_thread.run_sync(executor.join, 30.0)
            await anyio.to_thread.run_sync(jobs.close)  # leases of jobs still held are released
            if batches is not None:
                await anyio.to_thread.run_sync(batches.close)
            await anyio.to_thread.run_sync(app.state.workroot.close)
            logger.info("tilewise stopped")

    app = FastAPI(
        title="tilewise",
        summary="Tiled inference for images and volumes too large for one forward pass.",
        description=_DESCRIPTION,
        version=_version(),
        lifespan=lifespan,
        docs_url=None,  # served from the installed package below, not from a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = metrics
    app.state.ready = False
    app.state.draining = False
    app.state.stops = set()  # threading.Event of each running request: set to stop its run
    app.state.uploads = UploadSlots(
        settings.max_uploads, retry_after_s=settings.retry_after_s, per_client=settings.max_uploads_per_client
    )
    install_error_handlers(app, retry_after_s=settings.retry_after_s)
    app.add_exception_handler(405, _method_not_allowed)
    if settings.cors_origins:  # CORS is off unless configured
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
            expose_headers=[
                "Location",
                "X-Request-ID",
                "X-Tilewise-Plan",
                "X-Tilewise-Seam",
                "X-Tilewise-Warning",
            ],  # fmt: skip
        )
    app.add_middleware(
        RequestGuardMiddleware,
        allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins,
        respond=plain_error_response,
    )
    app.add_middleware(HeadSizeMiddleware, max_bytes=settings.max_header_bytes, respond=plain_error_response)
    app.add_middleware(
        RequestIdMiddleware,
        on_error=lambda exc: error_response(exc, retry_after_s=settings.retry_after_s),
    )
    app.add_middleware(DrainMiddleware, state=app.state)
    app.add_middleware(HeadMiddleware)  # outermost: HEAD is GET from here in
    app.include_router(health_router)
    app.include_router(v1_router)
    install_docs(app)
    install_page(app)
    return app


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    """405 with ``Allow`` listing the methods the OpenAPI document gives the path (Starlette names
    only the first route's: ``GET`` for ``/v1/jobs/{id}``, which also has ``DELETE``)."""
    methods: set[str] = set()
    path = request.url.path
    paths = request.app.openapi().get("paths", {})
    if path in paths:  # a literal path wins over templates (/v1/models/reload, not /v1/models/{name})
        methods = {m.upper() for m in paths[path] if m in _HTTP_METHODS}
    for template, operations in paths.items() if not methods else ():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), path):
            methods |= {m.upper() for m in operations if m in _HTTP_METHODS}
    response = error_response(exc)
    if methods:
        response.headers["Allow"] = ", ".join(sorted(methods))
    return response


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tilewise")
    except metadata.PackageNotFoundError:
        return "0+unknown"

"""``tilewise serve``: the HTTP service on uvicorn.

Every setting is an option here and a ``TILEWISE_*`` environment variable (see
:mod:`service.settings`); an option wins over its variable. Give the API key through
``TILEWISE_API_KEY`` rather than ``--api-key``: a command line is visible to every user of the
machine (``ps``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service._options import argparse_bytes, argparse_number

logger = logging.getLogger(__name__)

_count = argparse_number(int, 0)
_positive = argparse_number(int, 1)
_seconds = argparse_number(float, 0.0)
_work = argparse_number(float, 0.0, strict=True)

#: ``(option, Settings field, argparse type, help)``; the variable is ``TILEWISE_<FIELD>``.
_SETTINGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--models", "models_dir", Path, "model folder (default: ~/.cache/tilewise/models)"),
    ("--device", "device", str, "cpu, cuda, cuda:N or mps (default: CUDA when available)"),
    ("--queue-size", "queue_size", _count, "requests allowed to wait for the device (default: 8)"),
    ("--max-upload-bytes", "max_upload_bytes", _positive, "largest upload, bytes (default: 2 GiB)"),
    ("--max-voxels", "max_voxels", _positive, "largest image, voxels (default: 2**30)"),
    ("--max-image-pixels", "max_image_pixels", _positive, "decompression-bomb limit of 2D images"),
    ("--api-key", "api_key", str, "key required on /v1 (Bearer); better the variable: ps shows argv"),
    ("--retry-after", "retry_after_s", _count, "Retry-After seconds sent with 503 (default: 2)"),
    ("--tmp-dir", "tmp_dir", Path, "folder of temporary upload/result files (default: the system's)"),
    ("--graceful-shutdown", "graceful_shutdown_s", _count, "on SIGTERM, seconds to finish requests (120)"),
    ("--drain", "drain_s", _seconds, "on SIGTERM, seconds /readyz fails before the listener closes (5)"),
    ("--max-batch-size", "max_batch_size", _positive, "largest batch_size of a request (256)"),
    ("--max-tiles", "max_tiles", _positive, "most tiles one request may run (65536)"),
    ("--max-work", "max_work", _work, "most voxels through the network per input voxel (64)"),
    ("--max-request-bytes", "max_request_bytes", _positive, "most memory one request's plan may predict"),
    ("--max-decoded-bytes", "max_decoded_bytes", _positive, "bytes an input may inflate to"),
    ("--memory-budget", "memory_budget", argparse_bytes, "memory a plan should fit (300MB, 2GiB)"),
    ("--mmap-threshold", "mmap_threshold_bytes", _count, "glibc mmap threshold, bytes (131072; 0: glibc's)"),
    ("--max-uploads", "max_uploads", _positive, "uploads in progress at once (16)"),
    ("--upload-min-rate", "upload_min_rate", _count, "bytes/s an upload must average (16384)"),
    ("--upload-grace", "upload_grace_s", _seconds, "seconds before the minimum rate applies (10)"),
    ("--upload-idle", "upload_idle_s", _work, "seconds an upload may send nothing (30)"),
    ("--max-header-bytes", "max_header_bytes", _positive, "request line plus headers, bytes (32768)"),
    ("--jobs-dir", "jobs_dir", Path, "folder of the jobs, shared by replicas (default: under the tmp dir)"),
    ("--job-ttl", "job_ttl_s", _work, "seconds a finished job and its result are kept (86400)"),
    ("--job-lease", "job_lease_s", _work, "seconds a job's lease outlives its owner's last renewal (30)"),
    ("--job-scan", "job_scan_s", _work, "seconds between two looks for jobs to take over (1)"),
    ("--web-dir", "web_dir", Path, "folder of the page's viewer files (default: ~/.cache/tilewise/web)"),
    ("--dask-scheduler", "dask_scheduler", str, "Dask scheduler (tcp://host:8786) for large jobs (unset)"),
    ("--dask-min-voxels", "dask_min_voxels", _count, "jobs above this many voxels go to Dask (64000000)"),
    ("--dask-workdir", "dask_workdir", Path, "folder Dask workers share for zarr copies (the job's)"),
    ("--dicomweb-url", "dicomweb_url", str, "DICOMweb root that jobs by study/series UID use (unset)"),
    ("--dicomweb-username", "dicomweb_username", str, "DICOMweb user (basic authentication)"),
    ("--dicomweb-password", "dicomweb_password", str, "DICOMweb password (prefer the environment variable)"),
)


def register(sub: Any) -> None:
    """Add the ``serve`` sub-command."""
    parser = sub.add_parser(
        "serve",
        help="start the HTTP service (models load and warm up first)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    for option, field, kind, text in _SETTINGS:
        env = f"TILEWISE_{field.upper()}"
        parser.add_argument(
            option, dest=field, type=kind, default=None, metavar=env[9:], help=f"{text}; {env}"
        )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_const",
        const=False,
        default=None,
        help="skip the warm-up run of each model at start-up; TILEWISE_WARMUP=false",
    )
    parser.add_argument(
        "--strict-models",
        dest="strict_models",
        action="store_const",
        const=True,
        default=None,
        help="any model that fails to load stops the server (default: it is listed as unavailable); "
        "TILEWISE_STRICT_MODELS=true",
    )
    parser.set_defaults(run=_run)


def settings_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~service.settings.Settings` of ``args``: options over ``TILEWISE_*`` variables."""
    from service.settings import Settings

    fields = [field for _, field, _, _ in _SETTINGS] + ["warmup", "strict_models"]
    given = {field: getattr(args, field) for field in fields if getattr(args, field) is not None}
    return Settings(**given)


def _run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from service.app import create_app
    from service.server import DrainingServer, JsonH11Protocol

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for err in exc.errors():
            logger.error("%s: %s", ".".join(str(p) for p in err["loc"]), err["msg"])
        return 2
    logger.info("starting tilewise on http://%s:%d", args.host, args.port)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # service.log configured the root logger already
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        http=JsonH11Protocol,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    DrainingServer(config, app.state, settings.drain_s).run()
    return 0

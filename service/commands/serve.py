"""``tilewise serve``: the HTTP service on uvicorn.

Every setting is an option here and a ``TILEWISE_*`` environment variable (see
:mod:`service.settings`); an option wins over its variable. Give the API key through
``TILEWISE_API_KEY`` rather than ``--api-key``: a command line is visible to every user of the
machine (``ps``).

Safe defaults: without a key (``TILEWISE_API_KEY`` or ``TILEWISE_API_KEYS``) the server refuses to
start on an address other than loopback unless ``TILEWISE_ALLOW_ANONYMOUS=true`` (anyone who
reaches the port would read, download and cancel every job); bound to loopback, it answers only
requests whose ``Host`` is a loopback name unless ``TILEWISE_ALLOWED_HOSTS`` says otherwise (a web
page cannot reach it by DNS rebinding).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.options import argparse_bytes, argparse_number

logger = logging.getLogger(__name__)

_count = argparse_number(int, 0)
_positive = argparse_number(int, 1)
_seconds = argparse_number(float, 0.0)
_work = argparse_number(float, 0.0, strict=True)

#: ``(option, Settings field, argparse type, help)``; the variable is ``TILEWISE_<FIELD>``.
_SETTINGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--models", "models_dir", Path, "model folder (default: ~/.cache/tilewise/models)"),
    ("--user-models", "user_models_dir", Path, "setup-models' folder, served too (~/.cache/tilewise/models)"),
    ("--measurements-dir", "measurements_dir", Path, "warm-up measurements (~/.cache/tilewise/measurements)"),
    ("--device", "device", str, "cpu, cuda, cuda:N or mps (default: CUDA when available)"),
    ("--queue-size", "queue_size", _count, "requests allowed to wait for the device (default: 8)"),
    ("--shared-requests", "shared_requests", _positive, "requests run at once, sharing batches (1: off)"),
    ("--batch-wait-ms", "batch_wait_ms", _seconds, "wait for a shared forward batch to fill, ms (5)"),
    ("--max-upload-bytes", "max_upload_bytes", _positive, "largest upload, bytes (default: 2 GiB)"),
    ("--max-voxels", "max_voxels", _positive, "largest image, voxels (default: 2**30)"),
    ("--max-image-pixels", "max_image_pixels", _positive, "2D image bomb limit, pixels (89478485)"),
    ("--api-key", "api_key", str, "key required on /v1 (Bearer); prefer the variable: ps shows argv (none)"),
    ("--api-keys", "api_keys", Path, "file of named keys, name:key or name:sha256:HEX a line (none)"),
    ("--allowed-hosts", "allowed_hosts", str, "Hosts answered, comma-separated (loopback names on loopback)"),
    ("--cors-origins", "cors_origins", str, "origins whose pages may call the API (none)"),
    ("--jobs-max-bytes", "jobs_max_bytes", argparse_bytes, "bytes finished jobs may keep (no cap)"),
    ("--retry-after", "retry_after_s", _count, "Retry-After seconds sent with 503 (default: 2)"),
    ("--tmp-dir", "tmp_dir", Path, "folder of temporary upload/result files (default: the system's)"),
    ("--graceful-shutdown", "graceful_shutdown_s", _count, "on SIGTERM, seconds to finish requests (120)"),
    ("--drain", "drain_s", _seconds, "on SIGTERM, seconds /readyz fails before the listener closes (5)"),
    ("--max-batch-size", "max_batch_size", _positive, "largest batch_size of a request (256)"),
    ("--max-tiles", "max_tiles", _positive, "most tiles one request may run (65536)"),
    ("--max-work", "max_work", _work, "most voxels through the network per input voxel (64)"),
    ("--max-request-bytes", "max_request_bytes", _positive, "most memory a request may use (half the RAM)"),
    ("--max-decoded-bytes", "max_decoded_bytes", _positive, "bytes an input may inflate to (4 GiB)"),
    ("--max-compression-ratio", "max_compression_ratio", _work, "inflated / file bytes, past 64 MiB (200)"),
    (
        "--max-request-seconds",
        "max_request_seconds",
        _seconds,
        "predicted seconds of a plan (3600; 0: any)",
    ),
    ("--min-voxels-per-tile", "min_voxels_per_tile", _positive, "input voxels per tile, at least (64)"),
    ("--max-client-share", "max_client_share", _work, "share of queue slots one client may hold (0.5)"),
    ("--memory-budget", "memory_budget", argparse_bytes, "memory a plan should fit: 300MB, 2GiB (unset)"),
    ("--mmap-threshold", "mmap_threshold_bytes", _count, "glibc mmap threshold, bytes (131072; 0: glibc's)"),
    ("--max-uploads", "max_uploads", _positive, "uploads in progress at once (16)"),
    ("--max-uploads-per-client", "max_uploads_per_client", _positive, "uploads in progress per client (4)"),
    ("--upload-min-rate", "upload_min_rate", _count, "bytes/s an upload must average (16384)"),
    ("--upload-grace", "upload_grace_s", _seconds, "seconds before the minimum rate applies (10)"),
    ("--upload-idle", "upload_idle_s", _work, "seconds an upload may send nothing (30)"),
    ("--max-header-bytes", "max_header_bytes", _positive, "request line plus headers, bytes (32768)"),
    ("--header-timeout", "header_timeout_s", _work, "seconds a request's line and headers may take (10)"),
    ("--max-connections", "max_connections", _positive, "open connections; requests beyond get 503 (256)"),
    ("--jobs-dir", "jobs_dir", Path, "folder of the jobs, shared by replicas (default: under the tmp dir)"),
    ("--job-ttl", "job_ttl_s", _work, "seconds a finished job and its result are kept (86400)"),
    ("--job-lease", "job_lease_s", _work, "seconds a job's lease outlives its owner's last renewal (30)"),
    ("--job-scan", "job_scan_s", _work, "seconds between two looks for jobs to take over (1)"),
    ("--web-dir", "web_dir", Path, "folder of the page's viewer files (default: ~/.cache/tilewise/web)"),
    ("--dask-scheduler", "dask_scheduler", str, "Dask scheduler (tcp://host:8786) for large jobs (unset)"),
    ("--dask-min-voxels", "dask_min_voxels", _count, "jobs above this many voxels go to Dask (64000000)"),
    ("--dask-workdir", "dask_workdir", Path, "folder Dask workers share for zarr copies (the job's)"),
    ("--dicomweb-url", "dicomweb_url", str, "DICOMweb root that jobs by study/series UID use (unset)"),
    ("--dicomweb-username", "dicomweb_username", str, "DICOMweb user, for basic authentication (none)"),
    ("--dicomweb-password", "dicomweb_password", str, "DICOMweb password; prefer the variable (none)"),
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
        text = with_default(text)
        parser.add_argument(
            option, dest=field, type=kind, default=None, metavar=env[9:], help=f"{text}; {env}"
        )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_const",
        const=False,
        default=None,
        help="skip the warm-up run of each model at start-up (default: warm up, reusing the "
        "measurements an earlier start stored); TILEWISE_WARMUP=false",
    )
    parser.add_argument(
        "--allow-anonymous",
        dest="allow_anonymous",
        action="store_const",
        const=True,
        default=None,
        help="serve without an API key on an address other than loopback (anyone who reaches it sees "
        "every job); TILEWISE_ALLOW_ANONYMOUS=true (default: off)",
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


def with_default(text: str) -> str:
    """``"... (120)"`` -> ``"... (default: 120)"``: every option states its default.

    >>> with_default("seconds to finish requests (120)")
    'seconds to finish requests (default: 120)'
    >>> with_default("model folder (default: ~/.cache/tilewise/models)")
    'model folder (default: ~/.cache/tilewise/models)'
    """
    if "(default" in text:
        return text
    return re.sub(r"\(([^()]*)\)$", r"(default: \1)", text)


def settings_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~service.settings.Settings` of ``args``: options over ``TILEWISE_*`` variables."""
    from service.settings import Settings

    fields = [field for _, field, _, _ in _SETTINGS] + ["warmup", "strict_models", "allow_anonymous"]
    given = {field: getattr(args, field) for field in fields if getattr(args, field) is not None}
    return Settings(**given)


def _run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for err in exc.errors():
            logger.error("%s: %s", ".".join(str(p) for p in err["loc"]), err["msg"])
        return 2
    settings = exposure_check(settings, args.host)
    if settings is None:
        return 2
    busy = port_in_use(args.host, args.port)
    if busy is not None:  # said now, not after every model has loaded and warmed up
        logger.error(
            "cannot listen on http://%s:%d: %s; stop it, or pick another --port or --host",
            args.host, args.port, busy,
        )  # fmt: skip
        return 2
    import uvicorn

    from service.app import create_app
    from service.server import DrainingServer, protocol_with

    logger.info("starting tilewise on http://%s:%d", args.host, args.port)
    try:
        app = create_app(settings)
    except ValueError as exc:  # a malformed TILEWISE_API_KEYS file (named by line, never the key)
        logger.error("%s", exc)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # service.log configured the root logger already
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        http=protocol_with(settings.header_timeout_s),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        limit_concurrency=settings.max_connections,
    )
    server = DrainingServer(config, app.state, settings.drain_s)
    server.run()
    return 0 if server.started else 1  # uvicorn logs why it did not start (the port taken since)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or ``None``.

    Binds a socket as uvicorn will (``SO_REUSEADDR``) and closes it at once: ``"address already in
    use (another tilewise serve?)"``, or the system's reason (``"[Errno 99] Cannot assign requested
    address"``).
    """
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "address already in use (another tilewise serve?)"
            return str(exc)
    return None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def exposure_check(settings: Any, host: str) -> Any:
    """``settings`` fit to serve on ``host``, or ``None`` (said in the log) when they are unsafe.

    - no API key on an address other than loopback: refused unless ``allow_anonymous`` (then a
      warning says so);
    - on loopback, ``allowed_hosts`` unset: only loopback ``Host`` names are answered.
    """
    from service.guard import LOOPBACK_HOSTS
    from service.security import KeyRing

    try:
        keyed = KeyRing.from_settings(settings).enabled
    except ValueError as exc:
        logger.error("%s", exc)
        return None
    loopback = is_loopback(host)
    if not keyed and not loopback:
        if not settings.allow_anonymous:
            logger.error(
                "refusing to serve on %s without an API key: anyone who reaches it could read, download "
                "and cancel every job and run every model. Set TILEWISE_API_KEY (or TILEWISE_API_KEYS), "
                "bind 127.0.0.1, or set TILEWISE_ALLOW_ANONYMOUS=true to accept that",
                host,
            )
            return None
        logger.warning(
            "serving on %s WITHOUT an API key (TILEWISE_ALLOW_ANONYMOUS=true): every client that reaches "
            "this address sees, downloads and cancels every job",
            host,
        )
    if loopback and settings.allowed_hosts is None:
        settings = settings.model_copy(update={"allowed_hosts": LOOPBACK_HOSTS})
    return settings

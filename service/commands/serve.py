"""``tilewise serve``: the HTTP service on uvicorn.

Options override the ``TILEWISE_*`` environment variables (see :mod:`service.settings`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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
    parser.add_argument("--models", type=Path, default=None, help="model folder (TILEWISE_MODELS_DIR)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (TILEWISE_DEVICE; default: auto)")
    parser.add_argument(
        "--queue-size", type=int, default=None, help="requests waiting per device (TILEWISE_QUEUE_SIZE)"
    )
    parser.add_argument(
        "--max-upload-bytes", type=int, default=None, help="largest upload (TILEWISE_MAX_UPLOAD_BYTES)"
    )
    parser.add_argument("--max-voxels", type=int, default=None, help="largest image (TILEWISE_MAX_VOXELS)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    overrides = {
        "models_dir": args.models,
        "device": args.device,
        "queue_size": args.queue_size,
        "max_upload_bytes": args.max_upload_bytes,
        "max_voxels": args.max_voxels,
    }
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    logger.info("starting tilewise on http://%s:%d", args.host, args.port)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_config=None,  # service.log configured the root logger already
        timeout_graceful_shutdown=30,
    )
    return 0

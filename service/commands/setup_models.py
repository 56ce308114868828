"""``tilewise setup-models``: put the ``text-det-2d`` ONNX file and its spec in the model folder."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``setup-models`` parser."""
    parser = subparsers.add_parser(
        "setup-models",
        help="extract the text-det-2d ONNX model from its wheel into the model folder",
        description=(
            "Extract only rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx from the "
            "rapidocr-onnxruntime==1.4.4 wheel (pip download --no-deps unless --wheel is given), "
            "verify its SHA-256 and write text-det-2d.yaml next to it."
        ),
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=None,
        help="model folder (default: $TILEWISE_MODELS_DIR, else ~/.cache/tilewise/models)",
    )
    parser.add_argument("--wheel", type=Path, default=None, help="a local rapidocr_onnxruntime-1.4.4 wheel")
    parser.add_argument("--force", action="store_true", help="extract again even if a verified file exists")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.textdet import setup_text_det

    models_dir = args.models or Path(os.environ.get("TILEWISE_MODELS_DIR") or DEFAULT_MODELS_DIR)
    try:
        spec_path = setup_text_det(models_dir.expanduser(), wheel=args.wheel, force=args.force)
    except ModelError as exc:
        logger.error("setup-models failed: %s", exc)
        return 1
    sys.stdout.write(f"text-det-2d ready: {spec_path}\n")
    return 0

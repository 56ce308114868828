"""``tilewise import-model SOURCE``: a TorchScript/ONNX file, MONAI bundle or nnU-Net folder to a spec.

Writes ``DIR/NAME.yaml`` and the weights beside it (``DIR``: ``--models``, else
``$TILEWISE_MODELS_DIR``, else ``~/.cache/tilewise/models``), prints the spec and exits 0; exits 2
with one line on stderr naming what it cannot map (``--verbose`` adds the traceback). MONAI bundles
and nnU-Net folders need the ``import`` extra (``pip install -e '.[import]'`` in a checkout);
serving the imported model does not.

Importing a MONAI bundle runs it: MONAI evaluates the bundle's ``$`` expressions (Python) and
instantiates its ``_target_`` classes; an nnU-Net plan names the class that is built. A source
whose configs hold code other than MONAI's or nnU-Net's own is refused (the fields are named)
unless ``--trust`` is given: read the bundle first. The models folder is code too: a spec may
name any ``package.module:callable`` as its architecture, and the server runs it.

``--example-bundle DIR`` writes a small MONAI bundle (random weights) to follow the README with.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_EXAMPLE_NETWORKS = ("UNet", "BasicUNet", "SegResNet", "UNETR", "SwinUNETR")  # example_bundle's


def _atol(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


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
        nargs="?",
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
    parser.add_argument(
        "--atol",
        type=_atol,
        default=1e-4,
        help="largest max-abs difference accepted between the exported file and eager PyTorch "
        "(default: 1e-4)",
    )
    parser.add_argument(
        "--activation",
        choices=("softmax", "sigmoid", "none"),
        default=None,
        help="output activation of a TorchScript/ONNX file (default: probed: none when its outputs are "
        "already in [0, 1], else softmax for several channels, sigmoid for one; the spec says which)",
    )
    parser.add_argument(
        "--trust",
        action="store_true",
        help="run the source's own code: a bundle's $ expressions and non-MONAI _target_s, a plan's "
        "non-nnU-Net classes (default: off, such a source is refused with the fields named)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="on a refusal, also print the traceback (default: one line)"
    )
    parser.add_argument(
        "--example-bundle",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a small example MONAI bundle (random weights) to DIR and exit; import it next",
    )
    parser.add_argument(
        "--example-network",
        choices=_EXAMPLE_NETWORKS,
        default="UNet",
        help="the monai.networks.nets class in the example bundle (default: UNet; UNETR and SwinUNETR "
        "import at one tile, their roi_size: see the README's table)",
    )
    parser.set_defaults(run=_run)


def _refuse(args: argparse.Namespace, what: str, exc: BaseException) -> int:
    reason = " ".join(str(exc).split())  # one line, whatever the message held
    sys.stderr.write(f"tilewise import-model: {what}: {reason}\n")
    if args.verbose:
        traceback.print_exception(exc, file=sys.stderr)
    return 2


def _example(args: argparse.Namespace) -> int:
    from models import ModelError
    from models.importers.example_bundle import write_example_bundle

    folder: Path = args.example_bundle
    roi = {"SwinUNETR": (64, 64, 64), "UNet": (48, 48, 48)}.get(args.example_network, (32, 32, 32))
    try:
        write_example_bundle(folder, network=args.example_network, roi=roi)
    except ModelError as exc:
        return _refuse(args, f"cannot write an example bundle to {folder}", exc)
    except OSError as exc:
        return _refuse(args, f"cannot write an example bundle to {folder}", exc)
    sys.stdout.write(
        f"wrote a MONAI bundle with monai.networks.nets.{args.example_network} (random weights) to {folder}\n"
        f"next: tilewise import-model {folder} --name NAME --models DIR\n"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.example_bundle is not None:
        if args.source is not None:
            sys.stderr.write("tilewise import-model: give SOURCE or --example-bundle DIR, not both\n")
            return 2
        return _example(args)
    if args.source is None:
        sys.stderr.write("tilewise import-model: SOURCE is missing (or --example-bundle DIR)\n")
        return 2
    from models import DEFAULT_MODELS_DIR, ModelError
    from models.importers import import_model

    folder = args.models or os.environ.get("TILEWISE_MODELS_DIR") or DEFAULT_MODELS_DIR
    try:
        folder = Path(folder).expanduser()
        written = import_model(
            args.source,
            models_dir=folder,
            name=args.name,
            fmt=args.fmt,
            trust=args.trust,
            atol=args.atol,
            activation=args.activation,
        )
    except ModelError as exc:
        return _refuse(args, f"cannot import {args.source}", exc)
    logger.info("wrote %s", written.spec_path)
    sys.stdout.write(written.text)
    return 0

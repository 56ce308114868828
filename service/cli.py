"""The ``tilewise`` command: one sub-command per module in :mod:`service.commands`.

Each command module defines ``register(subparsers)`` using argparse only, and imports its heavy
dependencies (torch, FastAPI, ...) inside the function that runs it, so ``tilewise batch --help``
never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from service._distributions import check_onnxruntime_distributions
from service.options import HelpFormatter, plain_text

logger = logging.getLogger(__name__)

#: Sub-command modules, in the order ``tilewise --help`` lists them.
COMMANDS = (
    "serve",
    "infer",
    "plan",
    "batch",
    "demo",
    "setup_models",
    "setup_web",
    "export_onnx",
    "import_model",
    "train_tissue",
)


#: ``--log-level``: a name of :mod:`logging`'s levels, any case (``quiet`` was a traceback).
_LOG_LEVEL: dict[str, Any] = {
    "type": str.upper,
    "choices": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "metavar": "LEVEL",
    "help": "logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default: INFO)",
}


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="tilewise",
        description="Seam-free tiled inference for large 2D images and 3D NIfTI volumes.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tilewise {version()}")
    parser.add_argument("--log-level", default="INFO", **_LOG_LEVEL)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"service.commands.{name}")
        module.register(sub)
    for command in sub.choices.values():  # also after the command: `tilewise plan ... --log-level WARNING`
        command.add_argument("--log-level", default=argparse.SUPPRESS, **_LOG_LEVEL)
    # One style for every command's --help: plain text (docstrings lose their reST markup) and
    # the default of every option that has one.
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
        command.description = plain_text(command.description)
        for action in command._actions:
            action.help = plain_text(action.help)
    return parser


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare source tree)."""
    from importlib import metadata

    try:
        return metadata.version("tilewise")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tilewise`` console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from service.log import configure_logging

    configure_logging(args.log_level)
    check_onnxruntime_distributions()
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

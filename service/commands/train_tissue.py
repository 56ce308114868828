"""``tilewise train-tissue``: re-train the built-in ``tissue-3d`` model (``models.zoo.train_tissue``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: Options forwarded to ``models.zoo.train_tissue`` when given (their defaults live there only).
_FORWARDED = ("out", "seed", "steps", "threads")


def register(subparsers: Any) -> None:
    """Add the ``train-tissue`` parser (argparse only: torch is imported when it runs)."""
    parser = subparsers.add_parser(
        "train-tissue",
        help="re-train the tissue-3d demonstration model on the MNI152 template (CPU)",
        description=(
            "Train tissue-3d from scratch on nilearn's MNI152 T1 and its grey/white-matter maps, "
            "deterministically from its seed, and write tissue-3d.safetensors, tissue-3d.sha256 and "
            "tissue-3d.metrics.json (Dice on the held-out axial band). Defaults: those of "
            "`python -m models.zoo.train_tissue --help` (seed 0, 2 threads, the built-in model folder)."
        ),
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--seed", type=int, default=None, help="random seed")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--update-spec", action="store_true", help="rewrite the sha256 line of the built-in tissue-3d.yaml"
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from models.zoo.train_tissue import main

    argv = []
    for name in _FORWARDED:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name}", str(value)]
    if args.update_spec:
        argv.append("--update-spec")
    return main(argv)

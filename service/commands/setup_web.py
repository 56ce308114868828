"""``tilewise setup-web``: put the page's volume viewer (NiiVue, from npm) into the web folder."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_web_options(parser: argparse.ArgumentParser) -> None:
    """The options of the NiiVue step (``setup-web``, and ``setup-models`` which runs it too)."""
    parser.add_argument(
        "--web",
        type=Path,
        default=None,
        help="web folder of the page's viewer (default: $TILEWISE_WEB_DIR, else ~/.cache/tilewise/web)",
    )
    parser.add_argument(
        "--niivue-tarball", type=Path, default=None, help="a local niivue-0.69.0.tgz (as npm pack writes it)"
    )
    parser.add_argument(
        "--openseadragon-tarball",
        type=Path,
        default=None,
        help="a local openseadragon-6.1.1.tgz (as npm pack writes it)",
    )


def register(subparsers: Any) -> None:
    """Add the ``setup-web`` parser."""
    parser = subparsers.add_parser(
        "setup-web",
        help="take the page's viewers (NiiVue, OpenSeadragon) from npm into the web folder",
        description=(
            "Run npm pack @niivue/niivue@0.69.0 in a temporary folder (or download the registry's "
            "tarball when npm is missing, or read --niivue-tarball), verify its SHA-256, and write "
            "only package/dist/niivue.umd.js, verified too, to the web folder that `tilewise serve` "
            "serves the page's viewer from; the same for OpenSeadragon 6.1.1 (slides, its "
            "build/openseadragon/openseadragon.min.js). `tilewise setup-models` runs this step as well."
        ),
    )
    add_web_options(parser)
    parser.add_argument("--force", action="store_true", help="take it again even if a verified file exists")
    parser.set_defaults(run=_run)


def setup_web(args: argparse.Namespace) -> int:
    """The NiiVue step of ``args``: 0 when the bundle is in place, 1 otherwise (error logged)."""
    from service.webassets import WebAssetError, setup_niivue, setup_openseadragon, web_dir_of

    force = getattr(args, "force", False)
    try:
        path = setup_niivue(web_dir_of(args.web), tarball=args.niivue_tarball, force=force)
        slides = setup_openseadragon(
            web_dir_of(args.web), tarball=getattr(args, "openseadragon_tarball", None), force=force
        )
    except WebAssetError as exc:
        logger.error("setup-web failed: %s", exc)
        return 1
    sys.stdout.write(f"niivue ready: {path}\nopenseadragon ready: {slides}\n")
    return 0


def _run(args: argparse.Namespace) -> int:
    return setup_web(args)

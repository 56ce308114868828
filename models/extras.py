"""The pip command that installs one of tilewise's extras, the way tilewise itself was installed.

From PyPI: ``pip install 'tilewise[import]'``. From a checkout (``pip install -e .``, or ``pip
install .``), that command would fetch another tilewise from PyPI: the hint names the checkout
instead (``python -m pip install -e '/home/me/tilewise[import]'``), read from the distribution's
``direct_url.json`` (PEP 610).
"""

from __future__ import annotations

import json
import urllib.parse
from importlib import metadata

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (e.g. ``import``, ``distributed``) for this install."""
    try:
        text = metadata.distribution("tilewise").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        text = None
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = {}
    url = data.get("url", "") if isinstance(data, dict) else ""
    if url.startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
        editable = bool(data.get("dir_info", {}).get("editable"))
        return f"python -m pip install {'-e ' if editable else ''}'{path}[{extra}]'"
    return f"pip install 'tilewise[{extra}]'"

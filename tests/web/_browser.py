"""Debian's chromium driven by Playwright, and what every page test records and checks.

pip's Playwright cannot download its browsers here; it drives the system chromium
(``executable_path``). WebGL 2 comes from SwiftShader (software), which NiiVue needs.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

CHROMIUM = os.environ.get("WEB_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # WebGL 2 without a GPU: ANGLE on SwiftShader, asked for explicitly (Chromium deprecates the
    # silent fallback to it).
    "--use-angle=swiftshader",
    "--enable-unsafe-swiftshader",
]
#: The screenshots and measurements of a run (CI keeps the folder as an artifact).
ARTIFACTS = Path(
    os.environ.get("WEB_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts" / "web")
)
#: The key of the server that needs one (``key_server``).
API_KEY = "page-test-key"
#: How long a page may wait for a job (the runner's two shared cores are slow).
JOB_TIMEOUT_MS = 420_000


def chromium_or_skip() -> str:
    """The chromium executable; skip locally, fail in CI, when there is none."""
    if shutil.which(CHROMIUM) is None:
        reason = f"no chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return CHROMIUM


@dataclass
class Recorder:
    """Every request a page makes, and its console errors and uncaught exceptions."""

    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def foreign(self) -> list[str]:
        """Requests that leave 127.0.0.1 (``blob:``/``data:`` stay in the page)."""
        out = []
        for url in self.requests:
            parts = urlsplit(url)
            if parts.scheme in ("blob", "data"):
                continue
            if parts.scheme not in ("http", "https") or parts.hostname != "127.0.0.1":
                out.append(url)
        return out

    def check(self, allowed_errors: tuple[str, ...] = ()) -> None:
        """No request left 127.0.0.1 and no console error but the ``allowed_errors`` substrings."""
        assert self.requests, "no request recorded"
        assert self.foreign() == []
        unexpected = [e for e in self.errors if not any(a in e for a in allowed_errors)]
        assert unexpected == []


def wait_for_end(page: Any, timeout_ms: int = JOB_TIMEOUT_MS) -> str:
    """Wait until the run is over (Run enabled again); the status line."""
    page.wait_for_function(
        "() => /^(done|failed|cancelled|not submitted)/.test(document.getElementById('status').textContent)"
        " && document.getElementById('cancel').disabled",
        timeout=timeout_ms,
    )
    return str(page.text_content("#status"))


def screenshot_array(locator: Any, path: Path) -> np.ndarray:
    """Save a screenshot of ``locator`` to ``path`` and return it as ``(H, W, 3)`` uint8."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    locator.screenshot(path=str(path))
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))

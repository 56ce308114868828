"""An error is seen where it happens: at 1280x800 with the tiling options open, the server's refusal
is scrolled into view (issue 25 item 14); a 2D input is shown as soon as it is chosen."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_IN_VIEW = """() => { const b = document.getElementById('error').getBoundingClientRect();
  return b.height > 0 && b.top >= 0 && b.bottom <= window.innerHeight; }"""


def test_error_in_view_with_options_open(server, new_page, recorder, tmp_path: Path, page_png: Path) -> None:
    page = new_page(1280, 800)
    page.goto(f"{server.url}/")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", "text-det-2d")
    page.set_input_files("#file", str(page_png))
    # the input alone, before any run
    page.wait_for_function("() => !document.getElementById('view2d').hidden")
    assert page.evaluate("() => window.tilewise.images.output") is None
    assert page.evaluate("() => document.getElementById('view2d').width") == 384
    page.click("#options summary")
    page.fill("#opt-tile", "1,2,3,4,5")  # three axes too many for a 2D model: refused
    page.evaluate("() => window.scrollTo(0, 0)")
    page.click("#run")
    page.wait_for_function("() => !document.getElementById('error').hidden", timeout=60_000)
    page.wait_for_timeout(300)
    assert page.evaluate(_IN_VIEW), page.text_content("#error")
    assert "The server answered" in page.text_content("#error")
    recorder.check(allowed_errors=("Failed to load resource",))

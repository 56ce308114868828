"""The page with a slide (issue 21 item 6): a pyramidal tiled TIFF of scikit-image's
immunohistochemistry micrograph (tiled out to 4001 x 3001 pixels, past the page's own canvas)
through sobel-2d; OpenSeadragon draws the input and the edge magnitude over it from the job's
deep-zoom tiles, with the opacity slider and the ramp's legend.

The overlay is checked against the result file: zoomed in to one screen pixel per slide pixel, the
pixels the overlay changes (opacity 1 against opacity 0) are those of the result in view that the
ramp draws (>= 10 % of the range), within 2 px. That view at the default opacity is the README's
screenshot (``docs/page-slide.png``).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
from _browser import JOB_TIMEOUT_MS, screenshot_array, wait_for_end
from PIL import Image
from scipy import ndimage as ndi

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def slide_tiff(tmp_path_factory: pytest.TempPathFactory, session_web_dir: Path) -> Path:
    from skimage import data

    from service.webassets import WebAssetError, setup_openseadragon

    try:
        setup_openseadragon(session_web_dir)
    except WebAssetError as exc:
        pytest.fail(f"OpenSeadragon cannot be set up (run `tilewise setup-web`): {exc}", pytrace=False)
    image = np.ascontiguousarray(np.tile(data.immunohistochemistry(), (6, 8, 1))[:3001, :4001])
    levels = [image, image[::2, ::2], image[::4, ::4], image[::8, ::8]]
    path = tmp_path_factory.mktemp("slide") / "ihc-slide.tif"
    with tifffile.TiffWriter(path) as tw:
        tw.write(levels[0], tile=(256, 256), photometric="rgb", compression="jpeg", subifds=3)
        for level in levels[1:]:
            tw.write(level, tile=(256, 256), photometric="rgb", compression="jpeg", subfiletype=1)
    return path


def _settled(page: Any) -> None:
    page.wait_for_function("() => window.tilewise.slides.settled()", timeout=120_000)
    page.wait_for_timeout(500)  # the canvas drawer paints on the next animation frame


def _set_opacity(page: Any, percent: int) -> None:
    page.evaluate(
        "(v) => { const s = document.getElementById('opacity'); s.value = v;"
        " s.dispatchEvent(new Event('input')); }",
        percent,
    )
    page.wait_for_timeout(500)


def test_a_slide_and_its_overlay_in_openseadragon(server, new_page, recorder, slide_tiff, artifacts) -> None:
    page = new_page(1280, 800)
    page.goto(f"{server.url}/")
    assert page.get_attribute('meta[name="tilewise-slides"]', "content") == "openseadragon"
    try:
        page.wait_for_function("() => !document.getElementById('model').disabled", timeout=120_000)
    except Exception:
        raise AssertionError(recorder.errors) from None
    page.select_option("#model", "sobel-2d")
    page.set_input_files("#file", str(slide_tiff))
    page.click("#run")
    status = wait_for_end(page, JOB_TIMEOUT_MS)
    assert status.startswith("done"), (status, page.text_content("#error"))
    assert page.is_visible("#slide") and not page.is_visible("#view2d")
    _settled(page)
    tiles = [u for u in recorder.requests if "/dzi/" in u]
    assert any("/dzi/input_files/" in u and u.endswith(".jpeg") for u in tiles)
    assert any("/dzi/result_files/" in u and ".png?channel=0" in u for u in tiles)
    assert page.locator("#legend canvas.ramp").count() == 1
    assert "not drawn" in page.text_content("#legend")
    assert "4001 x 3001" in page.text_content("#location")

    box = page.locator("#canvas-box")
    shown = screenshot_array(box, artifacts / "slide-60.png").astype(int)
    _set_opacity(page, 0)
    bare = screenshot_array(box, artifacts / "slide-0.png").astype(int)
    assert np.abs(shown - bare).max() > 40  # the default opacity shows the overlay

    # zoomed in to one screen pixel per slide pixel: tiles of the finest Deep Zoom level (12: 4001 px)
    # come; the pixels the overlay changes (opacity 1 against 0) are those of the result in view
    # over the ramp's threshold
    _set_opacity(page, 60)  # OpenSeadragon loads no tiles of an invisible image
    page.evaluate(
        "() => { const s = window.tilewise.slides.viewer; const input = s.world.getItemAt(0);"
        " s.viewport.zoomTo(input.imageToViewportZoom(1), null, true); }"
    )
    page.wait_for_timeout(1000)  # the next frames ask for the finer tiles
    _settled(page)
    levels = sorted(
        {u.split("_files/")[1].split("/")[0] for u in recorder.requests if "_files/" in u}, key=int
    )
    assert any("/dzi/input_files/12/" in u for u in recorder.requests), levels
    assert any("/dzi/result_files/12/" in u for u in recorder.requests), [
        u for u in recorder.requests if "result_files" in u
    ][-5:]
    _set_opacity(page, 0)
    bare = screenshot_array(box, artifacts / "slide-zoom-0.png").astype(int)
    _set_opacity(page, 100)
    full = screenshot_array(box, artifacts / "slide-zoom-100.png").astype(int)
    rect = page.evaluate(
        "() => { const s = window.tilewise.slides.viewer; const input = s.world.getItemAt(0);"
        " const r = input.viewportToImageRectangle(s.viewport.getBounds(true));"
        " return [r.x, r.y, r.width, r.height]; }"
    )
    job_id = next(u for u in recorder.requests if "/dzi/" in u).split("/v1/jobs/")[1].split("/")[0]
    import httpx

    answer = httpx.get(f"{server.url}/v1/jobs/{job_id}/result", timeout=60)
    prob = tifffile.imread(io.BytesIO(answer.content)).astype(float)
    lo, hi = min(0.0, float(prob.min())), float(prob.max())
    x, y, w, h = (round(v) for v in rect)
    assert x >= 0 and y >= 0 and x + w <= prob.shape[1] and y + h <= prob.shape[0], rect
    drawn = (prob[y : y + h, x : x + w] - lo) / (hi - lo) >= 0.1
    expected = np.asarray(Image.fromarray(drawn).resize(full.shape[1::-1], Image.Resampling.NEAREST))
    changed = np.abs(full - bare).max(axis=-1) > 24
    assert 0.05 < expected.mean() < 0.9
    # where the overlay changed the view is where the result is drawn, within the 2 px that the
    # canvas' smoothing of thin edges and the screen's rounding move it
    near = ndi.binary_dilation(expected, iterations=2)
    assert (changed & near).sum() / changed.sum() >= 0.9
    assert (expected & ndi.binary_dilation(changed, iterations=2)).sum() / expected.sum() >= 0.9

    _set_opacity(page, 60)
    _settled(page)
    page.screenshot(path=str(artifacts / "slide-page.png"))
    shutil.copyfile(artifacts / "slide-page.png", DOCS / "page-slide.png")
    recorder.check()

"""The page with a 2D image: scikit-image's page through text-det-2d, the text probability drawn
over the page.

The text boxes are the model's own (connected regions of probability > 0.3 in the result file);
that they sit on the printed text is checked independently, against the page's dark (ink) pixels.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import tifffile
from _browser import JOB_TIMEOUT_MS, screenshot_array, wait_for_end
from PIL import Image
from scipy import ndimage as ndi
from skimage import data, filters

pytestmark = pytest.mark.slow

RAMP_THRESHOLD = 0.1  # palette.js: probabilities below 10 % of the range are not drawn


def _canvas_rgb(page: Any) -> np.ndarray:
    """The 2D view's canvas, pixel for pixel (one canvas pixel per image pixel)."""
    url = page.evaluate("() => document.getElementById('view2d').toDataURL('image/png')")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def _coloured(rgb: np.ndarray) -> np.ndarray:
    """Pixels the overlay drew on: the page is grey (r = g = b), the ramp is red to yellow."""
    return (rgb.max(axis=-1) - rgb.min(axis=-1)) > 24


def _boxes(prob: np.ndarray) -> tuple[list[tuple[slice, slice]], np.ndarray]:
    """The model's text boxes (bounding boxes of probability > 0.3), and their union grown by 2 px."""
    labelled, _ = ndi.label(prob > 0.3)
    boxes = [b for b in ndi.find_objects(labelled) if b is not None]
    grown = np.zeros(prob.shape, bool)
    for rows, cols in boxes:
        grown[max(rows.start - 2, 0) : rows.stop + 2, max(cols.start - 2, 0) : cols.stop + 2] = True
    return boxes, grown


def test_text_probability_over_the_page(server, new_page, recorder, page_png, artifacts) -> None:
    page = new_page(1280, 800)
    page.goto(f"{server.url}/")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", "text-det-2d")
    page.set_input_files("#file", str(page_png))
    with page.expect_response(
        lambda r: r.url.endswith("/result") and r.status == 200, timeout=JOB_TIMEOUT_MS
    ) as answer:
        page.click("#run")
        status = wait_for_end(page)
    assert status.startswith("done"), (status, page.text_content("#error"))
    assert page.text_content("#percent") == "100 %"
    prob = tifffile.imread(io.BytesIO(answer.value.body()))
    grey = data.page()
    assert prob.shape == grey.shape

    # the canvas holds the page with the overlay exactly where the output is drawn
    rgb = _canvas_rgb(page)
    assert rgb.shape[:2] == grey.shape
    drawn = _coloured(rgb)
    lo, hi = min(0.0, float(prob.min())), float(prob.max())
    expected = (prob - lo) / (hi - lo) >= RAMP_THRESHOLD
    assert (drawn & expected).sum() / (drawn | expected).sum() >= 0.98
    untouched = ~expected
    assert np.abs(rgb[untouched] - grey[untouched][:, None]).max() <= 1  # the page itself, unchanged

    # ... inside the model's text boxes, every box lit; and those boxes are on the ink
    boxes, grown = _boxes(prob)
    assert len(boxes) >= 5
    assert (drawn & grown).sum() / drawn.sum() >= 0.98
    assert all(drawn[rows, cols].any() for rows, cols in boxes)
    ink = grey < filters.threshold_local(grey.astype(float), block_size=35, offset=15)
    inside = np.zeros(grey.shape, bool)
    for rows, cols in boxes:
        inside[rows, cols] = True
    assert ink[inside].mean() >= 4 * ink[~inside].mean()

    # what the screen shows (the canvas scaled to the panel) lines up as well
    shot = screenshot_array(page.locator("#view2d"), artifacts / "image-canvas.png")
    scaled = np.asarray(Image.fromarray(shot).resize(grey.shape[::-1], Image.NEAREST)).astype(int)
    on_screen = _coloured(scaled)
    assert (on_screen & expected).sum() / (on_screen | expected).sum() >= 0.8
    page.screenshot(path=str(artifacts / "page-2d.png"))

    # the legend is the ramp with the output's range; the plan is beside it
    assert "below" in page.inner_text("#legend") and page.locator("#legend canvas.ramp").count() == 1
    terms = page.locator("#facts dt").all_inner_texts()
    assert {"tile", "halo", "overlap", "tiles", "work"} <= set(terms)
    link = page.locator("#download")
    assert link.is_visible() and link.get_attribute("download") == "text-det-2d-output.tiff"
    with page.expect_download() as download:
        link.click()
    saved = download.value.path()
    assert np.array_equal(tifffile.imread(saved), prob)  # the button gives the output file itself
    recorder.check()


def _run(page: Any, url: str, path: Any, model: str = "text-det-2d", output: str = "") -> Any:
    page.goto(url)
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", model)
    page.set_input_files("#file", str(path))
    if output:
        page.click("#options summary")
        page.select_option("#opt-output", output)
    with page.expect_response(
        lambda r: r.url.endswith("/result") and r.status == 200, timeout=JOB_TIMEOUT_MS
    ) as answer:
        page.click("#run")
        status = wait_for_end(page)
    assert status.startswith("done"), (status, page.text_content("#error"))
    return answer.value


def test_label_png_over_the_page(server, new_page, recorder, page_png) -> None:
    """output=labels: a palette PNG, decoded by the page itself (the browser would give colours,
    not ids); label 1 drawn in its colour at the slider's 60 % over the page, label 0 not at all."""
    page = new_page()
    answer = _run(page, f"{server.url}/", page_png, output="labels")
    with Image.open(io.BytesIO(answer.body())) as image:
        assert image.mode == "P"
        labels = np.asarray(image)
    assert set(np.unique(labels)) == {0, 1}
    rgb = _canvas_rgb(page)
    grey = data.page().astype(float)
    text = labels == 1
    blend = 0.6 * np.array([230, 159, 0]) + 0.4 * grey[text][:, None]  # LABEL_PALETTE[1], Okabe-Ito orange
    assert np.abs(rgb[text] - blend).max() <= 1
    assert np.abs(rgb[~text] - grey[~text][:, None]).max() <= 1
    legend = page.inner_text("#legend")
    assert "label 0 (0), not drawn" in legend and "label 1 (1)" in legend
    recorder.check()


@pytest.mark.parametrize("compression", ["zlib", "lzw"])
def test_tiff_input_drawn_by_the_page(server, new_page, recorder, tmp_path, compression) -> None:
    """Browsers cannot show TIFF: the page decodes it (deflate with the horizontal predictor, LZW)
    and draws the page under the overlay exactly."""
    grey = data.page()
    path = tmp_path / f"page-{compression}.tiff"
    predictor = 2 if compression == "zlib" else None
    tifffile.imwrite(path, grey, compression=compression, predictor=predictor, rowsperstrip=40)
    page = new_page()
    answer = _run(page, f"{server.url}/", path)
    prob = tifffile.imread(io.BytesIO(answer.body()))
    rgb = _canvas_rgb(page)
    lo, hi = min(0.0, float(prob.min())), float(prob.max())
    untouched = (prob - lo) / (hi - lo) < RAMP_THRESHOLD
    assert untouched.mean() > 0.5
    stretched = (grey.astype(float) - grey.min()) * 255 / (int(grey.max()) - int(grey.min()))
    assert np.abs(rgb[untouched] - stretched[untouched][:, None]).max() <= 1
    recorder.check()


def test_seam_figures_and_warning_beside_the_result(server, new_page, recorder, page_png) -> None:
    """A halo below the receptive field: the server measures the seams and warns; the page shows
    both figures and the sentence, as the result's headers give them."""
    page = new_page()
    page.goto(f"{server.url}/")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", "gaussian-2d")
    page.set_input_files("#file", str(page_png))
    page.click("#options summary")
    page.fill("#opt-tile", "64")
    page.fill("#opt-halo", "2")
    with page.expect_response(
        lambda r: r.url.endswith("/result") and r.status == 200, timeout=JOB_TIMEOUT_MS
    ) as answer:
        page.click("#run")
        assert wait_for_end(page).startswith("done")
    headers = answer.value.headers
    terms, values = page.locator("#facts dt").all_inner_texts(), page.locator("#facts dd").all_inner_texts()
    facts = dict(zip(terms, values, strict=True))
    seam = dict(part.strip().split("=", 1) for part in headers["x-tilewise-seam"].split(";"))
    assert {"max", "mean"} <= set(seam) and float(seam["max"]) > 0
    assert {f"seam {k}": v for k, v in seam.items()} == {k: facts[k] for k in facts if k.startswith("seam ")}
    assert facts["warning"] == headers["x-tilewise-warning"]
    assert facts["halo"] == "2,2"
    recorder.check()

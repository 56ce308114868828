"""The page with a volume: the MNI152 T1 (2 mm) through ``tissue-3d`` (trained at 1 mm: the server
resamples there and back), shown in NiiVue's three slice views with the three labels over it.

Screen pixels are mapped to the output's own voxels through NiiVue's canvas-to-millimetre transform
and the output's affine (read here with nibabel), so a flipped, transposed or shifted overlay fails.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
from _browser import JOB_TIMEOUT_MS, screenshot_array, wait_for_end

from service.codecs.images import LABEL_PALETTE

pytestmark = pytest.mark.slow

MODEL = "tissue-3d"
LABELS = {0: "background", 1: "grey matter", 2: "white matter"}

#: Canvas points (CSS pixels, device scale 1) of every slice view, every ``step`` pixels, with the
#: millimetre position NiiVue draws there and the view (0 axial, 1 coronal, 2 sagittal).
_PROBE = """(step) => {
  const nv = window.tilewise.volumes.nv;
  const out = [];
  for (const s of nv.screenSlices) {
    if (s.axCorSag > 2) continue;
    const [left, top, width, height] = s.leftTopWidthHeight;
    for (let y = top + step / 2; y < top + height; y += step) {
      for (let x = left + step / 2; x < left + width; x += step) {
        const frac = nv.canvasPos2frac([x, y]);
        if (frac[0] < 0) continue;
        const mm = nv.frac2mm(frac, 0, true);
        out.push([s.axCorSag, x, y, mm[0], mm[1], mm[2]]);
      }
    }
  }
  return out;
}"""
_TILES = """() => window.tilewise.volumes.nv.screenSlices
  .filter((s) => s.axCorSag <= 2).map((s) => [s.axCorSag, ...s.leftTopWidthHeight])"""


def _voxel(affine_inv: np.ndarray, mm: Any) -> tuple[int, int, int]:
    i, j, k = np.rint(affine_inv @ [mm[0], mm[1], mm[2], 1.0])[:3].astype(int)
    return int(i), int(j), int(k)


def _samples(
    points: list[list[float]], labels: np.ndarray, affine: np.ndarray
) -> list[tuple[int, int, int, int]]:
    """``(view, x, y, label)`` of the points whose voxel lies inside a block of one label (3x3x3),
    so that rounding at a boundary cannot decide the colour."""
    inverse = np.linalg.inv(affine)
    out = []
    for view, x, y, *mm in points:
        i, j, k = _voxel(inverse, mm)
        if not all(1 <= v < n - 1 for v, n in zip((i, j, k), labels.shape, strict=True)):
            continue
        block = labels[i - 1 : i + 2, j - 1 : j + 2, k - 1 : k + 2]
        if (block == block.flat[0]).all():
            out.append((int(view), int(x), int(y), int(block.flat[0])))
    return out


def _agreement(
    shot: np.ndarray, samples: list[tuple[int, int, int, int]], opacity: float
) -> dict[int, float]:
    """Per label, the share of its samples whose pixel has the expected colour: the label's colour at
    full opacity, a grey (the T1) where nothing is drawn (label 0, or opacity 0)."""
    hits: dict[int, list[bool]] = {}
    for _, x, y, label in samples:
        pixel = shot[y, x].astype(int)
        if label == 0 or opacity == 0:
            ok = int(pixel.max()) - int(pixel.min()) <= 12  # grey: r = g = b (up to the blend)
        else:
            ok = int(np.abs(pixel - np.array(LABEL_PALETTE[label])).max()) <= 40
        hits.setdefault(label, []).append(ok)
    return {label: float(np.mean(v)) for label, v in hits.items()}


def _run(page: Any, server: Any, path: Path) -> tuple[str, Any]:
    page.goto(f"{server.url}/")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", MODEL)
    page.set_input_files("#file", str(path))
    with page.expect_response(
        lambda r: r.url.endswith("/result") and r.status == 200, timeout=JOB_TIMEOUT_MS
    ) as answer:
        page.click("#run")
        status = wait_for_end(page)
    return status, answer.value


def _set_opacity(page: Any, key: str, text: str) -> None:
    page.focus("#opacity")
    page.keyboard.press(key)  # Home: 0 %, End: 100 %
    assert page.text_content("#opacity-value") == text
    page.wait_for_timeout(300)  # NiiVue draws on the next animation frame


def test_volume_result_in_three_views(server, new_page, recorder, mni_path, artifacts, tmp_path) -> None:
    page = new_page(1280, 800)
    status, result = _run(page, server, mni_path)
    assert status.startswith("done"), (status, page.text_content("#error"))
    assert page.get_attribute("#progress", "value") == "1" and page.text_content("#percent") == "100 %"
    (tmp_path / "out.nii.gz").write_bytes(result.body())
    output = nib.load(tmp_path / "out.nii.gz")
    labels = np.asarray(output.dataobj)
    assert labels.shape == nib.load(mni_path).shape and set(np.unique(labels)) == {0, 1, 2}

    # the legend names the model's three labels, in their colours
    items = page.locator("#legend li")
    assert items.count() == 3
    for label, name in LABELS.items():
        item = page.locator(f'#legend li[data-label="{label}"]')
        assert item.inner_text().startswith(f"{name} ({label})")
    # the plan beside it, as the result's header has it
    facts = dict(
        zip(
            page.locator("#facts dt").all_inner_texts(),
            page.locator("#facts dd").all_inner_texts(),
            strict=True,
        )
    )
    plan = dict(p.strip().split("=", 1) for p in result.headers["x-tilewise-plan"].split(";"))
    assert {k: facts[k] for k in plan} == plan and {"tile", "halo", "overlap", "tiles", "work"} <= set(plan)

    page.wait_for_timeout(300)
    page.screenshot(path=str(artifacts / "page-volume.png"))  # as a user first sees it (60 %)

    # three orthogonal views, none blank
    tiles = page.evaluate(_TILES)
    assert sorted(t[0] for t in tiles) == [0, 1, 2]
    _set_opacity(page, "End", "100 %")
    shot = screenshot_array(page.locator("#view3d"), artifacts / "volume-canvas.png")
    for _, left, top, width, height in tiles:
        assert width > 150 and height > 150
        region = shot[int(top) : int(top + height), int(left) : int(left + width)]
        assert len(np.unique(region.reshape(-1, 3), axis=0)) > 20 and region.std() > 20

    # at 100 %: every label's pixels carry its colour, background shows the grey T1
    samples = _samples(page.evaluate(_PROBE, 4), labels, output.affine)
    assert {s[3] for s in samples} == {0, 1, 2} and len(samples) > 2000
    for view in (0, 1, 2):
        assert {s[3] for s in samples if s[0] == view} >= {0, 2}, f"view {view} lacks labels"
    agreement = _agreement(shot, samples, 1.0)
    assert min(agreement.values()) >= 0.95, agreement

    # at 0 %: the overlay is gone, the T1 shows everywhere
    _set_opacity(page, "Home", "0 %")
    clear = screenshot_array(page.locator("#view3d"), artifacts / "volume-canvas-opacity0.png")
    assert min(_agreement(clear, samples, 0.0).values()) >= 0.95
    _set_opacity(page, "End", "100 %")

    # one crosshair: a click in the axial view moves the coronal and sagittal slices; the
    # location line names the label the model put at that point
    inverse = np.linalg.inv(output.affine)
    axial = next(t for t in tiles if t[0] == 0)
    before = screenshot_array(page.locator("#view3d"), tmp_path / "before.png")
    target = next(s for s in samples if s[0] == 0 and s[3] == 2)
    page.locator("#view3d").click(position={"x": target[1], "y": target[2]})
    page.wait_for_timeout(300)
    after = screenshot_array(page.locator("#view3d"), artifacts / "volume-canvas-clicked.png")
    for view, left, top, width, height in tiles:
        if view != 0:
            rows, cols = slice(int(top), int(top + height)), slice(int(left), int(left + width))
            assert (before[rows, cols] != after[rows, cols]).any(axis=2).mean() > 0.02, (
                f"view {view} did not move"
            )
    assert axial[1] <= target[1] <= axial[1] + axial[3]
    located = page.text_content("#location")
    found = re.search(r"at (-?[\d.]+), (-?[\d.]+), (-?[\d.]+) mm", located)
    assert found, located
    voxel = _voxel(inverse, [float(v) for v in found.groups()])
    assert f"output {LABELS[int(labels[voxel])]} ({int(labels[voxel])})" in located

    # the keyboard moves it too: Page Up goes one voxel up (superior), 2 mm on this grid
    page.focus("#canvas-box")
    page.keyboard.press("PageUp")
    moved = re.search(r"at (-?[\d.]+), (-?[\d.]+), (-?[\d.]+) mm", page.text_content("#location"))
    assert moved and float(moved.group(3)) == pytest.approx(float(found.group(3)) + 2.0, abs=0.01)
    recorder.check()


def test_volume_probabilities_one_channel_at_a_time(server, new_page, recorder, mni_path, artifacts) -> None:
    """output=probabilities: three channels as a 4D NIfTI, one shown at a time on the colour ramp.
    One tile over the whole volume (tile=256 shrinks to it): the run costs half the default's."""
    page = new_page(1280, 800)
    page.goto(f"{server.url}/")
    page.wait_for_function("() => !document.getElementById('model').disabled")
    page.select_option("#model", MODEL)
    page.set_input_files("#file", str(mni_path))
    # the input is shown as soon as it is chosen, before any run (issue 25 item 14)
    page.wait_for_function("() => (window.tilewise.volumes.nv?.volumes.length || 0) === 1")
    assert page.is_visible("#view3d") and "will be drawn over it" in page.text_content("#location")
    page.click("#options summary")
    page.fill("#opt-tile", "256")
    page.select_option("#opt-output", "probabilities")
    page.click("#run")
    assert wait_for_end(page).startswith("done")
    assert page.is_visible("#channel-box")
    # channels named by the model's labels; opened on the first that is not the background
    names = [f"{name} (channel {k})" for k, name in LABELS.items()]
    assert page.locator("#channel option").all_inner_texts() == names
    assert page.input_value("#channel") == "1"
    assert page.locator("#legend canvas.ramp").count() == 1
    _set_opacity(page, "End", "100 %")
    shots = []
    for channel in ("0", "2"):
        page.select_option("#channel", channel)
        page.wait_for_timeout(300)
        shots.append(screenshot_array(page.locator("#view3d"), artifacts / f"volume-channel{channel}.png"))
    warm = [((s[..., 0] > 120) & (s[..., 2] < 60)).mean() for s in shots]  # ramp colours: red to yellow
    assert min(warm) > 0.01 and (shots[0] != shots[1]).any(axis=2).mean() > 0.01, warm
    recorder.check()

"""Review item 15: what an ended job's folder keeps. A deep-zoom overview of the input, built by the
view while the job was queued (:func:`service.dzi.open_pyramid` on a flat TIFF seen from afar), goes
with the input of a failed or cancelled job; a done 2D job keeps both for its view."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile

from service import dzi
from service.dzi import pyramids
from service.jobs.runner import ended_leftovers
from service.jobs.store import INPUT_FILE, PARTIAL_FILE


def _folder(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from skimage import data

    monkeypatch.setattr(pyramids, "MAX_READ_PIXELS", 300 * 300)
    monkeypatch.setattr(pyramids, "OVERVIEW_EDGE", 64)
    root.mkdir()
    tifffile.imwrite(root / INPUT_FILE, data.camera()[:401, :333])
    dzi.open_pyramid(root / INPUT_FILE).close()  # the view, asked while queued: builds the overview
    (root / PARTIAL_FILE).write_bytes(b"x")
    tifffile.imwrite(root / "output.tif", np.zeros((401, 333), np.uint8))
    return root


def _left(folder: Path, done: bool) -> set[str]:
    for path in ended_leftovers(folder, done=done):
        path.unlink(missing_ok=True)
    return {p.name for p in folder.iterdir()}


def test_a_failed_job_leaves_no_overview(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path / "failed", monkeypatch)
    assert (folder / f"{INPUT_FILE}.dzi-overview.npy").is_file()
    assert _left(folder, done=False) == set()


def test_a_done_2d_job_keeps_its_input_and_overview(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path / "done", monkeypatch)
    assert _left(folder, done=True) == {INPUT_FILE, f"{INPUT_FILE}.dzi-overview.npy", "output.tif"}

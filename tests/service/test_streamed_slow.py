"""Issue 20 acceptance on full-size inputs (slow: about 30 minutes on 2 loaded cores).

Each case runs in a fresh process what ``tilewise infer`` runs (:mod:`benchmarks.stream_rss`):
the rise of the peak resident memory (``VmHWM``) above the warmed-up process, and the output
against ``scipy.ndimage.gaussian_filter`` on 20 random windows (float32 arithmetic: the bound is
relative to the data's magnitude, HU up to 1000 for the CT, 255 for the pages).
Run it with ``pytest -m slow tests/service/test_streamed_slow.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _measure(model: str, source: Path, output: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.stream_rss", "measure", model, str(source), str(output)],
        capture_output=True, text=True, cwd=ROOT, check=True, timeout=3600,
    )  # fmt: skip
    output.unlink(missing_ok=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stream-rss")
    subprocess.run([sys.executable, "-m", "benchmarks.stream_rss", "make", str(folder)], cwd=ROOT, check=True,
                   timeout=3600)  # fmt: skip
    return folder


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_ct_volumes_stream_within_300_mib_and_scale_with_the_tile(inputs: Path) -> None:
    rows = {name: _measure("gaussian-3d", inputs / name, inputs / f"out-{name}.nii.gz")
            for name in ("ct400.nii", "ct400.nii.gz", "ct800.nii")}  # fmt: skip
    sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    assert rows["ct400.nii"]["peak_mib"] <= 300 and rows["ct400.nii.gz"]["peak_mib"] <= 300, rows
    # The memory follows the tile: the planner sizes tiles to the grid, so 400 slices get 112-slice
    # tiles and 800 slices 128-slice ones (1.14x the voxels); per tile voxel the peak is the same.
    tile = {k: math.prod(int(n) for n in rows[k]["plan"].split(";")[0][5:].split(",")) for k in rows}
    ratio = max(1.0, tile["ct800.nii"] / tile["ct400.nii"])
    assert rows["ct800.nii"]["peak_mib"] <= 1.15 * ratio * rows["ct400.nii"]["peak_mib"], rows
    for row in rows.values():
        assert row["max_abs_diff"] <= 1e-6 * 1000 * 4, row  # HU magnitudes, float32


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_a_40k_tiled_bigtiff_streams_within_500_mib_and_the_png_is_still_refused(inputs: Path) -> None:
    slide = _measure("gaussian-2d", inputs / "slide40k.tif", inputs / "out-slide40k.tif")
    striped = _measure("gaussian-2d", inputs / "page12k.tif", inputs / "out-page12k.tif")
    png = _measure("gaussian-2d", inputs / "page12k.png", inputs / "out-png.tif")
    sys.stdout.write(json.dumps([slide, striped, png], indent=1) + "\n")
    assert slide["peak_mib"] <= 500 and slide["tiled"] and slide["bigtiff"], slide
    assert striped["peak_mib"] <= 500 and striped["tiled"], striped
    for row in (slide, striped):
        assert row["max_abs_diff"] <= 1e-6 * 255 * 4, row
    assert png["refused"] == 413 and "max_image_pixels" in png["detail"], png


def _tile_voxels(plan: str) -> int:
    """Voxels of the tile of an ``X-Tilewise-Plan`` header (``tile=X,Y,Z; ...``)."""
    return math.prod(int(n) for n in plan.split(";")[0][5:].split(","))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("route", ["sync", "job"])
def test_the_ct_through_a_server_streams_within_300_mib_and_scales_with_the_tile(
    inputs: Path, route: str
) -> None:
    """The same bounds through ``POST /v1/models/gaussian-3d/infer`` and a job: 400 slices within
    300 MiB, 800 slices within 1.15x the 400-slice figure per tile voxel (a job's checkpoint is
    copied into the NIfTI slab by slab: before, its peak grew 1.31x)."""
    rows = {}
    for name in ("ct400.nii", "ct800.nii"):
        command = [sys.executable, "-m", "benchmarks.stream_rss", "http", "gaussian-3d", str(inputs / name)]
        proc = subprocess.run(command + (["--job"] if route == "job" else []), capture_output=True, text=True,
                              cwd=ROOT, check=True, timeout=3000)  # fmt: skip
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    small, large = rows["ct400.nii"], rows["ct800.nii"]
    assert small["status"] == 200 and large["status"] == 200, rows
    assert small["peak_mib"] <= 300, rows
    ratio = max(1.0, _tile_voxels(large["plan"]) / _tile_voxels(small["plan"]))
    assert large["peak_mib"] <= 1.15 * ratio * small["peak_mib"], rows

"""Smoke test of ``python -m benchmarks --quick``: it runs and reports sane fields (no timing pass/fail).

Marked ``slow``: the quick benchmark spawns a worker process per contender and takes 4-10 minutes on
2 cores, more on a loaded machine (run it with ``-m slow``); ``--max-minutes 15`` skips the contenders
left after 15 minutes (reported as skipped), so a slow machine still ends with a report.

MONAI and TorchIO come with the ``bench`` extra; without them their contenders (and the U-Net
case, whose network is MONAI's ``BasicUNet``) are reported as skipped, and the tilewise-only
cases must still run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("nilearn")  # the benchmark volume is nilearn's MNI152 template
pytest.importorskip("scipy")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_quick_benchmark_runs_and_reports_sane_fields(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), "--cache", str(tmp_path / "cache"),
         "--models", str(tmp_path / "no-models"), "--max-minutes", "15"],
        capture_output=True, text=True, cwd=ROOT, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()
    assert "| contender |" in markdown
    assert report["mode"] == "quick"
    assert report["machine"]["nproc"] >= 1
    assert report["versions"]["torch"]

    rows = report["results"]
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [(r["case"], r["contender"], r["note"]) for r in rows if r["status"] == "failed"]
    assert not failed, failed
    assert ok
    for r in ok:
        assert math.isfinite(r["time_s"]) and r["time_s"] > 0, r
        assert len(r["times_s"]) >= 3, r  # median of at least 3 runs
        assert r["peak_mb"] >= 0, r
        assert r["forward_passes"] >= 1, r
        if "max_abs" in r:
            assert math.isfinite(r["max_abs"]) and 0 <= r["mean_abs"] <= r["max_abs"], r

    def row(case: str, prefix: str) -> dict:
        found = [r for r in ok if r["case"] == case and r["contender"].startswith(prefix)]
        assert found, (case, prefix, [(r["case"], r["contender"]) for r in rows])
        return found[0]

    # The shallow analytic net with halo="auto" reproduces the whole volume (a correctness check,
    # not a timing one): float32 rounding only, far below 1e-4 for z-scored data.
    assert row("shallow", "tilewise")["max_abs"] <= 1e-4
    assert row("shallow", "whole")["forward_passes"] == 1
    assert row("scaling", "tilewise on-disk")["time_s"] > 0

    if importlib.util.find_spec("monai") is not None:
        monai = row("3d-batch", "MONAI")
        tilewise = row("3d-batch", "tilewise halo")
        # Same tile and stride: the same number of forward passes.
        assert tilewise["forward_passes"] == monai["forward_passes"]
        assert "ratio_whole" in tilewise
        assert report["targets"], "targets are evaluated when MONAI is present"
    else:
        assert any(r["status"] == "skipped" for r in rows)

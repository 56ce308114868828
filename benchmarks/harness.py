"""The parent side: rows of results, workers in fresh subprocesses, budgets and the report."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.config import MB, RESULT_PREFIX, ROOT, Mode
from benchmarks.env import importable, machine_info, versions
from benchmarks.report import evaluate_targets, plot_speed_vs_seam, ratios, render_markdown
from benchmarks.rows import Row


class Bench:
    """The parent process: runs each contender in a worker, collects rows, writes the report."""

    def __init__(self, args: argparse.Namespace, mode: Mode) -> None:
        self.args = args
        self.mode = mode
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.cache = Path(args.cache).expanduser().resolve()
        self.cache.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="tilewise-bench-"))
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.calibrations: dict[str, dict[str, Any]] = {}
        self.pending: list[tuple[Row, dict[str, Any], int]] = []
        self.started = time.perf_counter()
        self.env = dict(os.environ)
        threads = str(args.threads)
        self.env.update(
            {
                "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads,
                "MALLOC_MMAP_THRESHOLD_": "131072",
                "PYTHONWARNINGS": "ignore",
            }
        )
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH", "")]))
        self.have_monai = importable("monai")
        self.have_torchio = importable("torchio")

    def over_budget(self) -> bool:
        limit = self.args.max_minutes
        return limit is not None and time.perf_counter() - self.started > 60 * limit

    def log(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def worker(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        job = {"threads": self.args.threads, "repeats": self.mode.repeats, "batch_size": 1, **job}
        path = self.work / f"job{len(list(self.work.glob('job*.json')))}.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "benchmarks", "--worker", str(path)]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=ROOT,
            timeout=timeout or self.args.job_timeout,
        )
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return dict(json.loads(line[len(RESULT_PREFIX) :]))
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
        raise RuntimeError(f"worker exited with {proc.returncode}: " + " | ".join(t.strip() for t in tail))

    def add(self, case: str, contender: str, job: dict[str, Any], *, skip: str | None = None) -> Row:
        if self.args.profile and case == "3d-batch" and job.get("kind") in ("monai", "tilewise", "whole"):
            slug = "".join(c if c.isalnum() else "_" for c in contender).strip("_")[:40]
            job = {**job, "profile": str(self.out / f"profile_{case}_{slug}.txt")}
        params = {
            k: v
            for k, v in job.items()
            if k not in ("data", "reference", "save", "out_path", "models_dir", "profile")
        }
        row = Row(case, contender, params)
        self.rows.append(row)
        if skip is None and self.over_budget():
            skip = f"time budget of {self.args.max_minutes:g} minutes spent"
        if skip:
            row.status, row.note = "skipped", skip
            self.log(f"{case} / {contender}: skipped ({skip})")
            return row
        rounds = int(job.get("repeats", self.mode.repeats))
        interleave = case in self.mode.interleave_cases and rounds > 1
        try:
            row.result = self.worker({**job, "repeats": 1} if interleave else job)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            row.status, row.note = "failed", str(exc)[-400:]
            self.log(f"{case} / {contender}: FAILED {row.note}")
            return row
        if interleave:
            self.pending.append((row, job, rounds - 1))
        self.log(
            f"{case} / {contender}: {row.get('time_s', 0):.2f} s, {row.get('peak_mb', 0):.0f} MB, "
            f"max abs {row.get('max_abs', float('nan')):.3g}, {row.get('forward_passes')} passes"
        )
        return row

    def run_pending_rounds(self) -> None:
        """The remaining timed runs of interleaved contenders, round robin (each in a fresh process),
        so that a slow spell of a shared machine spreads over all contenders instead of one."""
        light_keys = ("save", "reference", "disagreement", "profile")
        while self.pending:
            left = []
            for row, job, n in self.pending:
                if self.over_budget():
                    row.note = (row.note + "; " if row.note else "") + "fewer runs: time budget spent"
                    continue
                light = {k: v for k, v in job.items() if k not in light_keys}
                try:
                    r = self.worker({**light, "repeats": 1})
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    row.note = (row.note + "; " if row.note else "") + f"extra run failed: {exc}"[-200:]
                    continue
                res = row.result
                res["times_s"] = res["times_s"] + r["times_s"]
                res["peaks_bytes"] = res["peaks_bytes"] + r["peaks_bytes"]
                res["time_s"] = statistics.median(res["times_s"])
                res["min_s"] = min(res["times_s"])
                res["peak_mb"] = statistics.median(res["peaks_bytes"]) / MB
                if n > 1:
                    left.append((row, job, n - 1))
            self.pending = left
        for row in self.rows:
            if row.status == "ok" and "times_s" in row.result and len(row.result["times_s"]) > 1:
                row.result.setdefault("interleaved", row.case in self.mode.interleave_cases)

    def calibrate(self, model: str, data: Path, tile: int, tolerance: float) -> dict[str, Any] | None:
        key = f"{model}:{tile}"
        if key in self.calibrations:
            return self.calibrations[key]
        try:
            cal = self.worker(
                {"kind": "calibrate", "model": model, "data": str(data), "tile": tile, "tolerance": tolerance}
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.notes.append(f"halo calibration for {model} failed: {exc}")
            self.log(f"calibration {model}: FAILED {exc}")
            return None
        self.calibrations[key] = cal
        self.log(
            f"calibration {model} tile {tile}: halo {cal['halo']} (met {cal['met']}, "
            f"error {cal['error']:.3g}) in {cal['seconds']:.1f} s"
        )
        return cal

    @staticmethod
    def halo_for(cal: dict[str, Any], tolerance: float) -> tuple[int, bool, float]:
        """The smallest calibrated halo within ``tolerance`` (else the largest tried)."""
        errors = {int(h): float(e) for h, e in cal["errors"].items()}
        for h in sorted(errors):
            if errors[h] <= tolerance:
                return h, True, errors[h]
        h = max(errors)
        return h, False, errors[h]

    def finish(self) -> dict[str, Any]:
        for row in self.rows:
            if row.status != "ok" or "time_s" not in row.result:
                continue
            whole = next(
                (
                    r
                    for r in self.rows
                    if r.case == row.case and r.contender.startswith("whole") and r.status == "ok"
                ),
                None,
            )
            if row.case == "sweep":
                whole = next(
                    (
                        r
                        for r in self.rows
                        if r.case == "3d-batch" and r.contender.startswith("whole") and r.status == "ok"
                    ),
                    None,
                )
            if whole is not None:
                row.result["ratio_whole"] = row.result["time_s"] / whole.result["time_s"]
            if "voxels" in row.result:
                row.result["us_per_voxel"] = 1e6 * row.result["time_s"] / row.result["voxels"]
        targets = evaluate_targets(self.rows)
        report = {
            "mode": self.mode.name,
            "machine": machine_info(),
            "versions": versions(),
            "config": {
                "threads": self.args.threads,
                "repeats": self.mode.repeats,
                "sweep_repeats": self.mode.sweep_repeats,
                "mode": self.mode.__dict__,
            },
            "calibrations": self.calibrations,
            "results": [r.as_dict() for r in self.rows],
            "targets": targets,
            "ratios": ratios(self.rows),
            "notes": list(dict.fromkeys(self.notes)),
            "total_s": time.perf_counter() - self.started,
        }
        (self.out / "results.json").write_text(json.dumps(report, indent=2, default=str))
        plot = plot_speed_vs_seam(self.rows, self.out / "speed_vs_seam.png")
        if plot:
            report["plot"] = str(plot)
        md = render_markdown(report)
        (self.out / "results.md").write_text(md)
        print(md)
        shutil.rmtree(self.work, ignore_errors=True)
        return report

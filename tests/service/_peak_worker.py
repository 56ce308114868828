"""Subprocess of ``test_peak_accuracy``: each request's dry-run ``peak_bytes`` and its measured peak.

Usage: ``python _peak_worker.py MODEL CASE...`` with each CASE ``path|query|memory_budget``. The
process sets itself up as ``tilewise infer`` does (mmap threshold, model loaded, footprint measured
as at warm-up), then per case: the dry run's prediction, and the rise of the peak resident memory
(``VmHWM``, reset before) above the level before ``run_file`` (decode, plan, run, encode). One JSON
line per case on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from models import ModelRepository
    from models.measure.rss import (
        fix_mmap_threshold,
        peak_rss_bytes,
        release_free_memory,
        reset_peak_rss,
        rss_bytes,
    )
    from models.planning.params import parse_params
    from service.dryrun import dry_run
    from service.pipeline import Limits, run_file

    fix_mmap_threshold()
    name, *cases = argv
    model = ModelRepository(None, device="cpu").get(name)
    model.footprint()
    for case in cases:
        path, query, budget = case.split("|")
        params = parse_params(dict(item.split("=") for item in query.split("&") if item))
        limits = Limits(memory_budget=int(budget) if budget else None)
        plan = dry_run(model, Path(path), params, limits)
        release_free_memory()
        base = rss_bytes()
        if base is None or not reset_peak_rss():
            sys.stdout.write(json.dumps({"case": case, "skip": "no /proc/self/clear_refs"}) + "\n")
            continue
        result = run_file(model, Path(path), Path(path).with_suffix(".out"), params, limits=limits)
        peak = peak_rss_bytes()
        result.path.unlink()
        assert peak is not None
        answer = {"case": case, "predicted": plan["peak_bytes"], "measured": peak - base}
        answer.update(plan=result.plan.header(), dry=plan)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

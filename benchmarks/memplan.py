"""Worker of the ``memplan`` case: the dry run's ``peak_bytes`` against the measured peak of a request.

Set up as ``tilewise infer`` is (fixed mmap threshold, model loaded, footprint measured as at a
server's warm-up), then for each case: the dry run of the file, and the rise of the process's peak
resident memory (``VmHWM``, reset before) above the level before ``service.pipeline.run_file``
(decode, plan, run, encode to ``.npy``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def worker_memplan(job: dict[str, Any]) -> dict[str, Any]:
    import nibabel as nib
    import numpy as np

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
    model = ModelRepository(None, device="cpu").get(job["model_name"])
    start = time.perf_counter()
    model.footprint()
    footprint_s = time.perf_counter() - start
    size = int(job["size"])
    path = Path(job["out_path"]) / f"v{size}.nii"
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(
        nib.Nifti1Image(np.random.default_rng(size).random((size,) * 3, dtype=np.float32), np.eye(4)), path
    )
    cases = []
    for query, budget in job["cases"]:
        params = parse_params(query)
        limits = Limits(memory_budget=budget)
        plan = dry_run(model, path, params, limits)
        release_free_memory()
        base = rss_bytes()
        if base is None or not reset_peak_rss():
            raise RuntimeError("/proc/self/clear_refs is not writable: no peak to measure")
        t0 = time.perf_counter()
        result = run_file(model, path, path.with_suffix(".out"), params, limits=limits)
        seconds = time.perf_counter() - t0
        peak = peak_rss_bytes()
        result.path.unlink()
        assert peak is not None
        cases.append({"query": query, "budget": budget, "predicted": plan["peak_bytes"],
                      "measured": peak - base, "eta_s": plan["eta_s"], "seconds": seconds,
                      "plan": result.plan.header(), "batch_size": result.plan.batch_size})  # fmt: skip
    path.unlink()
    return {"cases": cases, "footprint": model.footprint().describe(), "footprint_s": footprint_s}

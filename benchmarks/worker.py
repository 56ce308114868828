"""The worker process: runs one contender of one case, times it and prints one ``RESULT`` line."""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import MB, RESULT_PREFIX
from benchmarks.contenders import make_runner
from benchmarks.memory import AnonPeak
from benchmarks.nets import Counted, build_predictor


def to_numpy(y: Any) -> Any:
    import numpy as np

    if hasattr(y, "detach"):
        return y.detach().cpu().numpy()
    return np.asarray(y)


def abs_diff(a: Any, b: Any, chunk: int = 8) -> tuple[float, float]:
    """Max and mean abs difference of two ``(C, D, ...)`` arrays, a slab of ``chunk`` rows at a time."""
    import numpy as np

    if a.shape != b.shape:
        raise ValueError(f"output shape {a.shape} differs from the reference's {b.shape}")
    worst, total, count = 0.0, 0.0, 0
    for i in range(0, a.shape[1], chunk):
        d = np.abs(np.asarray(a[:, i : i + chunk], dtype=np.float64) - np.asarray(b[:, i : i + chunk]))
        worst = max(worst, float(d.max()))
        total += float(d.sum())
        count += d.size
    return worst, total / max(count, 1)


def tile_disagreement(predictor: Counted, data: Any, job: dict[str, Any]) -> dict[str, float]:
    """Max / mean abs difference between the outputs of neighbouring tiles where they overlap."""
    import numpy as np
    import torch

    from tiling import TileGrid

    tile, halo = int(job["tile"]), int(job["halo"])
    spatial = data.shape[1:]
    grid = TileGrid.plan(spatial, tile, halo, alignment=predictor.alignment)
    outputs: dict[tuple[int, ...], tuple[tuple[int, ...], Any]] = {}
    for t in grid.tiles():
        size = tuple(a.tile for a in grid.axes)
        x = np.zeros((data.shape[0], *size), dtype=np.float32)
        src = tuple(slice(s, min(s + n, L)) for s, n, L in zip(t.starts, size, spatial, strict=True))
        x[(slice(None), *(slice(0, s.stop - s.start) for s in src))] = data[(slice(None), *src)]
        with torch.inference_mode():
            y = predictor(torch.from_numpy(x)[None])[0].numpy()
        outputs[t.index] = (t.starts, y)
    worst, total, count = 0.0, 0.0, 0
    for index, (starts, y) in outputs.items():
        for axis in range(len(index)):
            nb = tuple(i + (a == axis) for a, i in enumerate(index))
            if nb not in outputs:
                continue
            starts2, y2 = outputs[nb]
            lo = [max(a, b) for a, b in zip(starts, starts2, strict=True)]
            sizes = y.shape[1:]
            hi = [min(a + n, b + n, L) for a, b, n, L in zip(starts, starts2, sizes, spatial, strict=True)]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                continue
            r1 = tuple(slice(lo_ - s, h - s) for lo_, h, s in zip(lo, hi, starts, strict=True))
            r2 = tuple(slice(lo_ - s, h - s) for lo_, h, s in zip(lo, hi, starts2, strict=True))
            d = np.abs(y[(slice(None), *r1)].astype(np.float64) - y2[(slice(None), *r2)])
            worst = max(worst, float(d.max()))
            total += float(d.sum())
            count += d.size
    return {"tile_disagreement_max": worst, "tile_disagreement_mean": total / max(count, 1)}


def profile_run(run: Callable[[], Any], path: Path) -> str:
    """One more run under the torch profiler; the top operators by self CPU time go to ``path``."""
    import torch.profiler

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    path.write_text(table)
    return str(path)


def load_data(job: dict[str, Any]) -> Any:
    import numpy as np

    if job.get("input") == "disk":
        return np.load(job["data"], mmap_mode="r")
    if job.get("input") == "nifti":
        return NiftiSource(job["data"])
    return np.load(job["data"])


class NiftiSource:
    """A ``(1, *spatial)`` view of a NIfTI file's lazy ``dataobj`` (nibabel reads each tile's slice;
    for ``.nii.gz`` that means decompressing up to it): a source whose reading costs."""

    def __init__(self, path: str) -> None:
        import nibabel as nib

        self.proxy = nib.load(path).dataobj
        self.shape = (1, *self.proxy.shape)
        self.ndim = len(self.shape)

    def __getitem__(self, key: tuple[slice, ...]) -> Any:
        import numpy as np

        return np.asarray(self.proxy[key[1:]], dtype=np.float32)[None]

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np

        return np.asarray(self.proxy, dtype=dtype or np.float32)[None]


def worker_calibrate(job: dict[str, Any]) -> dict[str, Any]:
    """Calibrated halo through ``models.measure.receptive.calibrate_halo`` on the real volume."""
    import torch

    torch.set_num_threads(int(job["threads"]))
    from models.measure.receptive import calibrate_halo

    predictor, _ = build_predictor(job["model"], job)
    data = load_data(job)
    tile = int(job["tile"])
    # A halo must leave a stride of at least one alignment step: tile - 2 * halo >= alignment.
    max_halo = (tile - predictor.alignment) // 2
    start = time.perf_counter()
    cal = calibrate_halo(
        predictor,
        (tile,) * (data.ndim - 1),
        tolerance=float(job["tolerance"]),
        sample=data,
        max_halo=max_halo,
    )
    seconds = time.perf_counter() - start
    errors = {int(h): float(e) for h, e in cal.errors.items()}
    return {
        "halo": int(cal.halo),
        "met": bool(cal.met),
        "error": float(cal.error),
        "errors": errors,
        "seconds": seconds,
        "max_halo": max_halo,
        "forward_passes": predictor.items,
    }


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import numpy as np
    import torch

    torch.set_num_threads(int(job["threads"]))
    if job["kind"] == "calibrate":
        print(RESULT_PREFIX + json.dumps(worker_calibrate(job)), flush=True)
        return 0
    if job["kind"] == "inprocess":
        print(RESULT_PREFIX + json.dumps(worker_inprocess(job)), flush=True)
        return 0
    if job["kind"] == "memplan":
        from benchmarks.memplan import worker_memplan

        print(RESULT_PREFIX + json.dumps(worker_memplan(job)), flush=True)
        return 0
    predictor, meta = build_predictor(job["model"], job)
    data = load_data(job)
    run, warm = make_runner(job, predictor, data, meta)
    start = time.perf_counter()
    warm()
    warm_s = time.perf_counter() - start
    times: list[float] = []
    peaks: list[int] = []
    passes: list[int] = []
    y: Any = None
    for _ in range(int(job["repeats"])):
        y = None
        gc.collect()
        predictor.items = predictor.voxels = 0
        with AnonPeak() as mem:
            t0 = time.perf_counter()
            y = run()
            dt = time.perf_counter() - t0
        times.append(dt)
        peaks.append(mem.above_base)
        passes.append(predictor.items)
    out = to_numpy(y)
    counted = True  # Model.run's own predictor is counted through a proxy (contenders.CountingProxy)
    result: dict[str, Any] = {
        "times_s": times,
        "time_s": statistics.median(times),
        "min_s": min(times),
        "peaks_bytes": peaks,
        "peak_mb": statistics.median(peaks) / MB,
        "forward_passes": passes[-1] if counted else None,
        "warmup_s": warm_s,
        "work": predictor.voxels / float(np.prod(data.shape[1:])) if counted else None,
        "out_shape": list(out.shape),
        "out_max_abs": float(np.abs(out).max()),
        "voxels": int(np.prod(data.shape[1:])),
    }
    if "plan" in meta:
        result["plan"] = meta["plan"]
    if job.get("save"):
        np.save(job["save"], out)
    if job.get("reference"):
        ref = np.load(job["reference"], mmap_mode="r")
        result["max_abs"], result["mean_abs"] = abs_diff(out, ref)
    if job.get("disagreement"):
        result.update(tile_disagreement(predictor, data, job))
    if job.get("profile"):
        result["profile"] = profile_run(run, Path(job["profile"]))
    del y, out
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def worker_inprocess(job: dict[str, Any]) -> dict[str, Any]:
    """The service case in process: ``service.pipeline.run_file`` (decode, ``Model.run``, encode),
    the very function the server's executor calls, minus HTTP."""
    import torch

    torch.set_num_threads(int(job["threads"]))
    from models.planning.params import parse_params
    from models.repository import ModelRepository
    from service.pipeline import run_file

    model = ModelRepository(job["models_dir"], device="cpu").get(job["model_name"])
    params = parse_params(job["query"])
    out_dir = Path(job["out_path"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(2):  # warm-up on a one-tile volume (TorchScript profiles its first calls)
        run_file(model, Path(job["warm_data"]), out_dir / "warm", params)
    times = []
    for i in range(int(job["repeats"])):
        t0 = time.perf_counter()
        result = run_file(model, Path(job["data"]), out_dir / f"out{i}", params)
        times.append(time.perf_counter() - t0)
    return {
        "times_s": times,
        "time_s": statistics.median(times),
        "out_shape": list(result.output_shape),
        "forward_passes": result.n_tiles,
    }

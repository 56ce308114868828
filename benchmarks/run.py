#!/usr/bin/env python
"""tilewise benchmarks: side by side with MONAI, TorchIO and the whole-image pass (issue 7).

Run ``python benchmarks/run.py`` (full, about 20 minutes on 2 cores) or ``--quick`` (under 2
minutes, what the CI smoke test runs). Every contender of every case runs in a fresh subprocess
(``run.py --worker JOB.json``) with ``torch.set_num_threads`` fixed, is warmed up on the shapes it
will see, then timed over ``--repeats`` runs (median reported). Peak memory is the peak of the
process's anonymous resident memory (``RssAnon`` in ``/proc/self/status``, sampled by a thread every
2 ms) above its level just before the call, so it counts buffers and outputs held in RAM but not the
input already loaded, nor an on-disk (memory-mapped) output, whose pages are file-backed. The
workers run with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed buffers go back to the system and
each run starts from the same level. The seam error is the max / mean abs difference to the
whole-image output (one forward pass over the image zero-padded to the network's alignment).

Outputs (``--out``, default ``benchmarks/out``): ``results.json``, ``results.md`` (the Markdown
tables and the targets, also printed) and ``speed_vs_seam.png`` (needs matplotlib).

Cases (see ``--cases``): ``3d`` and ``instance`` (MNI152 T1 through a fixed-seed MONAI BasicUNet,
batch norm in eval mode, and instance norm), ``sweep`` (time against seam error), ``shallow`` (analytic
Laplacian of Gaussian with ``halo="auto"``), ``2d`` (RG1_UNCR.dcm through ``text-det-2d``),
``scaling`` (64^3 to 384^3, in memory and on-disk ``out`` against MONAI) and ``service`` (HTTP
against in process). A contender whose package is missing (MONAI, TorchIO, the ONNX file, the
service) is skipped with a message, not failed.

Source: none (original).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT_PREFIX = "RESULT "
UNET_FEATURES = (8, 8, 16, 32, 64, 8)
UNET_ALIGNMENT = 16  # BasicUNet has four 2x poolings
TEXT_DET = "text-det-2d"
MB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """Sizes and contender sets of one benchmark mode."""

    name: str
    spacing_mm: float  # MNI152 (1 mm) resampled to this voxel size for the 3D case
    tile: int
    halo: int
    repeats: int
    sweep_repeats: int
    torchio_modes: tuple[str, ...]
    instance_torchio_modes: tuple[str, ...]
    monai_modes: tuple[str, ...]
    sweep_halos: tuple[int, ...]
    sweep_overlaps: tuple[float, ...]
    auto_tolerances: tuple[float, ...]
    shallow_tiles: tuple[int, ...]
    interleave_cases: tuple[str, ...]  # cases whose timed runs go round robin over contenders
    scaling_sizes: tuple[int, ...]
    scaling_kinds: tuple[str, ...]
    scaling_tile: int
    scaling_halo: int
    tile2d: int
    halo2d: int
    cases: tuple[str, ...]


FULL = Mode(
    name="full",
    spacing_mm=1.75,
    tile=96,
    halo=12,
    repeats=3,
    sweep_repeats=1,
    torchio_modes=("crop", "average", "hann"),
    instance_torchio_modes=("hann",),
    monai_modes=("constant", "gaussian"),
    sweep_halos=(0, 8, 16, 32),
    sweep_overlaps=(0.5, 0.75),
    auto_tolerances=(1e-3, 1e-5),
    shallow_tiles=(64, 96),
    interleave_cases=("3d-batch",),
    scaling_sizes=(64, 128, 192, 256, 384),
    scaling_kinds=("memory", "disk", "monai"),
    scaling_tile=96,
    scaling_halo=12,
    tile2d=512,
    halo2d=64,
    # Cases in order of priority (--max-minutes skips what is left when time runs out).
    cases=("3d", "shallow", "scaling", "service", "sweep", "instance", "2d"),
)
QUICK = Mode(
    name="quick",
    spacing_mm=3.0,
    tile=48,
    halo=8,
    repeats=3,
    sweep_repeats=1,
    torchio_modes=("crop",),
    instance_torchio_modes=("crop",),
    monai_modes=("constant",),
    sweep_halos=(),
    sweep_overlaps=(),
    auto_tolerances=(),
    shallow_tiles=(48,),
    interleave_cases=(),
    scaling_sizes=(48, 64),
    scaling_kinds=("disk", "monai"),
    scaling_tile=48,
    scaling_halo=8,
    tile2d=512,
    halo2d=64,
    cases=("3d", "shallow", "scaling"),
)


def aligned_stride(tile: int, halo: int, alignment: int, overlap: int = 0) -> int:
    """tilewise's stride: ``(tile - 2 * halo - overlap)`` rounded down to the alignment."""
    return (tile - 2 * halo - overlap) // alignment * alignment


def monai_passes(shape: Sequence[int], tile: int, overlap: float) -> int:
    """Windows of MONAI's ``sliding_window_inference`` (its ``_get_scan_interval`` arithmetic)."""
    interval = max(1, int(tile * (1 - overlap)))
    return math.prod(1 if n <= tile else -(-(n - tile) // interval) + 1 for n in shape)


def monai_overlap_for(tile: int, stride: int) -> float:
    """The MONAI ``overlap`` fraction whose scan interval ``int(tile * (1 - overlap))`` is ``stride``."""
    overlap = 1.0 - (stride + 0.5) / tile
    if int(tile * (1.0 - overlap)) != stride:  # pragma: no cover - arithmetic guard
        raise ValueError(f"no MONAI overlap gives stride {stride} for tile {tile}")
    return overlap


# --------------------------------------------------------------------------------------------
# Memory sampling (worker side)
# --------------------------------------------------------------------------------------------


def rss_anon() -> int:
    """Anonymous resident memory of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AnonPeak:
    """Context manager: peak ``RssAnon`` above the level at entry, sampled by a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> AnonPeak:
        self.base = rss_anon()
        self.peak = self.base
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, rss_anon())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def above_base(self) -> int:
        return max(0, self.peak - self.base)


# --------------------------------------------------------------------------------------------
# Networks (worker side)
# --------------------------------------------------------------------------------------------


class Counted:
    """Wraps a predictor and counts the tiles (batch items) it sees."""

    def __init__(
        self, fn: Callable[[Any], Any], *, spatial_dims: int, in_channels: int, alignment: int
    ) -> None:
        self.fn = fn
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.alignment = alignment
        self.scale = 1
        self.receptive_field = None
        self.items = 0
        self.voxels = 0

    def __call__(self, batch: Any) -> Any:
        self.items += int(batch.shape[0])
        self.voxels += int(math.prod(batch.shape[2:])) * int(batch.shape[0])
        return self.fn(batch)


def build_unet(norm: str) -> Any:
    """MONAI's BasicUNet, 3D, features (8, 8, 16, 32, 64, 8), seed 0, eval mode."""
    import torch
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    kwargs: dict[str, Any] = {} if norm == "instance" else {"norm": ("batch", {})}
    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=UNET_FEATURES, **kwargs)
    return net.eval()


class BoxNet:
    """Engine-bound 3D network for the scaling case: ``[mean3x3x3(x), x]`` (2 channels, radius 1)."""

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        return torch.cat([F.avg_pool3d(x, 3, stride=1, padding=1), x], dim=1)


def build_predictor(name: str, job: dict[str, Any]) -> tuple[Counted, dict[str, Any]]:
    """Predictor and metadata (``alignment``, ``out_channels``, ``spatial_dims``) by model name."""
    if name in ("unet-batch", "unet-instance"):
        net = build_unet(name.split("-")[1])
        return Counted(net, spatial_dims=3, in_channels=1, alignment=UNET_ALIGNMENT), {"out_channels": 2}
    if name == "log-3d":
        from models.analytic import AnalyticNet

        net = AnalyticNet("log", 3).eval()
        return Counted(net, spatial_dims=3, in_channels=1, alignment=1), {"out_channels": 1}
    if name == "box-3d":
        return Counted(BoxNet(), spatial_dims=3, in_channels=1, alignment=1), {"out_channels": 2}
    if name == TEXT_DET:
        spec, predictor = load_text_det(Path(job["models_dir"]))
        return Counted(predictor, spatial_dims=2, in_channels=3, alignment=int(spec.alignment)), {
            "out_channels": int(spec.out_channels)
        }
    raise ValueError(f"unknown benchmark model {name!r}")


def load_text_det(models_dir: Path) -> tuple[Any, Any]:
    """The text detector's spec and its raw ONNX predictor (no global-pooling wrapper)."""
    from models.backends import load_predictor
    from models.repository import ModelRepository

    spec = ModelRepository(models_dir, device="cpu").spec(TEXT_DET)
    return spec, load_predictor(spec, "cpu")


# --------------------------------------------------------------------------------------------
# Contenders (worker side)
# --------------------------------------------------------------------------------------------


def pad_to(x: Any, alignment: int) -> tuple[Any, tuple[slice, ...]]:
    """Zero-pad the spatial axes of ``(N, C, *spatial)`` to multiples of ``alignment`` (at the end)."""
    import torch.nn.functional as F

    spatial = x.shape[2:]
    pads: list[int] = []
    for s in reversed(spatial):
        pads += [0, (-s) % alignment]
    crop = tuple(slice(0, s) for s in spatial)
    return (F.pad(x, pads) if any(pads) else x), crop


def make_runner(
    job: dict[str, Any], predictor: Counted, data: Any, meta: dict[str, Any]
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(run, warm_up)`` for one contender; ``run()`` returns ``(C_out, *spatial)`` (numpy or torch)."""
    import numpy as np
    import torch

    kind = job["kind"]
    tile = int(job.get("tile", 0))
    ndim = data.ndim - 1
    align = predictor.alignment
    batch_size = int(job.get("batch_size", 1))

    def warm_tile() -> None:
        with torch.inference_mode():
            predictor(torch.zeros((batch_size, data.shape[0], *([tile] * ndim))))

    if kind == "whole":
        x = torch.from_numpy(np.asarray(data))[None]

        def run() -> Any:
            with torch.inference_mode():
                xp, crop = pad_to(x, align)
                return predictor(xp)[(0, slice(None), *crop)]

        def warm() -> None:
            with torch.inference_mode():
                predictor(pad_to(x, align)[0])

        return run, warm

    if kind == "monai":
        from monai.inferers import sliding_window_inference

        x = torch.from_numpy(np.asarray(data))[None]
        overlap = float(job["overlap"])

        def run() -> Any:
            with torch.inference_mode():
                y = sliding_window_inference(
                    x, [tile] * ndim, batch_size, predictor, overlap=overlap, mode=job["mode"]
                )
            return y[0]

        return run, warm_tile

    if kind == "torchio":
        import torchio as tio

        if ndim != 3:
            raise ValueError("TorchIO's GridSampler is 3D only")
        subject = tio.Subject(image=tio.ScalarImage(tensor=torch.from_numpy(np.asarray(data))))
        patch_overlap = int(job["patch_overlap"])

        def run() -> Any:
            sampler = tio.GridSampler(subject, patch_size=tile, patch_overlap=patch_overlap)
            aggregator = tio.GridAggregator(sampler, overlap_mode=job["mode"])
            patches: list[Any] = []
            locations: list[Any] = []

            def flush() -> None:
                with torch.inference_mode():
                    y = predictor(torch.stack(patches))
                aggregator.add_batch(y, torch.stack(locations))
                patches.clear()
                locations.clear()

            for patch in sampler:
                patches.append(patch["image"][tio.DATA])
                locations.append(torch.as_tensor(patch[tio.LOCATION]))
                if len(patches) == batch_size:
                    flush()
            if patches:
                flush()
            return aggregator.get_output_tensor()

        return run, warm_tile

    if kind == "model-run":
        from models.params import InferenceParams
        from models.repository import ModelRepository

        model = ModelRepository(job["models_dir"], device="cpu").get(job["model_name"])
        options = InferenceParams(
            tile=job.get("model_tile"), halo="auto", halo_tolerance=float(job.get("tolerance", 1e-4))
        )

        def run() -> Any:
            return model.run(data, options)

        def warm() -> None:  # probe the receptive field and calibrate the halo (both cached)
            x = model.preprocess(np.asarray(data))
            plan = model.plan(x.shape[1:], options, sample=x)
            meta["plan"] = {"tile": list(plan.tile), "halo": list(plan.halo)}

        return run, warm

    if kind == "tilewise":
        from tiling import tiled_inference

        out_path = job.get("out_path")
        c_out = int(meta["out_channels"])

        def run() -> Any:
            out = None
            if out_path:
                Path(out_path).unlink(missing_ok=True)
                out = np.lib.format.open_memmap(
                    out_path, mode="w+", dtype=np.float32, shape=(c_out, *data.shape[1:])
                )
            return tiled_inference(
                data,
                predictor,
                tile,
                halo=int(job["halo"]),
                overlap=int(job.get("overlap", 0)),
                blend=job.get("blend", "constant"),
                alignment=align,
                batch_size=batch_size,
                out=out,
            )

        return run, warm_tile

    raise ValueError(f"unknown contender kind {kind!r}")


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
    return np.load(job["data"])


def worker_calibrate(job: dict[str, Any]) -> dict[str, Any]:
    """Calibrated halo through ``models.receptive.calibrate_halo`` on the real volume."""
    import torch

    torch.set_num_threads(int(job["threads"]))
    from models.receptive import calibrate_halo

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
    counted = job["kind"] != "model-run"  # Model.run calls its own predictor, not the counted one
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
    from models.params import parse_params
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


# --------------------------------------------------------------------------------------------
# Data preparation (parent side)
# --------------------------------------------------------------------------------------------


def mni_volume(cache: Path, *, spacing_mm: float | None = None, cube: int | None = None) -> Path:
    """nilearn's MNI152 T1 (1 mm), resampled (linear), z-scored, as ``(1, D, H, W)`` float32 .npy."""
    name = f"mni_{spacing_mm}mm.npy" if cube is None else f"mni_cube{cube}.npy"
    path = cache / name
    if path.exists():
        return path
    import numpy as np
    from nilearn import datasets
    from scipy import ndimage

    img = datasets.load_mni152_template(resolution=1)
    x = np.asarray(img.dataobj, dtype=np.float32)
    if cube is not None:
        zoom = [cube / s for s in x.shape]
    else:
        zoom = [1.0 / float(spacing_mm)] * 3
    y = ndimage.zoom(x, zoom, order=1)
    if cube is not None:
        y = y[:cube, :cube, :cube]
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, y[None])
    tmp.replace(path)
    return path


def radiograph_raw(cache: Path) -> Path:
    """RG1_UNCR.dcm (pydicom-data) as ``(1, H, W)`` float32, inverted (MONOCHROME1) to dark background."""
    path = cache / "rg1_raw.npy"
    if path.exists():
        return path
    import numpy as np
    from pydicom import dcmread
    from pydicom.data import get_testdata_file

    ds = dcmread(get_testdata_file("RG1_UNCR.dcm"))
    x = ds.pixel_array.astype(np.float32)
    if getattr(ds, "PhotometricInterpretation", "") == "MONOCHROME1":
        x = x.max() - x
    np.save(path, x[None])
    return path


def page_raw(cache: Path) -> Path:
    """scikit-image's ``page`` (a scanned text page) upscaled 6x (1146x2304), ``(1, H, W)`` float32."""
    path = cache / "page_x6_raw.npy"
    if path.exists():
        return path
    import numpy as np
    from scipy import ndimage
    from skimage import data as skdata

    x = ndimage.zoom(skdata.page().astype(np.float32), 6, order=1)
    np.save(path, x[None])
    return path


def preprocessed(raw: Path, models_dir: Path, dest: Path) -> Path:
    """``raw`` through text-det-2d's preprocessing (computed each run: the spec decides)."""
    import numpy as np

    from models.preprocess import preprocess
    from models.repository import ModelRepository

    spec = ModelRepository(models_dir, device="cpu").spec(TEXT_DET)
    np.save(dest, np.ascontiguousarray(preprocess(np.load(raw), spec), dtype=np.float32))
    return dest


# --------------------------------------------------------------------------------------------
# Orchestration (parent side)
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    contender: str
    params: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # ok | skipped | failed
    note: str = ""

    def get(self, key: str, default: Any = None) -> Any:
        return self.result.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "contender": self.contender,
            "params": self.params,
            "status": self.status,
            "note": self.note,
            **self.result,
        }


class Bench:
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
        self.have_monai = _importable("monai")
        self.have_torchio = _importable("torchio")

    def over_budget(self) -> bool:
        limit = self.args.max_minutes
        return limit is not None and time.perf_counter() - self.started > 60 * limit

    def log(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:6.0f}s] {msg}", file=sys.stderr, flush=True)

    # -- subprocess -----------------------------------------------------------------------------

    def worker(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        job = {"threads": self.args.threads, "repeats": self.mode.repeats, "batch_size": 1, **job}
        path = self.work / f"job{len(list(self.work.glob('job*.json')))}.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
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

    # -- cases ----------------------------------------------------------------------------------

    def case_instance(self) -> None:
        self.case_3d(variants=("unet-instance",))

    def case_3d(self, variants: Sequence[str] = ("unet-batch",)) -> None:
        m = self.mode
        if not self.have_monai:
            why = "monai not installed (pip install -e '.[bench]'): the U-Net is MONAI's BasicUNet"
            self.notes.append(f"3d and sweep cases skipped: {why}")
            self.add("3d-batch", "all", {}, skip=why)
            return
        data = mni_volume(self.cache, spacing_mm=m.spacing_mm)
        shape = [int(v) for v in _shape(data).split("x")]
        stride = aligned_stride(m.tile, m.halo, UNET_ALIGNMENT)
        from tiling import TileGrid

        tw_passes = TileGrid.plan(shape, m.tile, m.halo, alignment=UNET_ALIGNMENT).n_tiles
        overlap = 0.25
        if monai_passes(shape, m.tile, overlap) != tw_passes:  # fall back to the very same stride
            overlap = monai_overlap_for(m.tile, stride)
        monai_stride = int(m.tile * (1 - overlap))
        patch_overlap = m.tile - monai_stride
        patch_overlap += patch_overlap % 2  # TorchIO wants an even overlap
        self.notes.append(
            f"3D case: MNI152 T1 resampled to {m.spacing_mm} mm ({_shape(data)}), tile {m.tile}. tilewise "
            f"halo {m.halo} with alignment {UNET_ALIGNMENT} gives stride {stride} ({m.tile} - 2 x {m.halo} "
            f"rounded down to {UNET_ALIGNMENT}); MONAI overlap {overlap:.3g} gives stride {monai_stride} and "
            f"TorchIO patch_overlap {patch_overlap} stride {m.tile - patch_overlap}: the same number of "
            f"forward passes ({tw_passes}) on this volume."
        )
        for model in variants:
            case = f"3d-{model.split('-')[1]}"
            ref = self.work / f"ref_{model}.npy"
            base = {"model": model, "data": str(data), "tile": m.tile}
            whole = self.add(case, "whole volume", {**base, "kind": "whole", "save": str(ref)})
            if whole.status != "ok":
                continue
            base["reference"] = str(ref)
            for mode in m.monai_modes:
                self.add(
                    case,
                    f"MONAI {mode}, overlap {overlap:.3g}",
                    {**base, "kind": "monai", "overlap": overlap, "mode": mode},
                    skip=None if self.have_monai else "monai not installed",
                )
            for mode in m.torchio_modes if model == "unet-batch" else m.instance_torchio_modes:
                self.add(
                    case,
                    f"TorchIO {mode}",
                    {**base, "kind": "torchio", "mode": mode, "patch_overlap": patch_overlap},
                    skip=None if self.have_torchio else "torchio not installed",
                )
            self.add(
                case,
                f"tilewise halo {m.halo} (same tile, same passes)",
                {**base, "kind": "tilewise", "halo": m.halo, "disagreement": True},
            )
            if model == "unet-batch":
                cal = self.calibrate(model, data, m.tile, 1e-4)
                if cal is not None:
                    h, met, err = self.halo_for(cal, 1e-4)
                    row = self.add(
                        case,
                        f'tilewise halo="auto" (1e-4 -> {h})',
                        {**base, "kind": "tilewise", "halo": h, "tolerance": 1e-4},
                    )
                    row.result["calibration_s"] = cal["seconds"]
            else:
                cal = self.calibrate(model, data, m.tile, 1e-4)
                if cal is not None:
                    h, met, err = self.halo_for(cal, 1e-4)
                    self.notes.append(
                        f"{model}: halo calibration does not converge for a tile-dependent network: the "
                        f"truncation error at the largest halo tried ({h}) is still {err:.3g} (tolerance "
                        "1e-4); no halo makes instance-norm tiles agree with the whole volume."
                    )

    def case_sweep(self) -> None:
        m = self.mode
        data = mni_volume(self.cache, spacing_mm=m.spacing_mm)
        model = "unet-batch"
        ref = self.work / f"ref_{model}.npy"
        if not ref.exists():
            self.notes.append("sweep skipped: the 3d case did not produce the whole-volume reference")
            return
        base = {
            "model": model,
            "data": str(data),
            "tile": m.tile,
            "reference": str(ref),
            "repeats": m.sweep_repeats,
        }
        for h in m.sweep_halos:
            self.add("sweep", f"tilewise halo {h}", {**base, "kind": "tilewise", "halo": h})
        cal = self.calibrate(model, data, m.tile, 1e-4)
        if cal is not None:
            for tol in m.auto_tolerances:
                h, met, err = self.halo_for(cal, tol)
                row = self.add(
                    "sweep",
                    f'tilewise halo="auto" ({tol:g} -> {h})',
                    {**base, "kind": "tilewise", "halo": h, "tolerance": tol},
                )
                row.result["calibration_s"] = cal["seconds"]
        for ov in m.sweep_overlaps:
            for mode in ("constant", "gaussian"):
                self.add(
                    "sweep",
                    f"MONAI {mode}, overlap {ov:g}",
                    {**base, "kind": "monai", "overlap": ov, "mode": mode},
                    skip=None if self.have_monai else "monai not installed",
                )

    def case_shallow(self) -> None:
        m = self.mode
        data = mni_volume(self.cache, spacing_mm=m.spacing_mm)
        model = "log-3d"
        ref = self.work / f"ref_{model}.npy"
        base = {"model": model, "data": str(data)}
        whole = self.add("shallow", "whole volume", {**base, "kind": "whole", "save": str(ref)})
        if whole.status != "ok":
            return
        base["reference"] = str(ref)
        for tile in m.shallow_tiles:
            cal = self.calibrate(model, data, tile, 1e-5)
            if cal is None:
                continue
            h, met, err = self.halo_for(cal, 1e-5)
            row = self.add(
                "shallow",
                f'tilewise tile {tile}, halo="auto" (1e-5 -> {h})',
                {**base, "kind": "tilewise", "tile": tile, "halo": h, "tolerance": 1e-5},
            )
            row.result["calibration_s"] = cal["seconds"]
        tile = m.shallow_tiles[-1]
        stride = aligned_stride(tile, m.halo, 1)
        if m.name == "full":
            self.add(
                "shallow",
                f"MONAI constant, tile {tile}, same stride as halo {m.halo}",
                {
                    **base,
                    "kind": "monai",
                    "mode": "constant",
                    "tile": tile,
                    "overlap": monai_overlap_for(tile, stride),
                },
                skip=None if self.have_monai else "monai not installed",
            )
        self.notes.append(
            "shallow case: `log-3d` (models.analytic, radius 8) on the 3D case's volume; tile 64 is the "
            "model's default plan."
        )

    def case_2d(self) -> None:
        m = self.mode
        models_dir = Path(self.args.models).expanduser()
        why = text_det_missing(models_dir)
        if why:
            self.notes.append(f"2d case skipped: {why}")
            self.log(f"2d case skipped: {why}")
            self.add("2d", "all", {}, skip=why)
            return
        images = [("2d-radiograph", radiograph_raw(self.cache))]
        if _importable("skimage"):
            images.append(("2d-page", page_raw(self.cache)))
        stride = aligned_stride(m.tile2d, m.halo2d, 32)
        overlap = 0.25 if int(m.tile2d * 0.75) == stride else monai_overlap_for(m.tile2d, stride)
        for case, raw in images:
            data = preprocessed(raw, models_dir, self.work / f"{case}.npy")
            ref = self.work / f"ref_{case}.npy"
            base = {"model": TEXT_DET, "data": str(data), "tile": m.tile2d, "models_dir": str(models_dir)}
            whole = self.add(case, "whole image", {**base, "kind": "whole", "save": str(ref)})
            if whole.status != "ok":
                continue
            base["reference"] = str(ref)
            for mode in ("constant", "gaussian"):
                self.add(
                    case,
                    f"MONAI {mode}, overlap {overlap:.3g}",
                    {**base, "kind": "monai", "overlap": overlap, "mode": mode},
                    skip=None if self.have_monai else "monai not installed",
                )
            self.add(
                case,
                f"tilewise halo {m.halo2d} (same stride)",
                {**base, "kind": "tilewise", "halo": m.halo2d},
            )
            self.add(
                case,
                'tilewise Model.run: default plan, halo="auto" (1e-3), whole-image pooling context',
                {**base, "kind": "model-run", "model_name": TEXT_DET, "tolerance": 1e-3, "data": str(raw)},
            )
            self.notes.append(
                f"{case}: {'RG1_UNCR.dcm (pydicom-data)' if 'radio' in case else 'skimage page x6'} "
                f"({_shape(data)}) through {TEXT_DET}; MONAI and `tilewise halo {m.halo2d}` call the raw "
                "ONNX network on each tile (its squeeze-excitation pools over the tile only); "
                f"tile {m.tile2d}, stride {stride} for both. `Model.run` is the product path (spec "
                "preprocessing, whole-image pooling context, calibrated halo)."
            )

    def case_scaling(self) -> None:
        m = self.mode
        stride = aligned_stride(m.scaling_tile, m.scaling_halo, 1)  # box-3d needs no alignment
        overlap = monai_overlap_for(m.scaling_tile, stride)
        self.notes.append(
            f"scaling case: MNI152 resampled to N^3, network `box-3d` ([mean3x3x3(x), x], 2 channels, "
            f"alignment 1: engine-bound, so the time is mostly tiling overhead), tile {m.scaling_tile}, "
            f"halo {m.scaling_halo}: stride {stride}; MONAI at the same stride (overlap {overlap:.3g}), so "
            "both make the same passes. The on-disk contender reads a memory-mapped .npy and writes a "
            "memory-mapped .npy."
        )
        for n in m.scaling_sizes:
            data = mni_volume(self.cache, cube=n)
            base = {"model": "box-3d", "data": str(data), "tile": m.scaling_tile, "size": n}
            if "memory" in m.scaling_kinds:
                self.add(
                    "scaling",
                    f"tilewise in memory {n}^3",
                    {**base, "kind": "tilewise", "halo": m.scaling_halo},
                )
            if "disk" in m.scaling_kinds:
                self.add(
                    "scaling",
                    f"tilewise on-disk out {n}^3",
                    {
                        **base,
                        "kind": "tilewise",
                        "halo": m.scaling_halo,
                        "input": "disk",
                        "out_path": str(self.work / f"scaling_out_{n}.npy"),
                    },
                )
                (self.work / f"scaling_out_{n}.npy").unlink(missing_ok=True)
            if "monai" in m.scaling_kinds:
                self.add(
                    "scaling",
                    f"MONAI constant {n}^3",
                    {**base, "kind": "monai", "mode": "constant", "overlap": overlap},
                    skip=None if self.have_monai else "monai not installed",
                )

    def case_service(self) -> None:
        m = self.mode
        why = service_missing()
        if why:
            self.notes.append(f"service case skipped: {why}")
            self.add("service", "all", {}, skip=why)
            return
        self.service_case(m)

    def service_case(self, m: Mode) -> None:
        import nibabel as nib
        import numpy as np

        models_dir = self.work / "service-models"
        models_dir.mkdir(exist_ok=True)
        name = "bench-unet-3d"
        try:
            write_unet_spec(models_dir, name)
        except Exception as exc:  # noqa: BLE001 - any export problem skips the case with its reason
            self.add("service", "all", {}, skip=f"cannot write the U-Net model spec: {exc}")
            return
        vol = np.load(mni_volume(self.cache, spacing_mm=m.spacing_mm))[0]
        affine = np.diag([m.spacing_mm] * 3 + [1.0])
        nii = self.work / "service_in.nii"
        nib.save(nib.Nifti1Image(vol, affine), nii)
        warm = self.work / "service_warm.nii"
        nib.save(nib.Nifti1Image(np.ascontiguousarray(vol[: m.tile, : m.tile, : m.tile]), affine), warm)
        query = {"tile": str(m.tile), "halo": str(m.halo), "overlap": "0", "format": "nii"}
        params = {"model": name, "tile": m.tile, "halo": m.halo, "format": "nii"}
        row = self.add(
            "service",
            "in process (service.pipeline.run_file)",
            {
                **params,
                "kind": "inprocess",
                "model_name": name,
                "models_dir": str(models_dir),
                "data": str(nii),
                "warm_data": str(warm),
                "query": query,
                "out_path": str(self.work / "inproc_out"),
            },
        )
        if row.status != "ok":
            return
        port = _free_port()
        log = open(self.work / "serve.log", "w")  # noqa: SIM115 - closed in finally
        env = {**self.env, "TILEWISE_MODELS_DIR": str(models_dir)}
        cmd = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--models",
            str(models_dir),
        ]
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        srow = Row("service", "HTTP POST /v1/models/{name}/infer", params)
        self.rows.append(srow)
        try:
            url = f"http://127.0.0.1:{port}"
            if not _wait_ready(url, server, timeout=120):
                srow.status, srow.note = "failed", "server not ready: " + _tail(self.work / "serve.log")
                return
            body = nii.read_bytes()
            target = f"{url}/v1/models/{name}/infer?" + "&".join(f"{k}={v}" for k, v in query.items())
            for _ in range(2):  # warm-up, as in process
                _post(target, warm.read_bytes())
            times = []
            size = 0
            for _ in range(m.repeats):
                t0 = time.perf_counter()
                size = len(_post(target, body))
                times.append(time.perf_counter() - t0)
            srow.result = {
                "times_s": times,
                "time_s": statistics.median(times),
                "response_bytes": size,
                "request_bytes": len(body),
            }
            self.log(f"service / HTTP: {srow.result['time_s']:.2f} s")
        except (OSError, urllib.error.URLError) as exc:
            srow.status, srow.note = "failed", f"{exc}: " + _tail(self.work / "serve.log")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
            log.close()

    # -- reporting ------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Targets, tables, plot
# --------------------------------------------------------------------------------------------


def _find(rows: Sequence[Row], case: str, prefix: str) -> Row | None:
    return next(
        (r for r in rows if r.case == case and r.contender.startswith(prefix) and r.status == "ok"), None
    )


def evaluate_targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value, the threshold and whether it is met."""
    out: list[dict[str, Any]] = []
    tw = _find(rows, "3d-batch", "tilewise halo")
    for mode in ("constant", "gaussian"):
        mo = _find(rows, "3d-batch", f"MONAI {mode}")
        if tw is None or mo is None:
            continue
        t = tw.get("time_s") / mo.get("time_s")
        p = tw.get("peak_mb") / max(mo.get("peak_mb"), 1e-9)
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: time <= 0.9x",
                "value": round(t, 3),
                "threshold": 0.9,
                "met": t <= 0.9,
            }
        )
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: peak memory <= 0.5x",
                "value": round(p, 3),
                "threshold": 0.5,
                "met": p <= 0.5,
            }
        )
        out.append(
            {
                "target": f"same tile and stride vs MONAI {mode}: smaller seam error (max abs)",
                "value": f"{tw.get('max_abs'):.3g} vs {mo.get('max_abs'):.3g}",
                "threshold": "<",
                "met": tw.get("max_abs") < mo.get("max_abs"),
            }
        )
    points = seam_points(rows)
    monai_pts = [p for p in points if p[0] == "MONAI"]
    tw_pts = [p for p in points if p[0] == "tilewise"]
    if monai_pts and tw_pts:
        undominated = [p[1] for p in monai_pts if not any(q[2] <= p[2] and q[3] <= p[3] for q in tw_pts)]
        out.append(
            {
                "target": "every MONAI point dominated by a tilewise point (no slower, no larger seam)",
                "value": f"{len(monai_pts) - len(undominated)}/{len(monai_pts)} dominated"
                + (f"; not: {', '.join(undominated)}" if undominated else ""),
                "threshold": "all",
                "met": not undominated,
            }
        )
    sh = _find(rows, "shallow", "tilewise")
    wh = _find(rows, "shallow", "whole")
    if sh is not None and wh is not None:
        out.append(
            {
                "target": 'shallow net (log-3d), halo="auto": seam error <= 1e-5',
                "value": f"{sh.get('max_abs'):.3g}",
                "threshold": 1e-5,
                "met": sh.get("max_abs") <= 1e-5,
            }
        )
        r = sh.get("time_s") / wh.get("time_s")
        out.append(
            {
                "target": 'shallow net (log-3d), halo="auto": time <= 1.3x whole volume',
                "value": round(r, 3),
                "threshold": 1.3,
                "met": r <= 1.3,
            }
        )
    disk = {
        r.params.get("size"): r
        for r in rows
        if r.case == "scaling" and "on-disk" in r.contender and r.status == "ok"
    }
    monai = {
        r.params.get("size"): r
        for r in rows
        if r.case == "scaling" and "MONAI" in r.contender and r.status == "ok"
    }
    sizes = sorted(disk)
    if len(sizes) >= 2:
        lo = 128 if 128 in disk else sizes[0]
        hi = sizes[-1]
        g = disk[hi].get("peak_mb") / max(disk[lo].get("peak_mb"), 1e-9)
        detail = f"{disk[lo].get('peak_mb'):.0f} MB at {lo}^3 -> {disk[hi].get('peak_mb'):.0f} MB at {hi}^3"
        if lo in monai and hi in monai:
            gm = monai[hi].get("peak_mb") / max(monai[lo].get("peak_mb"), 1e-9)
            detail += (
                f"; MONAI {monai[lo].get('peak_mb'):.0f} -> {monai[hi].get('peak_mb'):.0f} MB ({gm:.1f}x)"
            )
        out.append(
            {
                "target": f"on-disk out: peak memory grows < 1.3x from {lo}^3 to {hi}^3",
                "value": f"{g:.2f}x ({detail})",
                "threshold": 1.3,
                "met": g < 1.3,
            }
        )
    inproc = _find(rows, "service", "in process")
    http = _find(rows, "service", "HTTP")
    if inproc is not None and http is not None:
        r = http.get("time_s") / inproc.get("time_s")
        out.append(
            {
                "target": "service overhead <= 10% over in process",
                "value": f"{100 * (r - 1):.1f}%",
                "threshold": "10%",
                "met": r <= 1.1,
            }
        )
    return out


def seam_points(rows: Sequence[Row]) -> list[tuple[str, str, float, float]]:
    """``(tool, label, time_s, max_abs)`` of the U-Net (batch norm) runs for the speed/seam plot."""
    pts = []
    for r in rows:
        if r.status != "ok" or r.case not in ("3d-batch", "sweep") or "max_abs" not in r.result:
            continue
        tool = (
            "MONAI"
            if r.contender.startswith("MONAI")
            else "tilewise"
            if r.contender.startswith("tilewise")
            else "TorchIO"
            if r.contender.startswith("TorchIO")
            else ""
        )
        if tool:
            pts.append((tool, r.contender, float(r.get("time_s")), float(r.get("max_abs"))))
    return pts


def plot_speed_vs_seam(rows: Sequence[Row], path: Path) -> Path | None:
    pts = seam_points(rows)
    if not pts:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colours = {"tilewise": "tab:blue", "MONAI": "tab:red", "TorchIO": "tab:green"}
    markers = {"tilewise": "o", "MONAI": "s", "TorchIO": "^"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    floor = 1e-9
    for tool in colours:
        sel = [p for p in pts if p[0] == tool]
        if not sel:
            continue
        ax.scatter(
            [p[2] for p in sel],
            [max(p[3], floor) for p in sel],
            c=colours[tool],
            marker=markers[tool],
            label=tool,
            s=40,
        )
        for p in sel:
            label = p[1].replace("tilewise ", "").replace("MONAI ", "").replace("TorchIO ", "")
            ax.annotate(
                label, (p[2], max(p[3], floor)), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
    whole = _find(rows, "3d-batch", "whole")
    if whole is not None:
        ax.axvline(whole.get("time_s"), color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            "whole volume (no seams)",
            (whole.get("time_s"), 0.5),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            color="grey",
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_yscale("log")
    ax.set_xlabel("wall time (s, median)")
    ax.set_ylabel("seam error: max abs difference to the whole volume")
    ax.set_title("3D U-Net (BasicUNet, batch norm): speed against seam error")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"## tilewise benchmarks ({report['mode']} mode)", ""]
    mach = report["machine"]
    lines.append(
        f"Machine: {mach['cpu']} x {mach['nproc']} cores, {mach['ram_gb']:.0f} GB RAM, {mach['os']}; "
        f"load average at the end {mach['loadavg']}. Threads: {report['config']['threads']}; "
        f"median of {report['config']['repeats']} runs (sweep: {report['config']['sweep_repeats']})."
    )
    lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".")
    lines.append("")
    lines.append(
        "Columns: passes = tiles through the network (last run); work = voxels fed to the network / image "
        "voxels; time = median wall time (min s: the fastest run); x whole = time / the whole-image pass "
        "of the same case; peak MB = peak RssAnon above the level before the call (median over runs); "
        "max/mean abs diff = to the whole-image output (the seam error)."
    )
    lines.append("")
    cases: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        cases.setdefault(r["case"], []).append(r)
    header = (
        "| contender | passes | work | time s | min s | x whole | us/voxel | peak MB | max abs diff | "
        "mean abs diff | note |"
    )
    for case, rs in cases.items():
        lines += [f"### {case}", "", header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rs:
            note = r.get("note", "")
            if r["status"] != "ok":
                note = f"{r['status']}: {note}"
            extra = []
            if "tile_disagreement_max" in r:
                extra.append(
                    f"tile disagreement max {r['tile_disagreement_max']:.3g} / mean "
                    f"{r['tile_disagreement_mean']:.3g}"
                )
            if "plan" in r:
                extra.append(
                    f"tile {r['plan']['tile']}, calibrated halo {r['plan']['halo']}; warm-up "
                    f"(receptive-field probe + halo calibration) {r['warmup_s']:.1f} s"
                )
            if "calibration_s" in r:
                extra.append(f"calibration {r['calibration_s']:.1f} s (once per model and tile)")
            if "times_s" in r and len(r["times_s"]) > 1:
                order = " (interleaved with the other contenders)" if r.get("interleaved") else ""
                extra.append("runs " + "/".join(f"{t:.2f}" for t in r["times_s"]) + order)
            note = "; ".join(filter(None, [note.replace("|", "/"), *extra]))
            lines.append(
                f"| {r['contender']} | {r.get('forward_passes') or '-'} | {_fmt(r.get('work'), '.2f')} | "
                f"{_fmt(r.get('time_s'), '.2f')} | {_fmt(r.get('min_s'), '.2f')} | "
                f"{_fmt(r.get('ratio_whole'), '.2f')} | {_fmt(r.get('us_per_voxel'), '.2f')} | "
                f"{_fmt(r.get('peak_mb'), '.0f')} | {_fmt(r.get('max_abs'), '.3g')} | "
                f"{_fmt(r.get('mean_abs'), '.3g')} | {note} |"
            )
        lines.append("")
    if report["targets"]:
        lines += ["### Targets", "", "| target | measured | threshold | met |", "|---|---|---|---|"]
        for t in report["targets"]:
            lines.append(
                f"| {t['target']} | {t['value']} | {t['threshold']} | {'yes' if t['met'] else 'NO'} |"
            )
        lines.append("")
    if report["notes"]:
        lines += ["### Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines.append(f"Total benchmark time: {report['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Environment helpers
# --------------------------------------------------------------------------------------------


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _shape(path: Path) -> str:
    import numpy as np

    return "x".join(str(s) for s in np.load(path, mmap_mode="r").shape[1:])


def text_det_missing(models_dir: Path) -> str | None:
    try:
        from models.textdet import TEXT_DET_FILE
    except ImportError as exc:
        return f"models package without text-det-2d support ({exc})"
    if not (models_dir / TEXT_DET_FILE).is_file():
        return f"{models_dir / TEXT_DET_FILE} is missing: run `tilewise setup-models` first"
    if not _importable("onnxruntime"):
        return "onnxruntime is not installed"
    return None


def service_missing() -> str | None:
    for mod in ("service.app", "service.commands.serve", "models.repository"):
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001 - any import problem means "not there yet"
            return f"{mod} cannot be imported ({type(exc).__name__}: {exc})"
    return None


def write_unet_spec(models_dir: Path, name: str) -> None:
    """TorchScript of the batch-norm U-Net plus its spec YAML, for the service case."""
    import torch
    import yaml

    net = build_unet("batch")
    torch.jit.script(net).save(str(models_dir / f"{name}.pt"))
    spec = {
        "name": name,
        "backend": "torchscript",
        "file": f"{name}.pt",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "alignment": UNET_ALIGNMENT,
        "scale": 1,
        "output": {"activation": "none", "kind": "probabilities", "dtype": "float32"},
        "defaults": {"tile": 96, "halo": 12, "overlap": 0, "blend": "constant", "batch_size": 1},
    }
    (models_dir / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[Any], timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    return False


def _post(url: str, body: bytes) -> bytes:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return bytes(resp.read())


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text().strip().splitlines()[-n:])
    except OSError:
        return ""


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    ram = 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) / 1024 / 1024
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gb": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "monai", "torchio", "onnxruntime", "nilearn", "scipy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out["tilewise commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    return out


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small volumes and few contenders (under 2 minutes)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="folder for results.json/.md/.png")
    p.add_argument("--cache", default="~/.cache/tilewise/bench", help="folder for the prepared volumes")
    p.add_argument("--models", default="~/.cache/tilewise/models", help="model folder holding text-det-2d")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per contender (median reported)")
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated subset of: 3d,shallow,scaling,service,sweep,2d,instance",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="skip the contenders left when this much time has passed (cases run in priority order)",
    )
    p.add_argument("--profile", action="store_true", help="torch-profile the 3D contenders (one more run)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="seconds per worker before it is killed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a mode field, e.g. --set spacing_mm=2.0 --set 'scaling_sizes=[64,128]'",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    mode = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in Mode.__dataclass_fields__:
            print(
                f"--set: unknown field {key!r}; known: {', '.join(Mode.__dataclass_fields__)}",
                file=sys.stderr,
            )
            return 2
        parsed = json.loads(value) if value[:1] in "[{0123456789-tfn" else value
        overrides[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    if args.repeats is not None:
        overrides["repeats"] = max(1, args.repeats)
    mode = Mode(**{**mode.__dict__, **overrides})
    cases = tuple(c.strip() for c in args.cases.split(",")) if args.cases else mode.cases
    bench = Bench(args, mode)
    bench.log(f"mode {mode.name}, cases {', '.join(cases)}, threads {args.threads}, work {bench.work}")
    for case in cases:
        method = getattr(bench, f"case_{case}", None)
        if method is None:
            print(f"unknown case {case!r}", file=sys.stderr)
            return 2
        method()
        bench.run_pending_rounds()
    bench.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dask scaling and per-worker memory of ``tiling.distributed.tiled_inference_dask``.

A random float32 volume (default 384^3, 216 MiB) is written to a zarr array on disk (chunks of
``--chunk``) and run through a cheap conv stack (two 3x3x3 convolutions, 1 -> 2 -> 1 channels, tanh;
receptive radius 2) on a ``LocalCluster`` of 1 and then 2 worker processes (one thread each), into
zarr arrays on disk. ``--tile`` sets the tile inside each block (default: one tile per block; on CPU
PyTorch's Conv3d then unfolds a whole block, 27 * 2 * 4 bytes per voxel); ``--blocks-from`` how the
blocks are built (``read`` from the zarr array, the default for zarr inputs, or ``map_overlap``).

Reported per run: wall time of the call (probe, plugin registration and the cluster run; the cluster
start is not counted), the workers' CPU seconds (on a shared machine the wall time says more about
the other processes than about Dask), and per worker the peak resident memory during the run
(``VmHWM`` of ``/proc/<pid>/status``, reset through ``/proc/<pid>/clear_refs`` just before the run)
and its rise over the resident memory just before the run (after a warm-up run on a two-chunk
array, so imports and torch's first-call allocations are in the baseline). With ``--sizes 192 384``
the volume grows 8x at the same chunk: a worker's memory that follows the chunk stays put, one that
followed the volume would grow 8x.

Checks: the 1- and 2-worker outputs are identical, and a corner of the output equals a whole-array
pass over that corner (with a margin of the receptive radius on its inner sides) within 1e-5.
``--max-rise-fraction F`` exits 1 when a worker's rise exceeds ``F`` times the volume's bytes.

``--via tilewise`` measures the path of ``tilewise infer --dask`` and of cluster jobs instead:
a tilewise model (``--model``, default the built-in ``gaussian-3d``, radius 8) built on each worker
by :class:`service.cluster.WorkerModel`, one tiled pass of its plan (``--tile``, halo = its
receptive-field radius) through :class:`service.cluster.DaskPass` (zarr copy of the preprocessed
volume, ``tiled_inference_dask``, output read back into this process). The corner check then
compares with the model's own in-process :meth:`models.Model.execute` over the corner.

    python benchmarks/dask_scaling.py --tile 48               # 384^3, chunk 96, 1 and 2 workers
    python benchmarks/dask_scaling.py --sizes 192 384 --tile 48 --workers 2 --max-rise-fraction 0.5
    python benchmarks/dask_scaling.py --via tilewise --tile 64   # gaussian-3d through DaskPass

Output: one line per run on stdout and ``--json PATH``. Needs the ``distributed`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

MiB = 2**20
RADIUS = 2
ATOL = 1e-5


@dataclass(frozen=True)
class ConvFactory:
    """The benchmark's predictor: two seeded 3x3x3 convolutions (receptive radius 2), one thread."""

    hidden: int = 2
    seed: int = 0

    def __call__(self) -> nn.Module:
        torch.set_num_threads(1)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            net = nn.Sequential(
                nn.Conv3d(1, self.hidden, 3, padding=1), nn.Tanh(), nn.Conv3d(self.hidden, 1, 3, padding=1)
            )
        return net.eval()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """On a worker: reset the peak RSS (VmHWM) to the current RSS; return the current RSS (KiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _peak() -> int:
    """On a worker: the peak RSS (KiB) since the last reset."""
    return _status_kib("VmHWM")


def _cpu_s() -> float:
    """On a worker: CPU seconds (user + system) this process has used."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_volume(path: Path, size: int, chunk: int) -> Any:
    """A random ``(1, size, size, size)`` float32 zarr array, written slab by slab (seeded)."""
    import zarr

    z = zarr.open_array(str(path), mode="w", shape=(1, size, size, size), chunks=(1, chunk, chunk, chunk),
                        dtype="f4")  # fmt: skip
    rng = np.random.default_rng(0)
    for lo in range(0, size, chunk):
        hi = min(lo + chunk, size)
        z[0, lo:hi] = rng.standard_normal((hi - lo, size, size), dtype=np.float32)
    return z


def write_like(path: Path, x: np.ndarray, chunk: int) -> Any:
    """``x`` as a zarr array at ``path``, chunked ``(C, chunk, chunk, chunk)``."""
    import zarr

    z = zarr.open_array(
        str(path), mode="w", shape=x.shape, chunks=(x.shape[0],) + (chunk,) * 3, dtype=x.dtype
    )
    z[...] = x
    return z


def run_once(z: Any, out: Path, n_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run on a fresh LocalCluster of ``n_workers`` processes; seconds, per-worker memory and CPU."""
    from distributed import Client, LocalCluster

    from tiling.distributed import tiled_inference_dask

    with (
        LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, set_as_default=False) as client,  # type: ignore[no-untyped-call]
    ):  # fmt: skip
        params = {"halo": RADIUS, "tile_shape": args.tile, "chunk_shape": args.chunk,
                  "blocks_from": args.blocks_from, "client": client}  # fmt: skip
        # Warm-up on a small array (imports of zarr, numcodecs, dask.array and tiling in the workers,
        # torch's first-call allocations), so the baseline is a worker that has run this code once.
        warm = write_like(out.with_name(out.name + "-warm-in"), np.zeros((1, 2 * args.chunk, args.chunk,
                          args.chunk), np.float32), args.chunk)  # fmt: skip
        tiled_inference_dask(warm, ConvFactory(), out=out.with_name(out.name + "-warm-out"), **params)
        before, cpu_before = client.run(_reset_peak), client.run(_cpu_s)
        t0 = time.perf_counter()
        tiled_inference_dask(z, ConvFactory(), out=out, **params)
        seconds = time.perf_counter() - t0
        peaks, cpu_after = client.run(_peak), client.run(_cpu_s)
    workers = [
        {
            "rss_before_mib": before[w] / 1024,
            "peak_mib": peaks[w] / 1024,
            "rise_mib": (peaks[w] - before[w]) / 1024,
            "cpu_s": cpu_after[w] - cpu_before[w],
        }
        for w in sorted(peaks)
    ]
    return {"n_workers": n_workers, "seconds": seconds, "workers": workers}


def run_pass(
    x: np.ndarray, root: Path, n_workers: int, args: argparse.Namespace
) -> tuple[dict[str, Any], Any]:
    """``--via tilewise``: one :class:`service.cluster.DaskPass` of a tilewise model's plan over ``x``
    ``(1, *S)`` on a fresh LocalCluster; the run's figures (as :func:`run_once`) and its output."""
    from distributed import Client, LocalCluster

    from service.cluster import DaskPass

    model, plan = _tilewise_plan(x.shape[1:], args)
    with (
        LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, set_as_default=False) as client,  # type: ignore[no-untyped-call]
        DaskPass(client, root, torch_threads=1, chunk=args.chunk) as dask_pass,
    ):  # fmt: skip
        warm = np.zeros((1, 2 * args.chunk, args.chunk, args.chunk), np.float32)  # see run_once
        dask_pass(model, warm, _tilewise_plan(warm.shape[1:], args)[1], None)
        before, cpu_before = client.run(_reset_peak), client.run(_cpu_s)
        t0 = time.perf_counter()
        y = dask_pass(model, x, plan, None)
        seconds = time.perf_counter() - t0
        peaks, cpu_after = client.run(_peak), client.run(_cpu_s)
    workers = [
        {"rss_before_mib": before[w] / 1024, "peak_mib": peaks[w] / 1024,
         "rise_mib": (peaks[w] - before[w]) / 1024, "cpu_s": cpu_after[w] - cpu_before[w]}
        for w in sorted(peaks)
    ]  # fmt: skip
    return {"n_workers": n_workers, "seconds": seconds, "workers": workers, "chunks": dask_pass.chunks_run}, y


def _tilewise_plan(shape: tuple[int, ...], args: argparse.Namespace) -> tuple[Any, Any]:
    from models import ModelRepository
    from models.planning.params import parse_params

    model = ModelRepository("/nonexistent", device="cpu").get(args.model)
    halo = max(model.receptive_field())
    params = parse_params(
        {"tile": str(args.tile or args.chunk), "halo": str(halo), "output": "probabilities"}
    )
    return model, model.plan(shape, params)


def check_pass_corner(x: np.ndarray, y: Any, args: argparse.Namespace, corner: int = 96) -> float:
    """``--via tilewise``: the output's corner against the model's in-process run over that corner
    (with a margin of the receptive radius on its inner sides)."""
    model, _ = _tilewise_plan((1, 1, 1), args)
    margin = max(model.receptive_field())
    part = np.ascontiguousarray(x[:, : corner + margin, : corner + margin, : corner + margin])
    want = model.execute(part, _tilewise_plan(part.shape[1:], args)[1])
    return float(
        np.abs(np.asarray(y)[:, :corner, :corner, :corner] - want[:, :corner, :corner, :corner]).max()
    )


def check_corner(z: Any, out_path: Path, corner: int = 96) -> float:
    """Max abs difference between the output's corner and a whole-array pass over that corner."""
    import zarr

    x = np.asarray(z[:, : corner + RADIUS, : corner + RADIUS, : corner + RADIUS])
    with torch.inference_mode():
        want = ConvFactory()()(torch.from_numpy(x)[None])[0].numpy()[:, :corner, :corner, :corner]
    got = zarr.open_array(str(out_path), mode="r")[:, :corner, :corner, :corner]
    return float(np.abs(got - want).max())


def same_arrays(a: Path, b: Path, slab: int) -> bool:
    """Whether two zarr arrays on disk are equal, compared slab by slab along axis 1."""
    import zarr

    x, y = zarr.open_array(str(a), mode="r"), zarr.open_array(str(b), mode="r")
    return x.shape == y.shape and all(
        np.array_equal(x[:, lo : lo + slab], y[:, lo : lo + slab]) for lo in range(0, x.shape[1], slab)
    )


def report(size: int, args: argparse.Namespace, run: dict[str, Any]) -> str:
    """One line per run for stdout."""
    volume_mib = 4 * size**3 / MiB
    cpu = sum(w["cpu_s"] for w in run["workers"])
    per_worker = ", ".join(f"{w['peak_mib']:.0f} MiB (+{w['rise_mib']:.0f})" for w in run["workers"])
    worst = max(w["rise_mib"] for w in run["workers"])
    via = f"DaskPass({args.model})" if args.via == "tilewise" else args.blocks_from
    return (
        f"{size}^3 ({volume_mib:.0f} MiB), chunk {args.chunk}, tile {args.tile or 'block'}, "
        f"{via}, {run['n_workers']} worker(s): {run['seconds']:.1f} s (worker CPU {cpu:.1f} s); "
        f"per-worker peak RSS {per_worker}; rise / volume = {worst / volume_mib:.2f}; "
        f"corner diff {run['corner_max_abs_diff']:.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; 1 if a check failed."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[384], help="volume edge(s), voxels")
    parser.add_argument("--chunk", type=int, default=96, help="chunk edge, voxels")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run")
    parser.add_argument(
        "--tile", type=int, default=None, help="tile edge, voxels (default: one tile per block)"
    )
    parser.add_argument("--blocks-from", default="auto", choices=["auto", "read", "map_overlap"])
    parser.add_argument("--via", default="tiling", choices=["tiling", "tilewise"],
                        help="tiling: tiled_inference_dask with a conv stack; tilewise: a model through "
                        "service.cluster.DaskPass (tilewise infer --dask)")  # fmt: skip
    parser.add_argument("--model", default="gaussian-3d", help="--via tilewise: the model")
    parser.add_argument("--workdir", type=Path, default=None, help="where the zarr arrays go (a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--max-rise-fraction", type=float, default=None,
                        help="fail when a worker's memory rise exceeds this share of the volume")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(),
                               "load_avg_before": os.getloadavg(), "runs": []}  # fmt: skip
    failed = False
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        for size in args.sizes:
            z = write_volume(root / f"in-{size}.zarr", size, args.chunk)
            outputs = []
            if args.via == "tilewise":
                failed |= _via_tilewise(np.asarray(z[...]), root, size, args, results)
                continue
            for n in args.workers:
                out = root / f"out-{size}-{n}.zarr"
                run = run_once(z, out, n, args)
                run.update(size=size, volume_mib=4 * size**3 / MiB, corner_max_abs_diff=check_corner(z, out))
                results["runs"].append(run)
                outputs.append(out)
                print(report(size, args, run))
                worst = max(w["rise_mib"] for w in run["workers"])
                if run["corner_max_abs_diff"] > ATOL:
                    failed = True
                if args.max_rise_fraction is not None and worst > args.max_rise_fraction * run["volume_mib"]:
                    failed = True
            for other in outputs[1:]:
                if not same_arrays(outputs[0], other, args.chunk):
                    print(f"{other.name} differs from {outputs[0].name}")
                    failed = True
            _print_scaling(size, results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


def _print_scaling(size: int, results: dict[str, Any]) -> None:
    """Print the 1-worker / 2-worker time ratio of ``size`` when both were run."""
    times = {r["n_workers"]: r["seconds"] for r in results["runs"] if r["size"] == size}
    if 1 in times and 2 in times:
        load = results["load_avg_before"][0]
        print(f"{size}^3: time with 1 worker / time with 2 workers = {times[1] / times[2]:.2f} "
              f"(load average before the runs: {load:.1f} on {os.cpu_count()} CPUs)")  # fmt: skip


def _via_tilewise(
    x: np.ndarray, root: Path, size: int, args: argparse.Namespace, results: dict[str, Any]
) -> bool:
    """The ``--via tilewise`` runs of one size; whether a check failed."""
    failed, first = False, None
    for n in args.workers:
        run, y = run_pass(x, root, n, args)
        run.update(size=size, volume_mib=4 * size**3 / MiB, corner_max_abs_diff=check_pass_corner(x, y, args))
        results["runs"].append(run)
        print(report(size, args, run))
        worst = max(w["rise_mib"] for w in run["workers"])
        failed |= run["corner_max_abs_diff"] > ATOL
        failed |= args.max_rise_fraction is not None and worst > args.max_rise_fraction * run["volume_mib"]
        if first is None:
            first = y
        elif not np.array_equal(first, y):
            print(f"{n} workers: the output differs from {args.workers[0]} worker(s)")
            failed = True
    _print_scaling(size, results)
    return failed


if __name__ == "__main__":
    sys.exit(main())

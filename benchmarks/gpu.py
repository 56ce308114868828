"""GPU throughput: tilewise against the whole-volume pass (and MONAI), fp32 and AMP, eager and ONNX
Runtime CUDA (issue 15). Run through ``benchmarks/gpu.sh`` on a machine with CUDA (under 10 minutes).

Network: MONAI's ``BasicUNet`` (3D, batch norm in eval mode, default features (32, 32, 64, 128, 256,
32), fixed seed; alignment 16). Volume: nilearn's MNI152 T1 at 1 mm (197x233x189), z-scored, and the
same volume upsampled 2x on every axis (394x466x378, 69 M voxels) unless ``--quick``. Every contender
goes from a host ``numpy`` array to a host array (copies included), is warmed up once and timed
``--repeats`` times (median, ``torch.cuda.synchronize`` before the clock stops). Throughput is input
voxels per second; ``x whole`` is the contender's time over the whole-volume pass of the same backend
and precision (below 1: faster than one pass over the padded volume). ``max abs`` is the difference to
that pass. ``work`` is voxels fed to the network / input voxels (the plan's :attr:`TileGrid.work`).

Contenders per precision (``fp32``; ``amp``: ``torch.autocast`` float16 for eager, a float16 export
for ONNX Runtime):

- eager whole volume; tilewise tile 96 and 128 (halo 16, alignment 16), batch sizes 1 and 4, prefetch
  on (and off once); MONAI ``sliding_window_inference`` at tile 128, overlap 0.25 (when installed);
- ONNX Runtime with ``CUDAExecutionProvider`` (dynamic axes): whole volume and tilewise tile 128.

``--device cpu`` runs the same script on the CPU with small sizes (a check of the script, not a
benchmark).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.config import ROOT, monai_passes

FEATURES = (32, 32, 64, 128, 256, 32)
ALIGN = 16


def build_net(features: tuple[int, ...]) -> torch.nn.Module:
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=features, norm=("batch", {}))
    return net.eval()


def volume(cache: Path, upsample: int) -> np.ndarray:
    from benchmarks.data import mni_volume

    x = np.load(mni_volume(cache, spacing_mm=1.0))
    if upsample > 1:
        for axis in range(1, 4):
            x = np.repeat(x, upsample, axis=axis)
    return np.ascontiguousarray(x, dtype=np.float32)


def padded_pass(
    fn: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, device: torch.device
) -> np.ndarray:
    """One forward pass over the whole volume, zero-padded to the alignment, host to host."""
    pads: list[int] = []
    for s in reversed(x.shape[1:]):
        pads += [0, -s % ALIGN]
    t = torch.nn.functional.pad(torch.from_numpy(x)[None].to(device), pads)
    y = fn(t)[0]
    return y[(slice(None), *(slice(0, s) for s in x.shape[1:]))].float().cpu().numpy()


def timed(
    run: Callable[[], np.ndarray], repeats: int, device: torch.device
) -> tuple[list[float], np.ndarray, int]:
    """Warm up once, then time ``repeats`` runs; returns (times, last output, peak CUDA bytes)."""
    out = run()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return times, out, peak


def eager_predictor(
    net: torch.nn.Module, amp: bool, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    def predict(batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            return net(batch)

    return predict


def ort_predictor(net: torch.nn.Module, amp: bool, device: torch.device, work: Path) -> tuple[Any, str]:
    """An ONNX Runtime session (CUDA provider on CUDA) over an export with dynamic axes."""
    import onnxruntime as ort

    path = work / f"unet_{'fp16' if amp else 'fp32'}.onnx"
    model = net.half() if amp else net
    dummy = torch.zeros((1, 1, 64, 64, 64), dtype=torch.float16 if amp else torch.float32, device=device)
    axes = {0: "n", 2: "d", 3: "h", 4: "w"}
    with torch.inference_mode():
        torch.onnx.export(model, (dummy,), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": axes, "y": axes}, dynamo=False)  # fmt: skip
    if amp:
        net.float()
    providers = ["CUDAExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), providers=providers)
    got = session.get_providers()[0]
    dtype = np.float16 if amp else np.float32

    def predict(batch: torch.Tensor) -> torch.Tensor:
        (y,) = session.run(None, {"x": batch.detach().cpu().numpy().astype(dtype)})
        return torch.from_numpy(np.asarray(y, dtype=np.float32))

    return predict, got


class Runner:
    """Times contenders and collects one row each."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.rows: list[dict[str, Any]] = []

    def record(
        self,
        label: tuple[str, str, str, str],
        run: Callable[[], np.ndarray],
        ref: np.ndarray | None,
        voxels: int,
        work: float | None,
    ) -> np.ndarray:
        times, y, peak = timed(run, self.repeats, self.device)
        t = statistics.median(times)
        vol, backend, precision, contender = label
        row: dict[str, Any] = {
            "volume": vol,
            "backend": backend,
            "precision": precision,
            "contender": contender,
            "time_s": t,
            "times_s": times,
            "mvox_per_s": voxels / t / 1e6,
            "work": work,
            "peak_gpu_mb": peak / 2**20,
        }
        if ref is not None:
            row["max_abs"] = float(np.abs(y - ref).max())
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return y


def run_volume(
    runner: Runner, net: torch.nn.Module, x: np.ndarray, args: argparse.Namespace, work: Path
) -> None:
    """Every contender on one volume, for both precisions."""
    for precision in ("fp32", "amp"):
        run_precision(runner, net, x, precision, args, work)


def run_precision(
    runner: Runner, net: torch.nn.Module, x: np.ndarray, precision: str, args: argparse.Namespace, work: Path
) -> None:
    """The contenders of one volume and precision (``fp32`` or ``amp``)."""
    from tiling import TileGrid, tiled_inference

    device = runner.device
    cpu = device.type == "cpu"
    tiles = [64] if cpu else [96, 128]
    batches = [1, 2] if cpu else [1, 4]
    vol = "x".join(map(str, x.shape[1:]))
    voxels = int(np.prod(x.shape[1:]))
    whole_work = float(np.prod([-(-s // ALIGN) * ALIGN for s in x.shape[1:]])) / voxels
    big, wide = tiles[-1], batches[-1]
    amp = precision == "amp"
    predict = eager_predictor(net, amp, device)

    def whole() -> np.ndarray:
        with torch.inference_mode():
            return padded_pass(predict, x, device)

    ref = runner.record((vol, "eager", precision, "whole volume"), whole, None, voxels, whole_work)
    for tile in tiles:
        grid = TileGrid.plan(x.shape[1:], tile, 16, alignment=ALIGN)
        for bs in batches if tile == big else [wide]:
            for prefetch in (True, False) if (tile, bs) == (big, wide) else (True,):

                def tiled(t: int = tile, b: int = bs, f: bool = prefetch) -> np.ndarray:
                    y = tiled_inference(x, predict, t, halo=16, alignment=ALIGN, batch_size=b, device=device,
                                        prefetch=f)  # fmt: skip
                    return np.asarray(y)

                name = f"tilewise tile {tile} halo 16 batch {bs}" + ("" if prefetch else " prefetch off")
                runner.record((vol, "eager", precision, name), tiled, ref, voxels, grid.work)
    if importlib.util.find_spec("monai") is not None:
        from monai.inferers import sliding_window_inference

        def monai() -> np.ndarray:
            with torch.inference_mode():
                y = sliding_window_inference(
                    torch.from_numpy(x)[None], [big] * 3, wide, predict, overlap=0.25, sw_device=device,
                    device="cpu",
                )  # fmt: skip
            return np.asarray(y[0].float().numpy())

        monai_work = monai_passes(x.shape[1:], big, 0.25) * big**3 / voxels
        runner.record((vol, "eager", precision, f"MONAI tile {big} overlap 0.25 batch {wide}"), monai, ref,
                      voxels, monai_work)  # fmt: skip
    if args.no_onnx:
        return
    try:
        ort_predict, provider = ort_predictor(net, amp, device, work)
    except Exception as exc:  # noqa: BLE001 - any export or session problem is reported, not fatal
        runner.rows.append(
            {"volume": vol, "backend": "onnxruntime", "precision": precision, "error": str(exc)}
        )
        return
    backend = f"onnxruntime ({provider})"

    def ort_whole() -> np.ndarray:
        return padded_pass(ort_predict, x, torch.device("cpu"))

    def ort_tiled() -> np.ndarray:
        return np.asarray(tiled_inference(x, ort_predict, big, halo=16, alignment=ALIGN, batch_size=wide))

    ort_ref = runner.record((vol, backend, precision, "whole volume"), ort_whole, ref, voxels, whole_work)
    grid = TileGrid.plan(x.shape[1:], big, 16, alignment=ALIGN)
    label = (vol, backend, precision, f"tilewise tile {big} halo 16 batch {wide}")
    runner.record(label, ort_tiled, ort_ref, voxels, grid.work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="the 1 mm volume only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "tilewise-bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out-gpu"))
    p.add_argument("--features", default=",".join(map(str, FEATURES)), help="BasicUNet features")
    p.add_argument("--no-onnx", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: run on a machine with a CUDA build of torch", file=sys.stderr)
        return 2
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tilewise-gpu-"))
    features = tuple(int(f) for f in args.features.split(","))
    net = build_net(features).to(device)
    runner = Runner(device, args.repeats)
    if device.type == "cpu":  # a check of the script: a small crop
        volumes = [volume(cache, 1)[:, :80, :96, :72].copy()]
    else:
        volumes = [volume(cache, 1)] + ([] if args.quick else [volume(cache, 2)])
    for x in volumes:
        run_volume(runner, net, x, args, work)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {"device": str(device), "name": name, "torch": torch.__version__, "features": features,
              "rows": runner.rows}  # fmt: skip
    (out / "gpu.json").write_text(json.dumps(report, indent=2))
    md = render(report)
    (out / "gpu.md").write_text(md)
    print(md)
    return 0


def render(report: dict[str, Any]) -> str:
    """The rows as a Markdown table, with each contender's time over its whole-volume pass."""
    title = f"## GPU benchmark ({report['name']}, torch {report['torch']}, BasicUNet {report['features']})"
    lines = [
        title,
        "",
        "| volume | backend | precision | contender | time s | Mvox/s | x whole | work | peak GPU MB "
        "| max abs |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    wholes = {
        (r["volume"], r["backend"], r["precision"]): r["time_s"]
        for r in report["rows"]
        if r.get("contender") == "whole volume"
    }
    for r in report["rows"]:
        head = f"| {r['volume']} | {r['backend']} | {r['precision']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} | | | | | | |")
            continue
        whole = wholes.get((r["volume"], r["backend"], r["precision"]))
        ratio = f"{r['time_s'] / whole:.2f}" if whole else "-"
        work = f"{r['work']:.2f}" if r.get("work") else "-"
        diff = f"{r['max_abs']:.3g}" if "max_abs" in r else "-"
        lines.append(
            f"{head} {r['contender']} | {r['time_s']:.3f} | {r['mvox_per_s']:.1f} | {ratio} | {work} | "
            f"{r['peak_gpu_mb']:.0f} | {diff} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

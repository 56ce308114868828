#!/usr/bin/env python
"""brain-mask-3d measurements: deepbet's own pass, tilewise's frame, and tiled plans (issue 12, item 5).

Run ``python benchmarks/brainmask.py [--wheel deepbet-1.0.2-py3-none-any.whl]`` (about 15 minutes
on 2 cores; ``--plans`` picks fewer). It writes ``--out`` (default ``benchmarks/out/brainmask``):
``results.json`` and ``results.md``; the committed copy of the tables is ``benchmarks/BRAINMASK.md``.

Data: nilearn's MNI152 T1 template (1 mm, RAS, skull-stripped, scaled to [0, 1]) and its brain
mask (``load_mni152_brain_mask``: the template > 0.2). Dice is taken on the template's own grid.

1. Geometry: deepbet's own pipeline (re-implemented from ``deepbet/bet.py``: its ``bbox_model.pt``
   on a 128^3 copy finds the brain's box, read from the wheel for this reference only), its
   post-processing (largest component, fill voids; scipy in place of cc3d / fill_voids),
   tilewise's frame (:func:`models.zoo.brainmask.to_frame`: the foreground's box) with the spec's
   preprocessing, and, for the record, no frame at all (the whole volume at a fixed spacing).
2. Plans: tiled inference (``tiling.tiled_inference``) over the 256^3 frame with the plans of
   ``--plans`` against the whole 256^3 pass: Dice vs whole and vs nilearn (labels p > 0.5 on the
   template's grid), max abs probability difference to the whole pass, and the seam: the max and
   mean abs difference of the brain probability between every two tiles where their kept outputs
   overlap (all 26 neighbours).

Source: none (original).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: ``tile:overlap[:halo[:blend]]`` plans measured by default: 1/4 and 1/2 tile overlaps.
DEFAULT_PLANS = (
    "64:16", "64:32", "96:24", "96:48", "128:32", "128:64", "160:40", "160:80",
    "192:48", "192:96", "224:56", "192:64:0:constant", "192:64:0:hann", "192:64:16:gaussian",
)  # fmt: skip


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return float(2 * np.logical_and(a, b).sum() / (a.sum() + b.sum()))


def mni() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template (float32, RAS), its affine and nilearn's brain mask (bool)."""
    from nilearn import datasets

    img = datasets.load_mni152_template(resolution=1)
    mask = datasets.load_mni152_brain_mask(resolution=1)
    return img.get_fdata(dtype=np.float32), img.affine, np.asarray(mask.dataobj) > 0


def get_wheel(path: Path | None, tmp: Path) -> Path:
    if path is not None:
        return path
    from models.zoo.brainmask import WHEEL_REQUIREMENT

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp)]
    subprocess.run([*cmd, WHEEL_REQUIREMENT], check=True, capture_output=True)
    return sorted(tmp.glob("deepbet-*.whl"))[0]


def jit_from_wheel(wheel: Path, member: str) -> Any:
    with zipfile.ZipFile(wheel) as zf:
        return torch.jit.load(io.BytesIO(zf.read(member)), map_location="cpu").eval()


def deepbet_reference(x: np.ndarray, net: Any, bbox_net: Any) -> tuple[np.ndarray, tuple[slice, ...], float]:
    """deepbet 1.0.2's ``BrainExtraction.run_model`` (bet.py 57-72) on a RAS volume: p(brain)."""

    def normalize(v: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        v = ((v - low) / (high - low)).clamp(0, 1)
        return 0.226 * (v - v.mean()) / v.std() + 0.449

    start = time.perf_counter()
    xt = torch.nan_to_num(torch.from_numpy(x))
    small = F.interpolate(xt[None, None], (128, 128, 128), mode="nearest-exact")[0, 0]
    low, high = small.quantile(0.005), small.quantile(0.995)
    with torch.inference_mode():
        mask_small = bbox_net(normalize(small, low, high)[None, None])[0, 1].numpy() > 0.5
    mask_small = largest_component(mask_small)
    rs = [np.flatnonzero(mask_small.mean(axis=d) > 0.02) for d in [(1, 2), (0, 2), (0, 1)]]
    box = []
    for r, n in zip(rs, x.shape, strict=True):
        scale = n / 128
        centre, size = (
            round(scale * (r.max() + 1 + r.min()) / 2),
            round(scale * (r.max() + 1 - r.min()) * 1.2),
        )
        box.append(slice(max(0, int(centre - size / 2)), min(n, int(centre + size / 2))))
    crop = F.interpolate(xt[tuple(box)][None, None], (256, 256, 256), mode="nearest-exact")[0, 0]
    with torch.inference_mode():
        p = net(normalize(crop, low, high)[None, None])[0, 1]
    prob = np.zeros(x.shape, np.float32)
    prob[tuple(box)] = F.interpolate(p[None, None], crop_shape(box), mode="nearest-exact")[0, 0].numpy()
    return prob, tuple(box), time.perf_counter() - start


def crop_shape(box: Any) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def largest_component(mask: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    labels, n = ndimage.label(mask, structure=np.ones((3, 3, 3)))
    if n == 0:
        return mask
    return labels == np.bincount(labels[labels != 0]).argmax()


def postprocess(mask: np.ndarray, box: tuple[slice, ...]) -> np.ndarray:
    """deepbet's ``postprocess`` (bet.py 74-77): largest component, then fill voids, in the box."""
    from scipy import ndimage

    out = mask.copy()
    out[box] = ndimage.binary_fill_holes(largest_component(out[box]))
    return out


class Recorder:
    """Runs the predictor and keeps each tile's brain probability, in the engine's tile order."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor
        self.tiles: list[torch.Tensor] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        y = self.predictor(batch)
        self.tiles.extend(y[:, 1].clone())
        return y


def seam(grid: Any, outputs: list[torch.Tensor]) -> tuple[float, float]:
    """Max and mean abs difference between any two tiles' kept outputs where they overlap."""
    tiles = list(grid.tiles())
    by_index = {t.index: (t, o) for t, o in zip(tiles, outputs, strict=True)}
    worst, total, count = 0.0, 0.0, 0
    for t, o in zip(tiles, outputs, strict=True):
        for step in itertools.product((-1, 0, 1), repeat=3):
            if step <= (0, 0, 0):
                continue
            other = by_index.get(tuple(i + s for i, s in zip(t.index, step, strict=True)))
            if other is None:
                continue
            u, ou = other
            lo = [max(a.start, b.start) for a, b in zip(t.write, u.write, strict=True)]
            hi = [min(a.stop, b.stop) for a, b in zip(t.write, u.write, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue

            def kept(tile: Any, lo: list[int] = lo, hi: list[int] = hi) -> tuple[slice, ...]:
                return tuple(
                    slice(a - w.start + c.start, b - w.start + c.start)
                    for a, b, w, c in zip(lo, hi, tile.write, tile.crop, strict=True)
                )

            diff = (o[kept(t)] - ou[kept(u)]).abs()
            worst = max(worst, float(diff.max()))
            total += float(diff.sum(dtype=torch.float64))
            count += diff.numel()
    return worst, total / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--wheel", type=Path, default=None, help="deepbet-1.0.2 wheel (default: pip download)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "brainmask")
    parser.add_argument("--plans", nargs="*", default=list(DEFAULT_PLANS), help="tile:overlap[:halo[:blend]]")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from models import ModelRepository
    from models.transforms.preprocess import preprocess
    from models.zoo.brainmask import BRAIN_MASK_NAME, FRAME_SHAPE, from_frame, setup_brain_mask, to_frame
    from tiling import TileGrid, tiled_inference

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"geometry": [], "plans": []}
    with tempfile.TemporaryDirectory(prefix="brainmask-bench-") as tmp:
        wheel = get_wheel(args.wheel, Path(tmp))
        setup_brain_mask(Path(tmp) / "models", wheel=wheel)
        model = ModelRepository(Path(tmp) / "models", device="cpu").get(BRAIN_MASK_NAME)
        bbox_net = jit_from_wheel(wheel, "data/models/bbox_model.pt")
    volume, affine, nilearn_mask = mni()
    assert (np.diag(affine)[:3] > 0).all(), "the template is RAS"

    def geometry(name: str, prob: np.ndarray, seconds: float, note: str = "") -> np.ndarray:
        m = prob > 0.5
        row = {"name": name, "dice_nilearn": dice(m, nilearn_mask), "seconds": seconds, "note": note}
        results["geometry"].append(row)
        print(json.dumps(row), flush=True)
        return m

    ref_prob, ref_box, ref_s = deepbet_reference(volume, model.predictor.module, bbox_net)
    ref = geometry("deepbet 1.0.2 (bbox net, 256^3, nearest back)", ref_prob, ref_s, f"box {ref_box}")
    post = postprocess(ref, ref_box)
    results["geometry"].append(
        {"name": "deepbet + post-processing (largest component, fill voids)",
         "dice_nilearn": dice(post, nilearn_mask), "dice_vs_raw": dice(post, ref)}
    )  # fmt: skip
    print(json.dumps(results["geometry"][-1]), flush=True)

    x, frame = to_frame(volume, affine)
    xp = preprocess(x, model.spec)
    start = time.perf_counter()
    whole = tiled_inference(xp, model.predictor, tile_shape=FRAME_SHAPE, alignment=32)
    whole_s = time.perf_counter() - start
    whole_prob = from_frame(whole[1:2], frame)[0]
    whole_mask = geometry("tilewise frame, linear back (default)", whole_prob, whole_s, f"box {frame.box}")
    results["geometry"][-1]["dice_vs_deepbet"] = dice(whole_mask, ref)
    m = geometry("tilewise frame, nearest back", from_frame(whole[1:2], frame, interpolation="nearest")[0], 0)
    results["geometry"][-1]["dice_vs_deepbet"] = dice(m, ref)
    xb, fb = to_frame(volume, affine, box=ref_box)
    pb = tiled_inference(preprocess(xb, model.spec), model.predictor, tile_shape=FRAME_SHAPE, alignment=32)
    m = geometry("deepbet's box, tilewise preprocessing, linear back", from_frame(pb[1:2], fb)[0], 0)
    results["geometry"][-1]["dice_vs_deepbet"] = dice(m, ref)
    for spacing in (1.0, 0.75):
        shape = tuple(round(n / spacing) for n in volume.shape)
        v = F.interpolate(torch.from_numpy(volume)[None, None], shape, mode="trilinear")[0].numpy()
        start = time.perf_counter()
        p = tiled_inference(preprocess(v, model.spec), model.predictor, tile_shape=384, alignment=32)
        seconds = time.perf_counter() - start
        p = F.interpolate(torch.from_numpy(p[1:2])[None], volume.shape, mode="trilinear")[0, 0].numpy()
        m = geometry(f"no frame: whole volume at {spacing} mm", p, seconds, f"network input {shape}")
        results["geometry"][-1]["dice_vs_deepbet"] = dice(m, ref)
    del v, p, pb, xb

    whole_t = torch.from_numpy(whole[1])
    seen: dict[tuple[Any, ...], str] = {}
    for plan in args.plans:
        parts = plan.split(":")
        tile, overlap = int(parts[0]), int(parts[1])
        halo = int(parts[2]) if len(parts) > 2 else 0
        blend = parts[3] if len(parts) > 3 else "gaussian"
        # Tiles keep their size (as Model.run plans a tile-dependent network): sized to the grid,
        # 224^3 tiles over 256^3 would shrink to 160^3.
        grid = TileGrid.plan(
            FRAME_SHAPE, tile, halo, overlap=overlap, blend=blend, alignment=32, fixed_tile_shape=True
        )
        key = (tile, halo, blend, tuple(a.starts for a in grid.axes))
        if key in seen:  # tile origins are multiples of 32: a smaller overlap may give the same grid
            print(f"plan {plan}: same tiles as {seen[key]}, skipped", flush=True)
            continue
        seen[key] = plan
        rec = Recorder(model.predictor)
        start = time.perf_counter()
        out = tiled_inference(
            xp, rec, tile, halo, overlap=overlap, blend=blend, alignment=32, fixed_tile_shape=True
        )
        seconds = time.perf_counter() - start
        worst, mean = seam(grid, rec.tiles) if grid.n_tiles > 1 else (0.0, 0.0)
        del rec
        mask = from_frame(out[1:2], frame)[0] > 0.5
        row = {
            "tile": tile, "overlap": overlap, "halo": halo, "blend": blend, "tiles": grid.n_tiles,
            "grid": list(grid.grid_shape), "stride": list(grid.stride),
            "work": grid.n_tiles * tile**3 / float(np.prod(FRAME_SHAPE)), "seconds": seconds,
            "dice_vs_whole": dice(mask, whole_mask), "dice_nilearn": dice(mask, nilearn_mask),
            "max_abs_vs_whole": float((torch.from_numpy(out[1]) - whole_t).abs().max()),
            "seam_max": worst, "seam_mean": mean,
        }  # fmt: skip
        results["plans"].append(row)
        print(json.dumps(row), flush=True)
        del out

    results["machine"] = {
        "python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
        "whole_256_seconds": whole_s,
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (args.out / "results.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| geometry | Dice vs nilearn | Dice vs deepbet | s | note |",
        "|---|---:|---:|---:|---|",
    ]
    for g in results["geometry"]:
        vs = g.get("dice_vs_deepbet", g.get("dice_vs_raw"))
        lines.append(
            f"| {g['name']} | {g['dice_nilearn']:.4f} | {'' if vs is None else f'{vs:.4f}'} | "
            f"{g.get('seconds', 0):.1f} | {g.get('note', '')} |"
        )
    lines += [
        "",
        "| tile | overlap | halo | blend | tiles (grid) | stride | work | s | Dice vs whole "
        "| Dice vs nilearn | max abs vs whole | seam max | seam mean |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in results["plans"]:
        lines.append(
            f"| {p['tile']} | {p['overlap']} | {p['halo']} | {p['blend']} | {p['tiles']} "
            f"({'x'.join(map(str, p['grid']))}) | {p['stride'][0]} | {p['work']:.2f} | {p['seconds']:.1f} | "
            f"{p['dice_vs_whole']:.4f} | {p['dice_nilearn']:.4f} | {p['max_abs_vs_whole']:.3f} | "
            f"{p['seam_max']:.3f} | {p['seam_mean']:.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

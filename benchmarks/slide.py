"""The slide case (issue 21): tilewise's streamed file path against MONAI's WSI patch inference on
the same slide, network and tile size; time, peak RSS, tiles run and network work.

``python -m benchmarks.slide [--side 8000] [--tile 512] [--out DIR]``

- The slide: scikit-image's immunohistochemistry micrograph (512 x 512 RGB) tiled out to
  ``side x side`` pixels with blank glass (white, 40 % of the area) around, written by tifffile
  as a pyramidal tiled TIFF (zlib tiles of 256, levels 1, 1/2, 1/4, 1/8 as SubIFDs). zlib, not
  JPEG: tifffile stores JPEG RGB as YCbCr, which tilewise's region reader (``service.regions``)
  still decodes whole until the slide reader (issue 21 item 1) lands; ``--jpeg`` measures that.
- The network: ``sobel-2d`` (:class:`models.zoo.analytic.AnalyticNet`, a separable 3x3 conv
  network, receptive radius 1) on the BT.601 grey of the slide (0 .. 255: the model's
  preprocessing).
- tilewise: ``tilewise infer SLIDE OUT.tiff --model sobel-2d --tile T`` in a child process: the
  slide read by region, the output written as a tiled TIFF while stitching.
- MONAI: ``monai.data.WSIReader(backend="tifffile")`` reads level 0 (whole: MONAI's reader has no
  region-wise inference), the same grey, ``monai.inferers.SlidingWindowInferer(roi_size=(T, T),
  overlap=2 / T)`` (one pixel of context each side, blended constant), the same network module.

Each contender runs in its own process; its peak RSS is that process's ``ru_maxrss``. Each output
is compared with the whole-image oracle (``scipy.ndimage.sobel``, mode constant, on the grey of
the whole level 0) on 20 random 512 x 512 windows and the four corners. Seconds depend on the
machine and its load: read the ratios. This is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_REPO = Path(__file__).resolve().parents[1]
MODEL = "sobel-2d"


def write_slide(path: Path, side: int, blank: float = 0.4, compression: str = "zlib") -> dict[str, Any]:
    """The pyramidal slide (see the module docstring); its facts."""
    import tifffile
    from skimage import data

    ihc = data.immunohistochemistry()
    tissue_side = int(side * math.sqrt(1 - blank))
    reps = -(-tissue_side // 512)
    tissue = np.tile(ihc, (reps, reps, 1))[:tissue_side, :tissue_side]
    image = np.full((side, side, 3), 242, np.uint8)  # glass
    o = (side - tissue_side) // 2
    image[o : o + tissue_side, o : o + tissue_side] = tissue
    levels = [image]
    while len(levels) < 4:
        levels.append(levels[-1][::2, ::2])
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        options = {"tile": (256, 256), "photometric": "rgb", "compression": compression}
        tw.write(levels[0], subifds=len(levels) - 1, **options)
        for level in levels[1:]:
            tw.write(level, subfiletype=1, **options)
    return {"side": side, "blank": blank, "compression": compression, "bytes": path.stat().st_size}


def _child(argv: list[str]) -> tuple[float, int, str]:
    """Run ``argv``; (seconds, peak RSS bytes of that process, its output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=_REPO)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}:\n{out[-3000:]}")
    return seconds, int(usage.ru_maxrss) * 1024, out


def run_monai(slide: Path, out: Path, tile: int) -> None:
    """The MONAI contender (in its child process): prints its tiles and network pixels as JSON."""
    import torch
    from monai.data import WSIReader
    from monai.inferers import SlidingWindowInferer

    from models.zoo.analytic import AnalyticNet

    reader = WSIReader(backend="tifffile", level=0)
    image, _ = reader.get_data(reader.read(str(slide)))  # (3, H, W) uint8: level 0, whole
    luma = np.array([0.299, 0.587, 0.114], np.float32)
    grey = np.tensordot(luma, np.asarray(image, np.float32), axes=1)[None, None]
    del image
    net = AnalyticNet("sobel", 2).eval()
    counted = {"tiles": 0, "pixels": 0}

    def predictor(batch: torch.Tensor) -> torch.Tensor:
        counted["tiles"] += int(batch.shape[0])
        counted["pixels"] += int(batch.shape[0] * batch.shape[2] * batch.shape[3])
        return net(batch)

    inferer = SlidingWindowInferer(roi_size=(tile, tile), sw_batch_size=4, overlap=2 / tile, mode="constant")
    with torch.inference_mode():
        result = inferer(torch.from_numpy(grey), predictor)
    np.save(out, np.asarray(result[0, 0], np.float32))
    print(json.dumps(counted))


def oracle_errors(slide: Path, outputs: dict[str, Path], side: int, n: int = 20) -> dict[str, float]:
    """Max abs difference of each output from scipy's Sobel magnitude of the whole grey, on ``n``
    random windows of 512 (and the four corners)."""
    import tifffile
    from scipy import ndimage as ndi

    grey = tifffile.imread(slide).astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    rng = np.random.default_rng(0)
    w = min(512, side)
    corners = [(0, 0), (0, side - w), (side - w, 0), (side - w, side - w)]
    windows = corners + [tuple(int(v) for v in rng.integers(0, side - w + 1, 2)) for _ in range(n)]
    arrays = {
        name: (tifffile.imread(path) if path.suffix == ".tiff" else np.load(path, mmap_mode="r"))
        for name, path in outputs.items()
    }
    worst = dict.fromkeys(outputs, 0.0)
    for y, x in windows:
        y0, x0 = max(0, y - 1), max(0, x - 1)
        patch = grey[y0 : y + w + 1, x0 : x + w + 1]
        sob = np.hypot(ndi.sobel(patch, 0, mode="constant"), ndi.sobel(patch, 1, mode="constant"))
        want = sob[y - y0 : y - y0 + w, x - x0 : x - x0 + w]
        # the patch's own zero border is the image's only where the window meets it; elsewhere
        # its outer ring is wrong: compare the inner window (1 px in from an inner edge)
        inner = (slice(1 if y > 0 else 0, w - 1 if y + w < side else w),
                 slice(1 if x > 0 else 0, w - 1 if x + w < side else w))  # fmt: skip
        for name, array in arrays.items():
            got = np.asarray(array).reshape(side, side)[y : y + w, x : x + w].astype(np.float32)
            worst[name] = max(worst[name], float(np.abs(got[inner] - want[inner]).max()))
    return {k: float(f"{v:.4g}") for k, v in worst.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slide", description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=8000)
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench-slide"))
    parser.add_argument("--jpeg", action="store_true", help="JPEG tiles (stored as YCbCr) instead of zlib")
    parser.add_argument("--monai-child", nargs=2, metavar=("SLIDE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.monai_child:
        run_monai(Path(args.monai_child[0]), Path(args.monai_child[1]), args.tile)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    slide = args.out / "slide.tif"
    facts = write_slide(slide, args.side, compression="jpeg" if args.jpeg else "zlib")
    pixels = args.side * args.side

    tw_out = args.out / "tilewise.tiff"
    tw_s, tw_rss, tw_log = _child(
        [
            sys.executable,
            "-m",
            "service.cli",
            "--log-level",
            "INFO",
            "infer",
            str(slide),
            str(tw_out),
            "--model",
            MODEL,
            "--tile",
            str(args.tile),
            "--format",
            "tiff",
        ]  # fmt: skip
    )
    plan = re.findall(r"tiles=(\d+)", tw_log)
    tw_tiles = int(plan[-1]) if plan else None
    tile_core = args.tile - 2  # halo 1 each side: a tile reads T x T, keeps (T-2) x (T-2)
    tw_work = (tw_tiles * args.tile**2 / pixels) if tw_tiles else None

    mo_out = args.out / "monai.npy"
    mo_s, mo_rss, mo_log = _child(
        [
            sys.executable,
            "-m",
            "benchmarks.slide",
            "--tile",
            str(args.tile),
            "--monai-child",
            str(slide),
            str(mo_out),
        ]
    )
    counted = json.loads(mo_log.strip().splitlines()[-1])

    errors = oracle_errors(slide, {"tilewise": tw_out, "monai": mo_out}, args.side)
    row = {
        "slide": facts,
        "tile": args.tile,
        "tile_core": tile_core,
        "tilewise": {"seconds": round(tw_s, 2), "peak_rss_mib": round(tw_rss / 2**20, 1),
                     "tiles": tw_tiles, "work": None if tw_work is None else round(tw_work, 3)},
        "monai": {"seconds": round(mo_s, 2), "peak_rss_mib": round(mo_rss / 2**20, 1),
                  "tiles": counted["tiles"], "work": round(counted["pixels"] / pixels, 3)},
        "ratios_tilewise_over_monai": {"seconds": round(tw_s / mo_s, 3),
                                       "peak_rss": round(tw_rss / mo_rss, 3)},
        "max_abs_error_vs_scipy": errors,
    }  # fmt: skip
    (args.out / "slide.json").write_text(json.dumps(row, indent=2))
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

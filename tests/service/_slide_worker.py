"""Subprocess of ``test_slides.test_big_slide_...``: one big synthetic slide through ``gaussian-2d``.

Usage: ``python _slide_worker.py SLIDE OUT_STEM TISSUE_BOX``. Set up as ``tilewise infer`` is (mmap
threshold, model loaded, footprint measured), then: the dry run, the peak resident memory rise
(``VmHWM`` reset before, minus the level before ``run_file``) of the run (``format=npy``, read by
region, written as it finishes), and the checks: 20 windows (10 in the tissue, 10 deep in the
glass, where every tile was skipped) against ``scipy.ndimage.gaussian_filter`` of the BT.601 grey
of the slide's decoded level 0 (zero beyond the slide, as the model pads); and pairs of skipped
glass tiles with the same crop, which must be the same copy of the one blank tile computed
(difference 0). One JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

LUMA = np.array([0.299, 0.587, 0.114], np.float32)
RADIUS = 8  # gaussian-2d: sigma 2, truncate 4
WINDOW = 192
MARGIN = 1200  # level-0 pixels between a "glass" window and the tissue (tile 512 + the mask's dilation)


def _oracle(level0, y0: int, y1: int, x0: int, x1: int, H: int, W: int) -> np.ndarray:
    from scipy import ndimage

    a0, a1, b0, b1 = max(y0 - RADIUS, 0), min(y1 + RADIUS, H), max(x0 - RADIUS, 0), min(x1 + RADIUS, W)
    rgb = np.asarray(level0[a0:a1, b0:b1]).astype(np.float32)
    grey = np.zeros((y1 - y0 + 2 * RADIUS, x1 - x0 + 2 * RADIUS), np.float32)  # zero beyond the slide
    grey[a0 - y0 + RADIUS : a1 - y0 + RADIUS, b0 - x0 + RADIUS : b1 - x0 + RADIUS] = rgb @ LUMA
    smooth = ndimage.gaussian_filter(grey, sigma=2.0, truncate=4.0, mode="constant")
    return smooth[RADIUS:-RADIUS, RADIUS:-RADIUS]


def main(argv: list[str]) -> int:
    import tiffslide

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

    slide, stem, box = Path(argv[0]), Path(argv[1]), [float(v) for v in argv[2].split(",")]
    fix_mmap_threshold()
    model = ModelRepository(None, device="cpu").get("gaussian-2d")
    model.footprint()
    params = parse_params({"format": "npy", "tile": "512", "batch_size": "4"})
    plan = dry_run(model, slide, params, Limits())
    release_free_memory()
    base = rss_bytes()
    if base is None or not reset_peak_rss():
        sys.stdout.write(json.dumps({"skip": "no /proc/self/clear_refs"}) + "\n")
        return 0
    started = time.perf_counter()
    result = run_file(model, slide, stem, params, limits=Limits())
    seconds = time.perf_counter() - started
    peak = peak_rss_bytes()
    assert peak is not None
    out = np.load(result.path, mmap_mode="r")
    H, W = out.shape[-2:]
    t0, l0, t1, l1 = int(box[0] * H), int(box[1] * W), int(box[2] * H), int(box[3] * W)
    rng = np.random.default_rng(0)
    windows = []
    while len(windows) < 10:  # in the tissue (and across its edge)
        y, x = int(rng.integers(t0 - WINDOW, t1)), int(rng.integers(l0 - WINDOW, l1))
        windows.append((y, x, False))
    while len(windows) < 20:  # deep in the glass: skipped tiles only; the slide's border included
        y, x = int(rng.integers(0, H - WINDOW)), int(rng.integers(0, W - WINDOW))
        if y + WINDOW < t0 - MARGIN or y > t1 + MARGIN or x + WINDOW < l0 - MARGIN or x > l1 + MARGIN:
            windows.append((y, x, True))
    windows[-1] = (H - WINDOW, W - WINDOW, True)  # the corner: the slide's border in a skipped tile
    diffs = []
    with tiffslide.TiffSlide(slide) as ts:
        level0 = ts.zarr_group["0"]
        for y, x, _ in windows:
            want = _oracle(level0, y, y + WINDOW, x, x + WINDOW, H, W)
            diffs.append(float(np.abs(np.asarray(out[0, y : y + WINDOW, x : x + WINDOW]) - want).max()))
    # skipped glass tiles with the same crop: the same copy of the one blank tile
    grid = result.plan.grid
    by_crop: dict[tuple, list] = {}
    for tile in grid.tiles():
        ys, xs = tile.write
        far = (
            ys.stop < t0 - MARGIN or ys.start > t1 + MARGIN or xs.stop < l0 - MARGIN or xs.start > l1 + MARGIN
        )
        if far:
            key = tuple((c.start, c.stop) for c in tile.crop)
            by_crop.setdefault(key, []).append(tile)
    pairs = [tiles[:2] for tiles in by_crop.values() if len(tiles) >= 2][:8]
    constant = max(
        float(np.abs(np.asarray(out[(0, *a.write)]) - np.asarray(out[(0, *b.write)])).max()) for a, b in pairs
    )
    report = {
        "shape": [int(H), int(W)],
        "tiles": result.plan.n_tiles,
        "skipped": result.plan.skipped,
        "expected_skipped": plan["skipped"],
        "peak_rise_bytes": int(peak - base),
        "seconds": round(seconds, 1),
        "windows": len(windows),
        "skipped_windows": sum(1 for w in windows if w[2]),
        "max_diff": max(diffs),
        "constant_pairs": len(pairs),
        "constant_diff": constant,
        "plan": result.plan.header(),
    }
    del out
    result.path.unlink()
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

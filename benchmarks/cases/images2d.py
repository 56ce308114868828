"""2D cases: a radiograph and a text page through ``text-det-2d``."""

from __future__ import annotations

from pathlib import Path

from benchmarks.config import TEXT_DET, aligned_stride, monai_overlap_for
from benchmarks.data import page_raw, preprocessed, radiograph_raw
from benchmarks.env import importable, shape_of, text_det_missing
from benchmarks.harness import Bench


def case_2d(bench: Bench) -> None:
    m = bench.mode
    models_dir = Path(bench.args.models).expanduser()
    why = text_det_missing(models_dir)
    if why:
        bench.notes.append(f"2d case skipped: {why}")
        bench.log(f"2d case skipped: {why}")
        bench.add("2d", "all", {}, skip=why)
        return
    images = [("2d-radiograph", radiograph_raw(bench.cache))]
    if importable("skimage"):
        images.append(("2d-page", page_raw(bench.cache)))
    stride = aligned_stride(m.tile2d, m.halo2d, 32)
    overlap = 0.25 if int(m.tile2d * 0.75) == stride else monai_overlap_for(m.tile2d, stride)
    for case, raw in images:
        data = preprocessed(raw, models_dir, bench.work / f"{case}.npy")
        ref = bench.work / f"ref_{case}.npy"
        base = {"model": TEXT_DET, "data": str(data), "tile": m.tile2d, "models_dir": str(models_dir)}
        whole = bench.add(case, "whole image", {**base, "kind": "whole", "save": str(ref)})
        if whole.status != "ok":
            continue
        base["reference"] = str(ref)
        for mode in ("constant", "gaussian"):
            bench.add(
                case,
                f"MONAI {mode}, overlap {overlap:.3g}",
                {**base, "kind": "monai", "overlap": overlap, "mode": mode},
                skip=None if bench.have_monai else "monai not installed",
            )
        bench.add(
            case,
            f"tilewise halo {m.halo2d} (same stride)",
            {**base, "kind": "tilewise", "halo": m.halo2d},
        )
        bench.add(
            case,
            'tilewise Model.run: default plan, halo="auto" (1e-3), whole-image pooling context',
            {**base, "kind": "model-run", "model_name": TEXT_DET, "tolerance": 1e-3, "data": str(raw)},
        )
        bench.notes.append(
            f"{case}: {'RG1_UNCR.dcm (pydicom-data)' if 'radio' in case else 'skimage page x6'} "
            f"({shape_of(data)}) through {TEXT_DET}; MONAI and `tilewise halo {m.halo2d}` call the raw "
            "ONNX network on each tile (its squeeze-excitation pools over the tile only); "
            f"tile {m.tile2d}, stride {stride} for both. `Model.run` is the product path (spec "
            "preprocessing, whole-image pooling context, calibrated halo)."
        )

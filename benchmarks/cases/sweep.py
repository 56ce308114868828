"""Time against seam error on the 3D case: tilewise halos and calibrated halos, MONAI overlaps."""

from __future__ import annotations

from benchmarks.data import mni_volume
from benchmarks.harness import Bench


def case_sweep(bench: Bench) -> None:
    m = bench.mode
    data = mni_volume(bench.cache, spacing_mm=m.spacing_mm)
    model = "unet-batch"
    ref = bench.work / f"ref_{model}.npy"
    if not ref.exists():
        bench.notes.append("sweep skipped: the 3d case did not produce the whole-volume reference")
        return
    base = {
        "model": model,
        "data": str(data),
        "tile": m.tile,
        "reference": str(ref),
        "repeats": m.sweep_repeats,
    }
    for h in m.sweep_halos:
        bench.add("sweep", f"tilewise halo {h}", {**base, "kind": "tilewise", "halo": h})
    cal = bench.calibrate(model, data, m.tile, 1e-4)
    if cal is not None:
        for tol in m.auto_tolerances:
            h, met, err = bench.halo_for(cal, tol)
            row = bench.add(
                "sweep",
                f'tilewise halo="auto" ({tol:g} -> {h})',
                {**base, "kind": "tilewise", "halo": h, "tolerance": tol},
            )
            row.result["calibration_s"] = cal["seconds"]
    for ov in m.sweep_overlaps:
        for mode in ("constant", "gaussian"):
            bench.add(
                "sweep",
                f"MONAI {mode}, overlap {ov:g}",
                {**base, "kind": "monai", "overlap": ov, "mode": mode},
                skip=None if bench.have_monai else "monai not installed",
            )

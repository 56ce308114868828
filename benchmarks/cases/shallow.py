"""A shallow analytic network (``log-3d``) with ``halo="auto"`` against the whole volume."""

from __future__ import annotations

from benchmarks.config import aligned_stride, monai_overlap_for
from benchmarks.data import mni_volume
from benchmarks.harness import Bench


def case_shallow(bench: Bench) -> None:
    m = bench.mode
    data = mni_volume(bench.cache, spacing_mm=m.spacing_mm)
    model = "log-3d"
    ref = bench.work / f"ref_{model}.npy"
    base = {"model": model, "data": str(data)}
    whole = bench.add("shallow", "whole volume", {**base, "kind": "whole", "save": str(ref)})
    if whole.status != "ok":
        return
    base["reference"] = str(ref)
    default = bench.add(
        "shallow",
        "tilewise Model.run, default plan",
        {**base, "kind": "model-run", "models_dir": str(bench.work / "no-models"), "model_name": model,
         "params": {}},
    )  # fmt: skip
    if default.status == "ok" and default.get("plan"):
        p = default.get("plan")
        default.note = f"tile {p['tile']}, halo {p['halo']}, {p['tiles']} tiles, work {p['work']}"
    for tile in m.shallow_tiles:
        cal = bench.calibrate(model, data, tile, 1e-5)
        if cal is None:
            continue
        h, met, err = bench.halo_for(cal, 1e-5)
        row = bench.add(
            "shallow",
            f'tilewise tile {tile}, halo="auto" (1e-5 -> {h})',
            {**base, "kind": "tilewise", "tile": tile, "halo": h, "tolerance": 1e-5},
        )
        row.result["calibration_s"] = cal["seconds"]
        bench.add(
            "shallow",
            f"tilewise tile {tile}, halo {h}, fixed tile shape (v1 plan)",
            {**base, "kind": "tilewise", "tile": tile, "halo": h, "fixed_tile_shape": True},
        )
    tile = m.shallow_tiles[-1]
    stride = aligned_stride(tile, m.halo, 1)
    if m.name == "full":
        bench.add(
            "shallow",
            f"MONAI constant, tile {tile}, same stride as halo {m.halo}",
            {
                **base,
                "kind": "monai",
                "mode": "constant",
                "tile": tile,
                "overlap": monai_overlap_for(tile, stride),
            },
            skip=None if bench.have_monai else "monai not installed",
        )
    bench.notes.append(
        "shallow case: `log-3d` (models.zoo.analytic, radius 8) on the 3D case's volume; tile 64 is the "
        "model's default plan."
    )

"""3D U-Net cases: MNI152 through MONAI's BasicUNet (batch norm, and instance norm)."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.config import UNET_ALIGNMENT, aligned_stride, monai_overlap_for, monai_passes
from benchmarks.data import mni_volume
from benchmarks.env import shape_of
from benchmarks.harness import Bench


def case_3d(bench: Bench, variants: Sequence[str] = ("unet-batch",)) -> None:
    m = bench.mode
    if not bench.have_monai:
        why = "monai not installed (pip install -e '.[bench]'): the U-Net is MONAI's BasicUNet"
        bench.notes.append(f"3d and sweep cases skipped: {why}")
        bench.add("3d-batch", "all", {}, skip=why)
        return
    data = mni_volume(bench.cache, spacing_mm=m.spacing_mm)
    shape = [int(v) for v in shape_of(data).split("x")]
    stride = aligned_stride(m.tile, m.halo, UNET_ALIGNMENT)
    from tiling import TileGrid

    tw_grid = TileGrid.plan(shape, m.tile, m.halo, alignment=UNET_ALIGNMENT)
    tw_passes = tw_grid.n_tiles
    overlap = 0.25
    if monai_passes(shape, m.tile, overlap) != tw_passes:  # fall back to the very same stride
        overlap = monai_overlap_for(m.tile, stride)
    monai_stride = int(m.tile * (1 - overlap))
    patch_overlap = m.tile - monai_stride
    patch_overlap += patch_overlap % 2  # TorchIO wants an even overlap
    bench.notes.append(
        f"3D case: MNI152 T1 resampled to {m.spacing_mm} mm ({shape_of(data)}), tile {m.tile}. tilewise "
        f"halo {m.halo} with alignment {UNET_ALIGNMENT} gives stride {stride} ({m.tile} - 2 x {m.halo} "
        f"rounded down to {UNET_ALIGNMENT}); MONAI overlap {overlap:.3g} gives stride {monai_stride} and "
        f"TorchIO patch_overlap {patch_overlap} stride {m.tile - patch_overlap}: the same number of "
        f"forward passes ({tw_passes}) on this volume. tilewise sizes its tiles to the grid (same "
        f"passes, smaller tiles: {tw_grid.used_tile_shape}); "
        "the `fixed tile shape (v1 plan)` row is the previous plan (every tile at the limit)."
    )
    for model in variants:
        case = f"3d-{model.split('-')[1]}"
        ref = bench.work / f"ref_{model}.npy"
        base = {"model": model, "data": str(data), "tile": m.tile}
        whole = bench.add(case, "whole volume", {**base, "kind": "whole", "save": str(ref)})
        if whole.status != "ok":
            continue
        base["reference"] = str(ref)
        for mode in m.monai_modes:
            bench.add(
                case,
                f"MONAI {mode}, overlap {overlap:.3g}",
                {**base, "kind": "monai", "overlap": overlap, "mode": mode},
                skip=None if bench.have_monai else "monai not installed",
            )
        for mode in m.torchio_modes if model == "unet-batch" else m.instance_torchio_modes:
            bench.add(
                case,
                f"TorchIO {mode}",
                {**base, "kind": "torchio", "mode": mode, "patch_overlap": patch_overlap},
                skip=None if bench.have_torchio else "torchio not installed",
            )
        bench.add(
            case,
            f"tilewise halo {m.halo} (same tile, same passes)",
            {**base, "kind": "tilewise", "halo": m.halo, "disagreement": True},
        )
        bench.add(
            case,
            f"tilewise halo {m.halo}, fixed tile shape (v1 plan)",
            {**base, "kind": "tilewise", "halo": m.halo, "fixed_tile_shape": True},
        )
        if model == "unet-batch":
            cal = bench.calibrate(model, data, m.tile, 1e-4)
            if cal is not None:
                h, met, err = bench.halo_for(cal, 1e-4)
                row = bench.add(
                    case,
                    f'tilewise halo="auto" (1e-4 -> {h})',
                    {**base, "kind": "tilewise", "halo": h, "tolerance": 1e-4},
                )
                row.result["calibration_s"] = cal["seconds"]
        else:
            cal = bench.calibrate(model, data, m.tile, 1e-4)
            if cal is not None:
                h, met, err = bench.halo_for(cal, 1e-4)
                bench.notes.append(
                    f"{model}: halo calibration does not converge for a tile-dependent network: the "
                    f"truncation error at the largest halo tried ({h}) is still {err:.3g} (tolerance "
                    "1e-4); no halo makes instance-norm tiles agree with the whole volume."
                )


def case_instance(bench: Bench) -> None:
    bench.case_3d(variants=("unet-instance",))

"""Peak memory and time from 64^3 to 384^3, in memory and with an on-disk ``out``, against MONAI."""

from __future__ import annotations

from benchmarks.config import aligned_stride, monai_overlap_for
from benchmarks.data import mni_volume
from benchmarks.harness import Bench


def case_scaling(bench: Bench) -> None:
    m = bench.mode
    stride = aligned_stride(m.scaling_tile, m.scaling_halo, 1)  # box-3d needs no alignment
    overlap = monai_overlap_for(m.scaling_tile, stride)
    bench.notes.append(
        f"scaling case: MNI152 resampled to N^3, network `box-3d` ([mean3x3x3(x), x], 2 channels, "
        f"alignment 1: engine-bound, so the time is mostly tiling overhead), tile {m.scaling_tile}, "
        f"halo {m.scaling_halo}: stride {stride}; MONAI at the same stride (overlap {overlap:.3g}), so "
        "both make the same passes. The on-disk contender reads a memory-mapped .npy and writes a "
        "memory-mapped .npy."
    )
    for n in m.scaling_sizes:
        data = mni_volume(bench.cache, cube=n)
        base = {"model": "box-3d", "data": str(data), "tile": m.scaling_tile, "size": n}
        if "memory" in m.scaling_kinds:
            bench.add(
                "scaling",
                f"tilewise in memory {n}^3",
                {**base, "kind": "tilewise", "halo": m.scaling_halo},
            )
        if "disk" in m.scaling_kinds:
            bench.add(
                "scaling",
                f"tilewise on-disk out {n}^3",
                {
                    **base,
                    "kind": "tilewise",
                    "halo": m.scaling_halo,
                    "input": "disk",
                    "out_path": str(bench.work / f"scaling_out_{n}.npy"),
                },
            )
            (bench.work / f"scaling_out_{n}.npy").unlink(missing_ok=True)
        if "monai" in m.scaling_kinds:
            bench.add(
                "scaling",
                f"MONAI constant {n}^3",
                {**base, "kind": "monai", "mode": "constant", "overlap": overlap},
                skip=None if bench.have_monai else "monai not installed",
            )

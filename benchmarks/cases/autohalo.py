"""``halo="auto"`` on a deep local network: MONAI's BasicUNet (batch norm, eval mode), 1 mm MNI152.

The issue-15 case: with the tile limit at 96^3, a calibrated halo that eats the tile multiplied the
tiles (563 passes where MONAI makes 27). Contenders, on the same network and weights: the whole
volume (the reference), MONAI's ``sliding_window_inference`` at overlap 0.25 (constant and
gaussian) at the tile limit, and tilewise's product path, ``Model.run`` with ``tile=96, halo=auto``
(the planner grows the tile within the memory budget when the halo would leave too small a core),
at two tolerances: 1e-4 (met) and 1e-12 (never met: the calibration's largest halo, the issue's
pathological case). The network is a TorchScript trace of the benchmarks' BasicUNet in a model
folder of the cache, so ``Model.run`` loads it like an imported model. Each row's note gives the
plan that ran (tile, halo, tiles, work, where the tile came from) and the plan that ``halo=auto``
made before issue 15 (the calibrated halo capped at the tile limit, fixed tile shape).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from benchmarks.config import UNET_ALIGNMENT, monai_passes
from benchmarks.data import mni_volume
from benchmarks.env import shape_of
from benchmarks.harness import Bench

MODEL = "bench-unet-batch"


def unet_models_dir(cache: Path, tile: int) -> Path:
    """A model folder with the benchmarks' BasicUNet (batch norm) as TorchScript, and its spec."""
    folder = cache / "models-unet"
    spec = folder / f"{MODEL}.yaml"
    if spec.is_file():
        return folder
    import warnings

    import torch

    from benchmarks.nets import build_unet

    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(build_unet("batch"), torch.zeros(1, 1, 32, 32, 32))
    weights = folder / f"{MODEL}.pt"
    traced.save(str(weights))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    spec.write_text(
        f"name: {MODEL}\nbackend: torchscript\nfile: {weights.name}\nsha256: {digest}\n"
        f"spatial_dims: 3\nin_channels: 1\nout_channels: 2\nalignment: {UNET_ALIGNMENT}\n"
        "output: {activation: none, kind: probabilities}\n"
        f"defaults: {{tile: {tile}, halo: auto, batch_size: 1}}\n"
    )
    return folder


def case_auto(bench: Bench) -> None:
    m = bench.mode
    if not bench.have_monai:
        bench.add("auto", "all", {}, skip="monai not installed (pip install -e '.[bench]')")
        return
    data = mni_volume(bench.cache, spacing_mm=m.auto_spacing_mm)
    shape = [int(v) for v in shape_of(data).split("x")]
    models = unet_models_dir(bench.cache, m.auto_tile)
    ref = bench.work / "ref_auto.npy"
    base = {"model": "unet-batch", "data": str(data), "tile": m.auto_tile}
    whole = bench.add("auto", "whole volume", {**base, "kind": "whole", "save": str(ref)})
    if whole.status != "ok":
        return
    base["reference"] = str(ref)
    for mode in m.monai_modes:
        bench.add(
            "auto", f"MONAI {mode}, overlap 0.25", {**base, "kind": "monai", "overlap": 0.25, "mode": mode}
        )
    for tolerance in m.auto_case_tolerances:
        params = {"tile": str(m.auto_tile), "halo": "auto", "halo_tolerance": str(tolerance)}
        bench.add(
            "auto",
            f'tilewise Model.run tile {m.auto_tile}, halo="auto" ({tolerance:g})',
            {**base, "kind": "model-run", "models_dir": str(models), "model_name": MODEL, "params": params,
             "v1_tile": m.auto_tile},
        )  # fmt: skip
    bench.notes.append(
        f"auto case: MNI152 T1 at {m.auto_spacing_mm} mm ({shape_of(data)}), MONAI's BasicUNet (features "
        f"8-64, batch norm, eval mode), tile limit {m.auto_tile}: MONAI at overlap 0.25 makes "
        f"{monai_passes(shape, m.auto_tile, 0.25)} passes. tilewise runs `Model.run` on a TorchScript trace "
        "of the same network (the product path: footprint, calibration and plan at warm-up, not timed)."
    )

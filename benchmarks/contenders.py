"""One runner per contender kind: whole image, MONAI, TorchIO, ``Model.run`` and tilewise."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.nets import Counted


class CountingProxy:
    """Stands in for a model's own predictor and counts its tiles into a :class:`Counted`."""

    def __init__(self, inner: Any, counter: Counted) -> None:
        self.inner = inner
        self.counter = counter

    def __call__(self, batch: Any) -> Any:
        self.counter.items += int(batch.shape[0])
        self.counter.voxels += int(math.prod(batch.shape[2:])) * int(batch.shape[0])
        return self.inner(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def pad_to(x: Any, alignment: int) -> tuple[Any, tuple[slice, ...]]:
    """Zero-pad the spatial axes of ``(N, C, *spatial)`` to multiples of ``alignment`` (at the end)."""
    import torch.nn.functional as F

    spatial = x.shape[2:]
    pads: list[int] = []
    for s in reversed(spatial):
        pads += [0, (-s) % alignment]
    crop = tuple(slice(0, s) for s in spatial)
    return (F.pad(x, pads) if any(pads) else x), crop


def make_runner(
    job: dict[str, Any], predictor: Counted, data: Any, meta: dict[str, Any]
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(run, warm_up)`` for one contender; ``run()`` returns ``(C_out, *spatial)`` (numpy or torch)."""
    import numpy as np
    import torch

    kind = job["kind"]
    tile = int(job.get("tile", 0))
    ndim = data.ndim - 1
    align = predictor.alignment
    batch_size = int(job.get("batch_size", 1))

    def warm_tile() -> None:
        with torch.inference_mode():
            predictor(torch.zeros((batch_size, data.shape[0], *([tile] * ndim))))

    if kind == "whole":
        x = torch.from_numpy(np.asarray(data))[None]

        def run() -> Any:
            with torch.inference_mode():
                xp, crop = pad_to(x, align)
                return predictor(xp)[(0, slice(None), *crop)]

        def warm() -> None:
            with torch.inference_mode():
                predictor(pad_to(x, align)[0])

        return run, warm

    if kind == "monai":
        from monai.inferers import sliding_window_inference

        x = torch.from_numpy(np.asarray(data))[None]
        overlap = float(job["overlap"])

        def run() -> Any:
            with torch.inference_mode():
                y = sliding_window_inference(
                    x, [tile] * ndim, batch_size, predictor, overlap=overlap, mode=job["mode"]
                )
            return y[0]

        return run, warm_tile

    if kind == "torchio":
        import torchio as tio

        if ndim != 3:
            raise ValueError("TorchIO's GridSampler is 3D only")
        subject = tio.Subject(image=tio.ScalarImage(tensor=torch.from_numpy(np.asarray(data))))
        patch_overlap = int(job["patch_overlap"])

        def run() -> Any:
            sampler = tio.GridSampler(subject, patch_size=tile, patch_overlap=patch_overlap)
            aggregator = tio.GridAggregator(sampler, overlap_mode=job["mode"])
            patches: list[Any] = []
            locations: list[Any] = []

            def flush() -> None:
                with torch.inference_mode():
                    y = predictor(torch.stack(patches))
                aggregator.add_batch(y, torch.stack(locations))
                patches.clear()
                locations.clear()

            for patch in sampler:
                patches.append(patch["image"][tio.DATA])
                locations.append(torch.as_tensor(patch[tio.LOCATION]))
                if len(patches) == batch_size:
                    flush()
            if patches:
                flush()
            return aggregator.get_output_tensor()

        return run, warm_tile

    if kind == "model-run":
        from models.planning.params import InferenceParams, parse_params
        from models.repository import ModelRepository

        model = ModelRepository(job["models_dir"], device="cpu").get(job["model_name"])
        model.predictor = CountingProxy(model.predictor, predictor)  # the work column counts its tiles
        if "params" in job:  # the product's parameters as a query would give them
            options = parse_params(job["params"])
        else:
            options = InferenceParams(
                tile=job.get("model_tile"), halo="auto", halo_tolerance=float(job.get("tolerance", 1e-4))
            )

        def run() -> Any:
            return model.run(data, options)

        def warm() -> None:  # footprint, receptive field and calibrated halos (all cached), the plan
            x = model.preprocess(np.asarray(data))
            plan = model.plan(x.shape[1:], options, sample=x)
            meta["plan"] = {
                "tile": list(plan.grid.used_tile_shape),
                "halo": list(plan.halo),
                "tiles": plan.n_tiles,
                "work": round(plan.work, 3),
                "tile_source": plan.tile_source,
                "halo_source": plan.halo_source,
                "batch_size": plan.batch_size,
            }
            v1 = job.get("v1_tile")
            if v1 is not None:  # what the plan was before issue 15: the calibrated halo at the limit
                from tiling import TileGrid, cap_halo

                tile = (int(v1),) * (x.ndim - 1)
                align = model.spec.alignment
                want = model.calibrator.cached(tile, options.halo_tolerance or 1e-4)
                if want is not None:
                    halo = cap_halo((want.halo,) * len(tile), model.receptive_field(), tile, align)
                    old = TileGrid.plan(x.shape[1:], tile, halo, alignment=align, fixed_tile_shape=True)
                    v1_plan = {"halo": list(halo), "tiles": old.n_tiles, "work": round(old.work, 3)}
                    meta["plan"]["v1"] = v1_plan

        return run, warm

    if kind == "tilewise":
        from tiling import tiled_inference

        out_path = job.get("out_path")
        c_out = int(meta["out_channels"])

        def run() -> Any:
            out = None
            if out_path:
                Path(out_path).unlink(missing_ok=True)
                out = np.lib.format.open_memmap(
                    out_path, mode="w+", dtype=np.float32, shape=(c_out, *data.shape[1:])
                )
            return tiled_inference(
                data,
                predictor,
                tile,
                halo=int(job["halo"]),
                overlap=int(job.get("overlap", 0)),
                blend=job.get("blend", "constant"),
                alignment=align,
                batch_size=batch_size,
                out=out,
                fixed_tile_shape=bool(job.get("fixed_tile_shape", False)),
                prefetch=bool(job.get("prefetch", True)),
            )

        return run, warm_tile

    if kind == "read-only":  # the engine's reading and padding alone: its tiles, no network
        from tiling import TileGrid
        from tiling.execute import TileReader
        from tiling.geometry import PaddingMode

        grid = TileGrid.plan(data.shape[1:], tile, int(job["halo"]), alignment=align)

        def run() -> Any:
            with TileReader(data, grid, PaddingMode.CONSTANT, batch_size, prefetch=False) as reader:
                for batch in reader:
                    predictor.items += len(batch.tiles)
                    predictor.voxels += int(batch.data[0, 0].numel()) * len(batch.tiles)
                    reader.release(batch)
            return np.zeros((1,) * data.ndim, np.float32)

        return run, lambda: None

    if kind == "network-only":  # the network alone on the same number of tiles of the same shape
        from tiling import TileGrid

        grid = TileGrid.plan(data.shape[1:], tile, int(job["halo"]), alignment=align)
        zeros = torch.zeros((batch_size, data.shape[0], *grid.used_tile_shape))

        def run() -> Any:
            with torch.inference_mode():
                for b in range(0, grid.n_tiles, batch_size):
                    y = predictor(zeros[: min(batch_size, grid.n_tiles - b)])
            return y[0]

        def warm_net() -> None:
            with torch.inference_mode():
                predictor(zeros)

        return run, warm_net

    raise ValueError(f"unknown contender kind {kind!r}")

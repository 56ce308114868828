"""The dry run: the plan of a request as JSON, without running the network.

``POST /v1/models/{name}/infer?dry_run=true`` (with the file) and ``tilewise plan INPUT --model NAME``
answer the same object, from the file's header alone (nothing is decoded)::

    {"model": "gaussian-3d", "input_shape": [192, 192, 192], "model_shape": [192, 192, 192],
     "tile": [60, 60, 60], "halo": [8, 8, 8], "overlap": [0, 0, 0], "blend": "constant",
     "batch_size": 2, "tiles": 64, "work": 1.95, "peak_bytes": 103079215, "eta_s": 14.2,
     "tta": "none", "tile_dependent": false, ...}

``tile`` is the tile fed to the network; ``peak_bytes`` the request's predicted peak memory (the
decoded input included; :func:`models.cost.peak_bytes` from the footprint measured at warm-up);
``eta_s`` the predicted network time (the throughput measured at warm-up). Beyond the design's keys:
``tile_source`` and ``halo_source`` (where they came from), ``memory_budget``, ``footprint`` (the
measured figures), ``over_budget`` (``null``, or why the server would refuse the request) and
``warning`` (``null``, or what ``X-Tilewise-Warning`` would say: a halo below the receptive-field
radius, or a memory budget that no plan meets).
``halo="auto"`` takes the halo last calibrated for the tile (calibrating runs the network).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import MemoryBudgetError, OverBudgetError
from service.precheck import Limits, check_input, copies_input, input_bytes, model_shape

if TYPE_CHECKING:
    from models import InferenceParams, Model

__all__ = ["dry_run"]


def dry_run(model: Model, source: Path, params: InferenceParams, limits: Limits) -> dict[str, Any]:
    """The plan of running ``model`` on ``source`` with ``params`` (see the module docstring).

    Raises:
        PayloadTooLargeError, UnusableInputError, EmptyBodyError, UnsupportedMediaTypeError,
        DecodeError: the header is refused (as for a real request).
        ParamError, GridError: parameters that cannot tile this image.
    """
    from models.cost import network_seconds, peak_bytes

    spec = model.spec
    header = check_input(spec, source, limits, params)
    shape = model_shape(spec, header, params)
    footprint = model.footprint()
    held = {"input_bytes": input_bytes(header), "copies_input": copies_input(spec, header)}
    plan = model.plan(
        shape, params, memory_budget=limits.memory_budget, footprint=footprint, calibrate=False, **held
    )
    over: str | None = None
    if limits.budget is not None:
        try:
            limits.budget.check_plan(plan, spec.in_channels, spec.out_channels, footprint=footprint, **held)
        except (OverBudgetError, MemoryBudgetError) as exc:
            over = str(exc)
    peak = peak_bytes(plan, spec.in_channels, spec.out_channels, footprint, **held)
    grid = plan.grid
    return {
        "model": spec.name,
        "input_shape": list(header.spatial_shape),
        "model_shape": list(shape),
        "tile": list(grid.used_tile_shape),
        "halo": list(plan.halo),
        "overlap": list(plan.overlap),
        "blend": plan.blend.value,
        "batch_size": plan.batch_size,
        "tiles": plan.n_tiles,
        "work": round(plan.work, 4),
        "peak_bytes": int(peak),
        "eta_s": round(network_seconds(plan, footprint), 3),
        "tta": plan.tta.value,
        "tile_dependent": bool(spec.tile_dependent),
        "tile_source": plan.tile_source,
        "halo_source": plan.halo_source,
        "memory_budget": limits.memory_budget,
        "footprint": footprint.describe(),
        "over_budget": over,
        "warning": plan.warning,
    }

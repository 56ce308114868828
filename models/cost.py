"""What one run of a plan costs, from the plan alone (integer arithmetic, no data).

The service refuses a request whose plan costs more than its limits before anything runs
(``service.budget``); a dry run can report the same figures.

Memory, worked out for a 3D model with ``C_in`` input and ``C_out`` output channels on an image of
``V`` voxels (output ``V_out``), batch ``B`` of tiles of ``T`` voxels (outputs ``T_out``)::

    preprocessed input      4 * C_in * V
    batch buffers           2 * 4 * B * C_in * T            (two with the prefetch thread)
    one batch's prediction  4 * B * C_out * T_out
    the network's work      4 * A * B * C_in * T             (activations, padding, temporaries)
    accumulator (overlap)   4 * C_out * T_out[0] * prod(out_shape[1:])   (one slab of rows)
    output                  4 * C_out * V_out (probabilities) or V_out (uint8 labels)
    tta=mirror              + 4 * C_in * V (a flipped copy) + 2 * 4 * C_out * V_out (sum, pass)

``A`` (:data:`ACTIVATIONS`, 24) is an allowance for what the network holds while it runs, in copies
of its input batch: measured peak RSS rises of the built-in analytic networks were about 22 copies
(``gaussian-3d``, batch 32 of 64^3: 711 MiB). A deep network may hold more; the figure is an
estimate, checked against ``TILEWISE_MAX_REQUEST_BYTES`` before a request runs.

E.g. ``gaussian-3d`` on 256^3 with tile 96 and batch 2: 67 MB in, 14 MB of buffers, 7 MB of
prediction, 170 MB for the network, 67 MB out: about 325 MB.
"""

from __future__ import annotations

import math

from models.params import OutputKind
from models.plan import RunPlan

__all__ = ["ACTIVATIONS", "peak_bytes"]

_F32 = 4
#: Copies of the input batch the network is allowed to hold while it runs (see above).
ACTIVATIONS = 24


def peak_bytes(plan: RunPlan, in_channels: int, out_channels: int) -> int:
    """Bytes a run of ``plan`` holds at its peak, beyond the network's activations (see above)."""
    grid = plan.grid
    voxels = math.prod(plan.spatial_shape)
    out_voxels = math.prod(grid.out_shape)
    batch = min(plan.batch_size, grid.n_tiles)
    tile = math.prod(grid.used_tile_shape)
    out_tile = math.prod(grid.out_tile_shape)
    total = _F32 * in_channels * voxels
    total += (2 + ACTIVATIONS) * _F32 * batch * in_channels * tile
    total += _F32 * batch * out_channels * out_tile
    if grid.blended:
        total += _F32 * out_channels * grid.out_tile_shape[0] * math.prod(grid.out_shape[1:])
    labels = plan.output == OutputKind.LABELS
    total += out_voxels if labels else _F32 * out_channels * out_voxels
    if len(plan.flips) > 1:
        total += _F32 * in_channels * voxels + 2 * _F32 * out_channels * out_voxels
    return int(total)

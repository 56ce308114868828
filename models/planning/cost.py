"""What one run of a plan costs, from the plan and the network's measured footprint (no data).

The service refuses a request whose plan costs more than its limits before anything runs
(``service.budget``); the planner keeps plans within ``TILEWISE_MEMORY_BUDGET``
(:mod:`models.planning.sizing`); a dry run reports the same figures.

Memory, worked out for an image of ``V`` voxels (output ``V_out``), ``C_in`` input and ``C_out`` output
channels, batch ``B`` of tiles of ``T`` voxels (outputs ``T_out``), ``F`` the network's working memory
(:meth:`models.measure.footprint.Footprint.working_bytes`, measured at warm-up: activations, scratch and the
batch's prediction)::

    preprocessed input      4 * C_in * V        (0 when the decoded input is float32 and unchanged)
    batch buffers           2 * 4 * B * C_in * T                 (two with the prefetch thread)
    the network             F(T, B)
    accumulator (overlap)   4 * C_out * T_out[0] * prod(out_shape[1:])   (one slab of tile rows)
    output                  4 * C_out * V_out (probabilities) or V_out (uint8 labels); at most
                            STREAMED_OUTPUT_BYTES when it is written to disk as it finishes
    tta=mirror              + 4 * C_in * V (a flipped copy) + 2 * 4 * C_out * V_out (sum, pass)

The request adds the decoded input itself (``input_bytes``). E.g. ``gaussian-3d`` (73 B per voxel
measured at batch 2) on 192^3 with its default tile 64 and batch 2: 28 MB decoded, no copy, 4 MB of
buffers, 38 MB for the network, 28 MB out: about 98 MB (measured: within 25 %, see
``tests/models/test_cost_accuracy.py``).

Time: :meth:`~models.measure.footprint.Footprint.seconds` of the plan's forward passes and voxels (network
time only: reading, merging and encoding are left out).
"""

from __future__ import annotations

import math

from models.measure.footprint import Footprint
from models.planning.params import OutputKind
from models.planning.plan import RunPlan

__all__ = ["STREAMED_OUTPUT_BYTES", "network_seconds", "peak_bytes"]

_F32 = 4
#: Resident bytes of an output written to disk as it finishes (``output_on_disk``): the pages a
#: memory-mapped output holds before they are handed back (``service.paged``).
STREAMED_OUTPUT_BYTES = 64 << 20


def peak_bytes(
    plan: RunPlan,
    in_channels: int,
    out_channels: int,
    footprint: Footprint | None = None,
    *,
    input_bytes: int = 0,
    copies_input: bool = True,
    output_on_disk: bool = False,
) -> int:
    """Bytes a run of ``plan`` holds at its peak (see the module docstring).

    Args:
        plan: the plan.
        in_channels, out_channels: the model's channels.
        footprint: the network's measured footprint (default: :meth:`Footprint.estimate`).
        input_bytes: the decoded input's bytes, held beside the run.
        copies_input: whether preprocessing makes a float32 copy of the input (``False`` when the
            decoded input is float32 and the spec has no preprocessing step).
        output_on_disk: the output is written to a file as it finishes (a streamed request):
            it holds at most :data:`STREAMED_OUTPUT_BYTES`.
    """
    fp = footprint or Footprint.estimate(in_channels)
    grid = plan.grid
    voxels = math.prod(plan.spatial_shape)
    out_voxels = math.prod(grid.out_shape)
    batch = min(plan.batch_size, grid.n_tiles)
    tile = math.prod(grid.used_tile_shape)
    total = int(input_bytes)
    total += _F32 * in_channels * voxels if copies_input else 0
    total += 2 * _F32 * batch * in_channels * tile
    total += fp.working_bytes(tile, batch)
    if grid.blended:
        total += _F32 * out_channels * grid.out_tile_shape[0] * math.prod(grid.out_shape[1:])
    labels = plan.output == OutputKind.LABELS
    out_bytes = out_voxels if labels else _F32 * out_channels * out_voxels
    total += min(out_bytes, STREAMED_OUTPUT_BYTES) if output_on_disk else out_bytes
    if len(plan.flips) > 1:
        total += _F32 * in_channels * voxels + 2 * _F32 * out_channels * out_voxels
    return int(total)


def network_seconds(plan: RunPlan, footprint: Footprint) -> float:
    """Predicted network time of ``plan`` (every ``tta`` pass), from the measured throughput."""
    grid = plan.grid
    passes = -(-grid.n_tiles // max(1, plan.batch_size)) * len(plan.flips)
    voxels = plan.n_tiles * math.prod(grid.used_tile_shape)
    return footprint.seconds(passes, voxels)

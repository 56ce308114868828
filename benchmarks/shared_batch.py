"""Shared batches against one request at a time, on a simulated accelerator (issue 20 item 5).

The simulated device is a predictor whose forward pass costs a fixed time per call whatever its
batch (``--cost-ms``, as a GPU kernel launch does for small batches) and releases the GIL while
it "runs" (a sleep), so the requests' CPU work (reading, padding, merging tiles) can overlap it.

Two runs of the same ``--requests`` requests (2D images of ``--tiles`` tiles each, planned with
``--plan-batch`` tiles per forward pass):

- one at a time: each request alone, its own forward passes;
- shared: all requests at once, every forward pass filled by :class:`models.execution.batching.SharedBatcher`
  (``--batch`` tiles, round robin by request, ``--wait-ms`` to fill).

Reported: forward calls, wall time, device busy fraction (time inside forward passes / wall),
where the shared device waited (before its first pass: the requests starting; between passes;
after its last: the requests merging their last tiles), and the forward-call reduction. With
``--rounds R`` each of the clients sends ``R`` requests one after another (a server under steady
load); ``R = 1`` is one burst, whose start and end are a larger share of a short run.
Outputs are checked equal to the one-at-a-time run.

Usage: ``python -m benchmarks.shared_batch [--requests 8] [--tiles 4] [--plan-batch 8 1] [--rounds 1 4]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np
import torch

from models.execution.batching import SharedBatcher
from tiling import TileGrid, tiled_inference


class SimulatedDevice:
    """A predictor that costs ``cost_s`` per call (a sleep: the GIL is free) and doubles its input."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s
        self.calls = 0
        self.busy_s = 0.0
        self.passes: list[tuple[float, float]] = []  # (start, end) of each forward pass
        self._lock = threading.Lock()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:  # one device: one kernel at a time
            started = time.perf_counter()
            time.sleep(self.cost_s)
            y = x * 2.0
            self.calls += 1
            ended = time.perf_counter()
            self.busy_s += ended - started
            self.passes.append((started, ended))
        return y


def _idle(device: SimulatedDevice, started: float, ended: float) -> dict[str, float]:
    """Where the device waited: before its first pass, between passes (sum and largest), after its
    last, in milliseconds."""
    gaps = [b[0] - a[1] for a, b in zip(device.passes, device.passes[1:], strict=False)]
    return {
        "before_first_ms": round((device.passes[0][0] - started) * 1e3, 1),
        "between_ms": round(sum(gaps) * 1e3, 1),
        "largest_gap_ms": round(max(gaps, default=0.0) * 1e3, 1),
        "after_last_ms": round((ended - device.passes[-1][1]) * 1e3, 1),
    }


def _images(n: int, tiles: int, size: int = 256) -> tuple[list[np.ndarray], TileGrid]:
    rng = np.random.default_rng(0)
    cols = max(1, tiles // 2)
    rows = max(1, tiles // cols)
    shape = (rows * (size - 16) + 16, cols * (size - 16) + 16)
    grid = TileGrid.plan(shape, size, 8)
    return [rng.random((1, *shape), dtype=np.float32) for _ in range(n)], grid


def run(
    requests: int,
    tiles: int,
    plan_batch: int,
    batch: int,
    cost_ms: float,
    wait_ms: float,
    rounds: int = 1,
) -> dict[str, Any]:
    """The figures of both runs (see the module docstring). ``rounds``: requests each of the
    ``requests`` clients sends one after another (so ``requests`` run at once throughout)."""
    images, grid = _images(requests, tiles)
    solo_device = SimulatedDevice(cost_ms / 1000)
    started = time.perf_counter()
    solo = [tiled_inference(x, solo_device, grid=grid, batch_size=plan_batch) for x in images]
    for _ in range(rounds - 1):
        for x in images:
            tiled_inference(x, solo_device, grid=grid, batch_size=plan_batch)
    solo_wall = time.perf_counter() - started

    device = SimulatedDevice(cost_ms / 1000)
    fills: list[tuple[int, int]] = []
    batcher = SharedBatcher(
        device, batch, wait_s=wait_ms / 1000, on_batch=lambda t, r, _s: fills.append((t, r))
    )
    shared: list[Any] = [None] * requests

    def one(k: int) -> None:
        for _ in range(rounds):
            shared[k] = tiled_inference(images[k], batcher.client(), grid=grid, batch_size=plan_batch)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(requests)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended = time.perf_counter()
    wall = ended - started
    batcher.close()
    worst = max(float(np.abs(a - b).max()) for a, b in zip(shared, solo, strict=True))
    return {
        "requests": requests,
        "rounds": rounds,
        "tiles_per_request": grid.n_tiles,
        "plan_batch": plan_batch,
        "shared_batch": batch,
        "cost_ms": cost_ms,
        "one_at_a_time": {
            "forward_calls": solo_device.calls,
            "wall_s": round(solo_wall, 3),
            "busy": round(solo_device.busy_s / solo_wall, 3),
        },  # fmt: skip
        "shared": {
            "forward_calls": device.calls,
            "wall_s": round(wall, 3),
            "busy": round(device.busy_s / wall, 3),
            "idle": _idle(device, started, ended),
            "mean_fill": round(float(np.mean([t for t, _ in fills])), 2),
            "max_requests_per_pass": max(r for _, r in fills),
        },  # fmt: skip
        "forward_call_reduction": round(solo_device.calls / device.calls, 2),
        "max_abs_diff_vs_alone": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--plan-batch", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cost-ms", type=float, default=50.0)
    parser.add_argument("--wait-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    for rounds in args.rounds:
        for plan_batch in args.plan_batch:
            result = run(
                args.requests, args.tiles, plan_batch, args.batch, args.cost_ms, args.wait_ms, rounds
            )
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared batches (issue 20 item 5): tiles of concurrent requests in one forward pass.

Oracle: each request run alone (:func:`tiling.tiled_inference` with the model's own predictor)
and ``scipy.ndimage.gaussian_filter`` (the gaussian-2d model's oracle). Eight requests of four
tiles each, batch size 8, run concurrently through one :class:`models.execution.batching.SharedBatcher`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch

from models import ModelRepository
from models.execution.batching import SharedBatcher
from tiling import TileGrid, tiled_inference


@pytest.fixture(scope="module")
def model() -> Any:
    return ModelRepository(None, device="cpu").get("gaussian-2d")


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.random((1, 61, 59), dtype=np.float32) for _ in range(8)]  # one tile shape


def _threshold(region: torch.Tensor) -> torch.Tensor:
    return (region > 0.5).to(torch.uint8)


def test_eight_concurrent_requests_share_batches_and_equal_their_solo_runs(model: Any) -> None:
    images = _images()
    grids = [TileGrid.plan(x.shape[1:], 48, 8) for x in images]
    assert all(g.n_tiles == 4 for g in grids)
    seen: list[tuple[int, int]] = []
    batcher = SharedBatcher(model.predictor, 8, wait_s=0.05, on_batch=lambda t, r, s: seen.append((t, r)))
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    start = threading.Barrier(8)

    def run(k: int) -> None:
        predict = batcher.client()
        start.wait()
        values = tiled_inference(images[k], predict, grid=grids[k], batch_size=2)
        labels = tiled_inference(images[k], predict, grid=grids[k], batch_size=2, reduce=_threshold)
        results[k] = (values, labels)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    batcher.close()
    assert len(results) == 8
    assert max(r for _, r in seen) > 1  # forward passes held tiles of several requests
    assert sum(t for t, _ in seen) == 2 * 8 * 4 and max(t for t, _ in seen) <= 8
    assert batcher.forward_calls < 2 * 8 * 2  # fewer than the requests' own 2-tile batches
    for k, x in enumerate(images):
        solo = tiled_inference(x, model.predictor, grid=grids[k], batch_size=2)
        solo_labels = tiled_inference(x, model.predictor, grid=grids[k], batch_size=2, reduce=_threshold)
        values, labels = results[k]
        assert float(np.abs(values - solo).max()) <= 1e-6
        assert np.array_equal(labels, solo_labels)
        oracle = ndi.gaussian_filter(x[0].astype(np.float64), 2.0, truncate=4.0, mode="constant")
        assert float(np.abs(values[0] - oracle).max()) < 1e-5


def test_a_failing_forward_pass_fails_only_its_requests() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    batcher = SharedBatcher(broken, 4, wait_s=0.001)
    with pytest.raises(RuntimeError, match="device lost"):
        batcher.client()(torch.zeros(2, 1, 8, 8))
    batcher.close()


def test_simulated_accelerator_benchmark_cuts_forward_calls() -> None:
    """benchmarks/shared_batch on a small case: 8 requests of 4 tiles planned one tile per pass
    take 32 forward calls alone and at most a third of that shared (ratios, not times)."""
    from benchmarks.shared_batch import run

    result = run(requests=8, tiles=4, plan_batch=1, batch=8, cost_ms=5.0, wait_ms=20.0)
    assert result["one_at_a_time"]["forward_calls"] == 32
    assert result["forward_call_reduction"] >= 3, result
    assert result["shared"]["max_requests_per_pass"] > 1 and result["max_abs_diff_vs_alone"] == 0.0
    assert 0 < result["shared"]["busy"] <= 1 and 0 < result["one_at_a_time"]["busy"] <= 1


def test_the_next_batch_waits_beside_the_device_while_it_runs_the_current_one() -> None:
    """The engine hands a queued predictor (``client().submit``) its next batch before merging the
    current one, so during every forward pass but the last the batcher already holds the next
    tiles: the device never waits for the request's Python work (no timing: the pass waits, up
    to 10 s, until it sees them)."""
    rng = np.random.default_rng(1)
    x = rng.random((1, 53, 47), dtype=np.float32)
    grid = TileGrid.plan(x.shape[1:], 24, 4)
    n = grid.n_tiles
    seen: list[int] = []
    holder: dict[str, SharedBatcher] = {}

    def device(batch: torch.Tensor) -> torch.Tensor:
        b = holder["b"]
        deadline = time.monotonic() + 10
        with b._lock:
            while len(seen) < n - 1 and b._pending() + b._ready.qsize() == 0 and time.monotonic() < deadline:
                b._lock.wait(0.02)
            seen.append(b._pending() + b._ready.qsize())
        return batch * 2

    batcher = SharedBatcher(device, 1, wait_s=0.0)
    holder["b"] = batcher
    try:
        y = tiled_inference(x, batcher.client(), grid=grid, batch_size=1)
    finally:
        batcher.close()
    assert n >= 4 and len(seen) == n and batcher.forward_calls == n
    assert all(k >= 1 for k in seen[: n - 1]), seen
    assert np.array_equal(y, 2 * x)


def test_a_requests_batch_size_raises_the_pass_it_waits_to_fill() -> None:
    """Two requests of 4 tiles that ask for passes of 8 (the batcher's default is 4) share one
    pass of 8, the second arriving while the first's tiles wait (no timing: the second is sent
    before the first's tiles can go, the pass waiting up to 10 s). Before, the first request's own
    4 tiles filled a pass of 4 at once."""
    seen: list[tuple[int, int]] = []
    batcher = SharedBatcher(lambda x: x * 2, 4, wait_s=10.0, on_batch=lambda t, r, s: seen.append((t, r)))
    try:
        first = batcher.client(batch_size=8).submit(torch.ones(4, 1, 8, 8))  # type: ignore[attr-defined]
        second = batcher.client(batch_size=8).submit(torch.full((4, 1, 8, 8), 3.0))  # type: ignore[attr-defined]
        assert float(first.result().max()) == 2.0 and float(second.result().min()) == 6.0
    finally:
        batcher.close()
    assert seen == [(8, 2)]
    assert batcher.forward_calls == 1

"""Shared batches under faults (review item 5): a predictor that returns fewer rows than tiles,
an ``on_batch`` callback that raises, a cancelled waiting caller. Each request fails with a clear
error and the batcher's threads keep serving the next request."""

from __future__ import annotations

import threading
import time

import torch

from models.execution.batching import SharedBatcher
from tiling import RunCancelledError


def test_fewer_output_rows_than_tiles_fails_the_request_and_the_next_one_runs() -> None:
    short = {"on": True}

    def predictor(x: torch.Tensor) -> torch.Tensor:
        return x[:-1] * 2 if short["on"] else x * 2

    batcher = SharedBatcher(predictor, 4, wait_s=0.001)
    try:
        done: dict[str, object] = {}

        def first() -> None:
            try:
                batcher.client()(torch.ones(3, 1, 5, 5))
            except Exception as exc:  # noqa: BLE001 - the test reads it
                done["error"] = exc

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the caller hangs: the completer died"
        assert "2 rows" in str(done["error"]) and "3 tiles" in str(done["error"])
        short["on"] = False
        y = batcher.client()(torch.ones(2, 1, 5, 5))
        assert torch.equal(y, torch.full((2, 1, 5, 5), 2.0))
    finally:
        batcher.close()


def test_a_raising_on_batch_does_not_stop_the_batcher() -> None:
    def on_batch(tiles: int, requests: int, seconds: float) -> None:
        raise ValueError("metrics broke")

    batcher = SharedBatcher(lambda x: x + 1, 2, wait_s=0.001, on_batch=on_batch)
    try:
        for _ in range(3):
            holder: dict[str, torch.Tensor] = {}

            def run(holder: dict[str, torch.Tensor] = holder) -> None:
                holder["y"] = batcher.client()(torch.zeros(2, 1, 3, 3))

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(10)
            assert not thread.is_alive()
            assert torch.equal(holder["y"], torch.ones(2, 1, 3, 3))
    finally:
        batcher.close()


def test_a_cancel_stops_a_waiting_caller() -> None:
    release = threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        release.wait(20)
        return x

    batcher = SharedBatcher(slow, 1, wait_s=0.0)
    stop = threading.Event()
    try:
        outcome: dict[str, object] = {}

        def caller() -> None:
            try:
                batcher.client(should_stop=stop.is_set)(torch.zeros(3, 1, 4, 4))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome["error"] = exc

        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        time.sleep(0.05)
        stop.set()
        thread.join(10)
        alive = thread.is_alive()
        release.set()
        assert not alive, "a cancelled caller still waits on the device"
        assert isinstance(outcome["error"], RunCancelledError)
        assert torch.equal(batcher.client()(torch.ones(1, 1, 4, 4)), torch.ones(1, 1, 4, 4))
    finally:
        release.set()
        batcher.close()

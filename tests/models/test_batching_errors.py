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
        # the cancelled call's queued tiles were dropped: the tile on the device, at most one
        # staged beside it, and the next request's
        assert batcher.forward_calls <= 3, batcher.forward_calls
    finally:
        release.set()
        batcher.close()


def test_a_cancel_drops_the_other_queued_calls_of_that_request() -> None:
    """The engine keeps calls of a request in flight (``submit``): when the one it waits on is
    stopped, the request's calls still queued never reach the device."""
    release = threading.Event()
    seen: list[float] = []

    def slow(x: torch.Tensor) -> torch.Tensor:
        release.wait(20)
        seen.extend(float(v) for v in x[:, 0, 0, 0])
        return x

    batcher = SharedBatcher(slow, 1, wait_s=0.0)
    stop = threading.Event()
    try:
        predict = batcher.client(should_stop=stop.is_set)
        first = predict.submit(torch.zeros(2, 1, 4, 4))  # type: ignore[attr-defined]
        predict.submit(torch.full((3, 1, 4, 4), 5.0))  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while batcher._ready.qsize() == 0 and time.monotonic() < deadline:  # the 5s staged
            time.sleep(0.01)
        predict.submit(torch.full((2, 1, 4, 4), 9.0))  # type: ignore[attr-defined]
        stop.set()
        try:
            first.result()
        except RunCancelledError:
            pass
        else:
            raise AssertionError("the stopped call returned")
        release.set()
        assert torch.equal(batcher.client()(torch.ones(1, 1, 4, 4)), torch.ones(1, 1, 4, 4))
        assert 9.0 not in seen, seen  # queued behind the staged batch when the request stopped
    finally:
        release.set()
        batcher.close()

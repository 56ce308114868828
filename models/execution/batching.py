"""Shared batches: tiles of several concurrent requests in one forward pass (issue 20 item 5).

A :class:`SharedBatcher` owns one predictor (one model on one device). Each running request gets
a :meth:`~SharedBatcher.client`: a predictor-like callable that the tiling engine calls with its
own batch ``(B, C, *tile)``. The client hands its tiles to the batcher and waits; the batcher's
thread (the device thread) forms forward batches of up to ``batch_size`` tiles of one shape,
taking them round robin by request (one tile of each waiting request in turn, so no request
starves another), waits at most ``wait_s`` for a batch to fill (never when it is full already),
runs the predictor once, and hands each request its own outputs back.

For a predictor whose samples are independent (any network in eval mode without batch-level
statistics) the outputs are those of running each request alone: tiles never mix, only their
batch neighbours change. ``on_batch(tiles, requests, seconds)`` hears of every forward pass
(the server's ``tilewise_batch_fill`` and ``tilewise_batch_requests``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SharedBatcher", "bound_predictor", "current_predictor"]

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[Callable[[torch.Tensor], Any] | None] = contextvars.ContextVar(
    "tilewise_shared_predictor", default=None
)


@contextlib.contextmanager
def bound_predictor(predict: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """Within the block (in this thread's context), tiled passes call ``predict`` (a
    :meth:`SharedBatcher.client`) instead of the model's own predictor."""
    token = _CURRENT.set(predict)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_predictor(default: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """The predictor bound by :func:`bound_predictor` in this context, else ``default``."""
    bound = _CURRENT.get()
    return default if bound is None else bound


@dataclass(eq=False)
class _Call:
    """One engine call of one request: its tiles and, when done, their outputs."""

    client: int
    tiles: torch.Tensor
    outputs: list[torch.Tensor | None]
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class SharedBatcher:
    """Forward batches shared by concurrent requests (see the module docstring).

    Args:
        predictor: maps ``(B, C, *tile)`` to ``(B, C_out, *tile_out)``.
        batch_size: tiles per forward pass at most (a request whose own batches are larger
            raises it while its tiles wait).
        wait_s: how long a batch that is not full waits for more tiles (``TILEWISE_BATCH_WAIT_MS``).
        on_batch: called after each forward pass with its tile count, the number of requests
            whose tiles it held, and its seconds.
    """

    def __init__(
        self,
        predictor: Callable[[torch.Tensor], Any],
        batch_size: int,
        *,
        wait_s: float = 0.005,
        on_batch: Callable[[int, int, float], object] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.predictor = predictor
        self.batch_size = int(batch_size)
        self.wait_s = float(wait_s)
        self.on_batch = on_batch
        self.device = getattr(predictor, "device", None)
        self._ids = itertools.count()
        self._queues: OrderedDict[int, deque[tuple[_Call, int]]] = OrderedDict()
        self._lock = threading.Condition()
        self._closed = False
        self.forward_calls = 0
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="tilewise-shared-batch", daemon=True)
        self._thread.start()

    def client(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A predictor for one request: call it with that request's batches."""
        ident = next(self._ids)

        def predict(tiles: torch.Tensor) -> torch.Tensor:
            return self._submit(ident, tiles)

        predict.device = self.device  # type: ignore[attr-defined]
        return predict

    def close(self) -> None:
        """Stop the batcher thread (waiting calls fail)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(5)

    def _submit(self, client: int, tiles: torch.Tensor) -> torch.Tensor:
        n = int(tiles.shape[0])
        call = _Call(client, tiles, [None] * n, n)
        with self._lock:
            if self._closed:
                raise RuntimeError("the shared batcher is closed")
            queue = self._queues.setdefault(client, deque())
            queue.extend((call, k) for k in range(n))
            self._lock.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return torch.stack([o for o in call.outputs if o is not None])

    def _pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _target(self) -> int:
        """Tiles per forward pass now: ``batch_size``, or a waiting request's own larger batch."""
        largest = max((int(q[0][0].tiles.shape[0]) for q in self._queues.values() if q), default=0)
        return max(self.batch_size, largest)

    def _take(self) -> list[tuple[_Call, int]]:
        """Up to :meth:`_target` tiles of one shape, round robin by request (oldest request first)."""
        target = self._target()
        shape = None
        for queue in self._queues.values():
            if queue:
                shape = tuple(queue[0][0].tiles.shape[1:])
                break
        taken: list[tuple[_Call, int]] = []
        while len(taken) < target:
            progressed = False
            for client in list(self._queues):
                queue = self._queues[client]
                if queue and tuple(queue[0][0].tiles.shape[1:]) == shape and len(taken) < target:
                    taken.append(queue.popleft())
                    progressed = True
                if not queue:
                    del self._queues[client]
            if not progressed:
                break
        if self._queues:  # the next batch starts with the next request in turn
            self._queues.move_to_end(next(iter(self._queues)))
        return taken

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and self._pending() == 0:
                    self._lock.wait()
                if self._closed:
                    self._fail_all(RuntimeError("the shared batcher is closed"))
                    return
                deadline = time.monotonic() + self.wait_s
                while self._pending() < self._target() and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
                batch = self._take()
            if batch:
                self._run(batch)

    def _run(self, batch: list[tuple[_Call, int]]) -> None:
        started = time.perf_counter()
        try:
            x = torch.stack([call.tiles[k] for call, k in batch])
            with torch.inference_mode():
                y = self.predictor(x)
            if not isinstance(y, torch.Tensor):
                y = torch.as_tensor(y)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting request of the batch
            for call, _ in batch:
                call.error = exc
                call.done.set()
            return
        seconds = time.perf_counter() - started
        self.forward_calls += 1
        self.busy_s += seconds
        requests = len({call.client for call, _ in batch})
        for j, (call, k) in enumerate(batch):
            call.outputs[k] = y[j]
            call.left -= 1
            if call.left == 0:
                call.done.set()
        if self.on_batch is not None:
            self.on_batch(len(batch), requests, seconds)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            for call, _ in queue:
                call.error = exc
                call.done.set()
        self._queues.clear()

"""Shared batches: tiles of several concurrent requests in one forward pass (issue 20 item 5).

A :class:`SharedBatcher` owns one predictor (one model on one device). Each running request gets
a :meth:`~SharedBatcher.client`: a predictor-like callable that the tiling engine calls with its
own batch ``(B, C, *tile)``. The client hands its tiles to the batcher and waits; the batcher's
assembler thread forms forward batches of up to ``batch_size`` tiles of one shape, taking them
round robin by request (one tile of each waiting request in turn, so no request starves
another), waits at most ``wait_s`` for a batch to fill (never when it is full already) and
stacks it while the device thread runs the previous one; the device thread only runs the
predictor; a completer thread hands each request its own outputs back. The engine keeps two
batches of a request in flight (``client().submit``), so the next forward batch is formed
while the current one runs: the device waits for Python work only when no request has tiles.

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
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tiling import RunCancelledError, ShapeMismatchError

__all__ = ["SharedBatcher", "bound_predictor", "current_predictor"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting call asks its should_stop

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
    """One engine call of one request: its tiles and, when done, their outputs.

    :meth:`result` waits for them (the request's thread stacks them, off the device thread).
    """

    client: int
    tiles: torch.Tensor
    outputs: list[torch.Tensor | None]
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    should_stop: Callable[[], bool] | None = None
    #: The client's: set when one of its calls was stopped, so its other queued calls are dropped.
    stopped: threading.Event | None = None
    #: Tiles per forward pass the request's plan asked for (its ``batch_size``; 0: its call's size).
    batch: int = 0

    @property
    def dropped(self) -> bool:
        """Whether nobody needs this call's outputs any more (it ended, or its client stopped)."""
        return self.done.is_set() or (self.stopped is not None and self.stopped.is_set())

    def fail(self, error: BaseException) -> None:
        """End the call with ``error`` (the first error wins)."""
        if not self.done.is_set():
            self.error = error
            self.done.set()

    def result(self) -> torch.Tensor:
        """``(B, C_out, *tile_out)``: this call's outputs, once its forward passes ran.

        Waits in slices of ``_POLL_S`` seconds, asking ``should_stop`` (the client's) between them.

        Raises:
            RunCancelledError: ``should_stop()`` returned true while the call waited (its tiles
                still queued are dropped).
            BaseException: whatever the forward pass holding one of its tiles raised, or the
                batcher's error when the pass's output did not fit.
        """
        while not self.done.wait(_POLL_S):
            if self.should_stop is not None and self.should_stop():
                if self.stopped is not None:
                    self.stopped.set()
                self.fail(RunCancelledError("stopped by the caller while its tiles waited for the device"))
        if self.error is not None:
            raise self.error
        return torch.stack([o for o in self.outputs if o is not None])


@dataclass(eq=False)
class _Staged:
    """A batch formed and stacked, waiting for the device (or run by it)."""

    taken: list[tuple[_Call, int]]
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class SharedBatcher:
    """Forward batches shared by concurrent requests (see the module docstring).

    Three threads, so the device thread only runs forward passes: the *assembler* forms the next
    batch (round robin by request) and stacks its tiles while the device runs the current one;
    the *device* thread calls the predictor; the *completer* hands each request its outputs. A
    request's client also has ``submit(tiles) -> handle`` (``handle.result()`` waits): the tiling
    engine then hands in its next batch before it merges the current one, so the assembler has
    tiles to form the next forward batch while the device is busy (:mod:`tiling.engine`).

    Args:
        predictor: maps ``(B, C, *tile)`` to ``(B, C_out, *tile_out)``.
        batch_size: tiles per forward pass at most (a request whose own batches are larger
            raises it while its tiles wait).
        wait_s: how long a batch that is not full waits for more tiles (``TILEWISE_BATCH_WAIT_MS``).
        on_batch: called after each forward pass with its tile count, the number of requests
            whose tiles it held, and its seconds.

    Attributes:
        forward_calls: forward passes run so far.
        busy_s: seconds spent in the predictor.
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
        # one staged batch waits while the device runs another: the next is formed meanwhile
        self._ready: queue.Queue[_Staged | None] = queue.Queue(maxsize=1)
        self._done: queue.Queue[_Staged | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=target, name=f"tilewise-shared-{name}", daemon=True)
            for target, name in ((self._assemble, "assemble"), (self._device, "device"),
                                 (self._complete, "complete"))
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def client(
        self, should_stop: Callable[[], bool] | None = None, batch_size: int | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A predictor for one request: call it with that request's batches (or ``submit`` them).

        Args:
            should_stop: asked every ``0.1`` s while the request waits for its outputs; true
                raises :class:`tiling.RunCancelledError` there and drops its queued tiles.
            batch_size: the request's plan's tiles per forward pass: while its tiles wait, a
                forward pass waits (up to ``wait_s``) to hold that many, even when the request
                has fewer left (8 requests of 4 tiles at ``batch_size=8`` share passes of 8);
                ``None``: its calls' sizes.
        """
        ident = next(self._ids)
        stopped = threading.Event()
        batch = int(batch_size or 0)

        def submit(tiles: torch.Tensor) -> _Call:
            return self._submit(ident, tiles, should_stop, stopped, batch)

        def predict(tiles: torch.Tensor) -> torch.Tensor:
            return self._submit(ident, tiles, should_stop, stopped, batch).result()

        predict.device = self.device  # type: ignore[attr-defined]
        predict.submit = submit  # type: ignore[attr-defined]
        return predict

    def close(self) -> None:
        """Stop the threads (waiting calls fail)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(5)

    def _submit(
        self,
        client: int,
        tiles: torch.Tensor,
        should_stop: Callable[[], bool] | None = None,
        stopped: threading.Event | None = None,
        batch: int = 0,
    ) -> _Call:
        n = int(tiles.shape[0])
        call = _Call(
            client, tiles, [None] * n, n, should_stop=should_stop, stopped=stopped, batch=max(batch, n)
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the shared batcher is closed")
            queue_ = self._queues.setdefault(client, deque())
            queue_.extend((call, k) for k in range(n))
            self._lock.notify_all()
        return call

    def _pending(self) -> int:
        self._drop_cancelled()
        return sum(len(q) for q in self._queues.values())

    def _drop_cancelled(self) -> None:
        """Forget the queued tiles of calls that ended already (cancelled or failed), and of every
        call of a client one of whose calls was stopped."""
        for client in list(self._queues):
            queue_ = self._queues[client]
            first = queue_[0][0] if queue_ else None
            if first is not None and first.stopped is not None and first.stopped.is_set():
                error = RunCancelledError("stopped by the caller while its tiles waited for the device")
                for call, _ in queue_:
                    call.fail(error)
            if any(call.done.is_set() for call, _ in queue_):
                kept = deque((call, k) for call, k in queue_ if not call.done.is_set())
                if kept:
                    self._queues[client] = kept
                else:
                    del self._queues[client]

    def _target(self) -> int:
        """Tiles per forward pass now: ``batch_size``, or a waiting request's own larger batch (its
        plan's ``batch_size``, or its call's size)."""
        largest = max((int(q[0][0].batch) for q in self._queues.values() if q), default=0)
        return max(self.batch_size, largest)

    def _take(self) -> list[tuple[_Call, int]]:
        """Up to :meth:`_target` tiles of one shape, round robin by request (oldest request first)."""
        self._drop_cancelled()
        target = self._target()
        shape = None
        for queue_ in self._queues.values():
            if queue_:
                shape = tuple(queue_[0][0].tiles.shape[1:])
                break
        taken: list[tuple[_Call, int]] = []
        while len(taken) < target:
            progressed = False
            for client in list(self._queues):
                queue_ = self._queues[client]
                if queue_ and tuple(queue_[0][0].tiles.shape[1:]) == shape and len(taken) < target:
                    taken.append(queue_.popleft())
                    progressed = True
                if not queue_:
                    del self._queues[client]
            if not progressed:
                break
        if self._queues:  # the next batch starts with the next request in turn
            self._queues.move_to_end(next(iter(self._queues)))
        return taken

    def _assemble(self) -> None:
        """Form batches (full, or after ``wait_s``) and stack them, ahead of the device."""
        try:
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
                    taken = self._take()
                if not taken:
                    continue
                staged = _Staged(taken)
                try:
                    staged.x = _stacked(taken)
                except BaseException as exc:  # noqa: BLE001 - handed to the batch's requests
                    staged.error = exc
                    self._done.put(staged)
                    continue
                while True:  # blocks while a staged batch still waits for the device
                    try:
                        self._ready.put(staged, timeout=0.1)
                        break
                    except queue.Full:
                        if self._closed:
                            staged.error = RuntimeError("the shared batcher is closed")
                            self._done.put(staged)
                            break
        finally:
            self._ready.put(None)

    def _device(self) -> None:
        """The device thread: forward passes only."""
        try:
            while True:
                staged = self._ready.get()
                if staged is None:
                    return
                if all(call.dropped for call, _ in staged.taken):  # every request of it stopped
                    staged.error = RunCancelledError(
                        "stopped by the caller while its tiles waited for the device"
                    )
                    staged.x = None
                    self._done.put(staged)
                    continue
                started = time.perf_counter()
                try:
                    assert staged.x is not None  # a batch reaches the device only once stacked
                    with torch.inference_mode():
                        y = self.predictor(staged.x)
                    y = y if isinstance(y, torch.Tensor) else torch.as_tensor(y)
                    if y.ndim == 0 or int(y.shape[0]) != len(staged.taken):
                        rows = 0 if y.ndim == 0 else int(y.shape[0])
                        raise ShapeMismatchError(
                            f"the predictor returned {rows} rows for {len(staged.taken)} tiles "
                            f"(output shape {tuple(y.shape)}); expected one output per tile"
                        )
                    staged.y = y
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting request of the batch
                    staged.error = exc
                staged.seconds = time.perf_counter() - started
                staged.x = None
                self.forward_calls += 1
                self.busy_s += staged.seconds
                self._done.put(staged)
        finally:
            self._done.put(None)

    def _complete(self) -> None:
        """Hand each request its outputs (off the device thread); never dies on one batch's error."""
        while True:
            staged = self._done.get()
            if staged is None:
                return
            try:
                self._hand_back(staged)
            except BaseException as exc:  # noqa: BLE001 - fails this batch's calls, keeps serving
                logger.exception("shared batch: handing back a forward pass failed")
                for call, _ in staged.taken:
                    call.fail(exc)
            if self.on_batch is not None and staged.error is None and staged.y is not None:
                try:
                    self.on_batch(len(staged.taken), len({c.client for c, _ in staged.taken}), staged.seconds)
                except Exception:  # noqa: BLE001 - a metrics callback never stops the batcher
                    logger.exception("shared batch: on_batch raised")

    def _hand_back(self, staged: _Staged) -> None:
        if staged.error is not None or staged.y is None:
            error = staged.error or RuntimeError("the forward pass returned nothing")
            for call, _ in staged.taken:
                call.fail(error)
            return
        y = staged.y
        for j, (call, k) in enumerate(staged.taken):
            if call.done.is_set():  # cancelled or failed meanwhile
                continue
            call.outputs[k] = y[j]
            call.left -= 1
            if call.left == 0:
                call.done.set()

    def _fail_all(self, exc: BaseException) -> None:
        for queue_ in self._queues.values():
            for call, _ in queue_:
                call.fail(exc)
        self._queues.clear()


def _stacked(taken: list[tuple[_Call, int]]) -> torch.Tensor:
    """The batch's input: one call's own tensor when the batch is all of it in order, else a stack."""
    first = taken[0][0]
    whole = list(range(int(first.tiles.shape[0])))
    if all(call is first for call, _ in taken) and [k for _, k in taken] == whole:
        return first.tiles
    return torch.stack([call.tiles[k] for call, k in taken])

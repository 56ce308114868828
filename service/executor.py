"""One inference executor per device: a worker thread fed by a bounded queue.

The event loop never runs inference: a route submits a job and awaits it. A route first takes a
slot with :meth:`DeviceExecutor.reserve` (before it reads the upload), then turns the slot into a
job with :meth:`DeviceExecutor.submit_future`; when every slot is taken (``queue_size`` waiting
plus the running one), :meth:`~DeviceExecutor.reserve` raises
:class:`~service.errors.QueueFullError` at once (HTTP 503 with ``Retry-After``), so neither jobs
nor uploads pile up without bound. A job whose awaiting coroutine is cancelled before the job
started (its client disconnected) is dropped from the queue and frees its slot immediately.

A client (:func:`service.clients.client_of`: its API key's name, or its address) holds at most
``client_slots`` slots at once, reserved or queued or running (``TILEWISE_MAX_CLIENT_SHARE`` of
them): one client flooding the queue gets 503 for its own extra requests while the others are
still let in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from service.errors import NotReadyError, QueueFullError

__all__ = ["DeviceExecutor", "Slot"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Slot:
    """A place in a :class:`DeviceExecutor`'s queue, held while a request uploads its input.

    :meth:`DeviceExecutor.submit_future` consumes it; :meth:`release` gives it back unused (a
    no-op once consumed or released), so a ``finally: slot.release()`` never leaks a place.
    """

    __slots__ = ("_executor", "client", "held")

    def __init__(self, executor: DeviceExecutor, client: str | None = None) -> None:
        self._executor = executor
        self.held = True
        self.client = client

    def release(self) -> None:
        """Give the place back unless a job took it (idempotent)."""
        self._executor._release(self)

    def hand_over(self) -> Slot:
        """The same place under a new holder (a job's own thread, which submits later); this one
        is then used (its :meth:`release` is a no-op).

        Raises:
            RuntimeError: the slot was already used or released.
        """
        with self._executor._lock:
            if not self.held:
                raise RuntimeError("the slot was already used or released")
            self.held = False
            return Slot(self._executor, self.client)


class DeviceExecutor:
    """Runs jobs one at a time on a dedicated thread, with at most ``queue_size`` waiting.

    Args:
        device: the device this executor owns (for the thread name and logs).
        queue_size: jobs allowed to wait while one runs (``0``: only the running one).
        retry_after_s: the ``Retry-After`` hint carried by :class:`QueueFullError`.
        on_depth: called with the number of held slots plus queued and running jobs whenever it
            changes.
        after_job: called on the worker thread after each job (e.g. to release free memory).
        workers: jobs run at once (``TILEWISE_SHARED_REQUESTS``; their forward passes share
            batches, :mod:`service.sharing`); 1 by default: one job at a time.
        client_slots: the most slots one client may hold at once (``None``: no per-client bound).
    """

    def __init__(
        self,
        device: str,
        queue_size: int,
        *,
        retry_after_s: int = 1,
        on_depth: Callable[[int], None] | None = None,
        after_job: Callable[[], object] | None = None,
        workers: int = 1,
        client_slots: int | None = None,
    ) -> None:
        self.device = device
        self.queue_size = queue_size
        self.client_slots = client_slots
        self._clients: dict[str, int] = {}  # slots held per client (reserved, queued or running)
        self.retry_after_s = retry_after_s
        self._on_depth = on_depth
        self._after_job = after_job
        self._jobs: deque[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = deque()
        self._running = 0
        self._reserved = 0
        self._closed = False
        self._lock = threading.Condition()
        self.workers = max(1, int(workers))
        self._threads = [
            threading.Thread(target=self._work, name=f"tilewise-infer-{device}-{n}", daemon=True)
            for n in range(self.workers)
        ]
        self._thread = self._threads[0]
        for thread in self._threads:
            thread.start()

    @property
    def depth(self) -> int:
        """Held slots plus jobs waiting plus the job running."""
        with self._lock:
            return self._load()

    def _load(self) -> int:
        return self._reserved + len(self._jobs) + self._running

    def _full(self) -> bool:
        # The running jobs hold no queue slot: an idle worker takes a job at once.
        return self._load() >= self.queue_size + self.workers

    def has_room(self) -> bool:
        """Whether a slot taken now would be granted (a hint: it may change at once)."""
        with self._lock:
            return not self._closed and not self._full()

    def has_room_for(self, client: str | None) -> bool:
        """Whether a slot taken now by ``client`` would be granted (a hint)."""
        with self._lock:
            return not self._closed and not self._full() and not self._client_full(client)

    def _client_full(self, client: str | None) -> bool:
        return (
            client is not None
            and self.client_slots is not None
            and self._clients.get(client, 0) >= self.client_slots
        )

    def reserve(self, client: str | None = None) -> Slot:
        """Take a slot for a job to be submitted later (e.g. once its upload is on disk), for
        ``client`` (counted against its share until the job ends; ``None``: not counted).

        Raises:
            QueueFullError: every slot is held or taken, or ``client`` holds its share.
            NotReadyError: the executor is shut down.
        """
        with self._lock:
            if self._closed:
                raise NotReadyError("the inference executor is shut down")
            if self._full():
                raise self.full_error()
            if self._client_full(client):
                raise self.client_full_error()
            self._reserved += 1
            if client is not None:
                self._clients[client] = self._clients.get(client, 0) + 1
            self._notify()
        return Slot(self, client)

    def _forget(self, client: str | None) -> None:
        """One slot of ``client`` is given back (call with the lock held)."""
        if client is not None and client in self._clients:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot.held:
                slot.held = False
                self._reserved -= 1
                self._forget(slot.client)
                self._notify()

    def client_full_error(self) -> QueueFullError:
        """The error for a client that holds its share of the queue."""
        return QueueFullError(
            f"this client holds {self.client_slots} of the {self.queue_size + 1} inference slots, its "
            f"share (TILEWISE_MAX_CLIENT_SHARE); retry in {self.retry_after_s} s",
            retry_after_s=self.retry_after_s,
        )

    def full_error(self) -> QueueFullError:
        """The error for a full queue (with this executor's ``Retry-After`` hint)."""
        return QueueFullError(
            f"the {self.device} inference queue is full ({self.queue_size} waiting); "
            f"retry in {self.retry_after_s} s",
            retry_after_s=self.retry_after_s,
        )

    def _notify(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self._load())

    def submit_future(self, fn: Callable[[], T], *, slot: Slot | None = None) -> concurrent.futures.Future[T]:
        """Queue ``fn`` in ``slot`` (from :meth:`reserve`), or in a free slot when ``slot`` is
        ``None``; returns a future. Cancelling it before it starts frees the slot.

        Raises:
            QueueFullError: no slot is given and every slot is taken.
            RuntimeError: the executor is shut down, or ``slot`` was already used or released,
                or belongs to another executor.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        client: str | None = None
        with self._lock:
            if self._closed:
                raise RuntimeError("the inference executor is shut down")
            if slot is None:
                if self._full():
                    raise self.full_error()
            elif slot._executor is not self or not slot.held:
                raise RuntimeError("the slot was already used or released, or is not this executor's")
            else:
                slot.held = False
                self._reserved -= 1
                client = slot.client  # the job holds the client's slot until it ends
            self._jobs.append((future, fn))
            self._notify()
            self._lock.notify()
        if client is not None:
            future.add_done_callback(lambda _: self._end_of(client))
        future.add_done_callback(self._on_done)
        return future

    def _end_of(self, client: str) -> None:
        with self._lock:
            self._forget(client)

    async def run(self, fn: Callable[[], T]) -> T:
        """Queue ``fn`` and await its result without blocking the event loop.

        If the awaiting task is cancelled (client gone) while the job still waits, the job is
        dropped; a job already running completes and its result is discarded.
        """
        future = self.submit_future(fn)
        return await asyncio.wrap_future(future)

    def _on_done(self, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled():
            return
        with self._lock:
            for index, (queued, _) in enumerate(self._jobs):
                if queued is future:
                    del self._jobs[index]
                    logger.info("dropped a queued job whose client went away")
                    self._notify()
                    break

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if not self._jobs:
                    return
                future, fn = self._jobs.popleft()
                if not future.set_running_or_notify_cancel():
                    self._notify()
                    continue
                self._running += 1
                self._notify()
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self._running -= 1
                    self._notify()
                # Drop references so a finished job's arrays are freed before the next one.
                del future, fn
                if self._after_job is not None:
                    try:
                        self._after_job()
                    except Exception:
                        logger.exception("after-job hook failed")

    def waiting(self) -> int:
        """Jobs queued, not yet started."""
        with self._lock:
            return len(self._jobs)

    def position(self, future: concurrent.futures.Future[Any]) -> int | None:
        """The place of ``future``'s job in the queue (1 = next), or ``None`` once it runs or ended."""
        with self._lock:
            for index, (queued, _) in enumerate(self._jobs):
                if queued is future:
                    return index + 1
        return None

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the worker to end (after :meth:`shutdown`); ``True``
        when it has."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop accepting jobs, cancel the waiting ones and (optionally) join the worker."""
        with self._lock:
            self._closed = True
            pending = list(self._jobs)
            self._jobs.clear()
            self._lock.notify_all()
        for future, _ in pending:
            future.cancel()
        if wait:
            for thread in self._threads:
                thread.join()

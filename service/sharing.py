"""Shared forward batches in the server: one :class:`models.execution.batching.SharedBatcher` per model.

With ``TILEWISE_SHARED_REQUESTS`` above 1 the device executor runs that many requests at once
(their reading, preprocessing and merging overlap) and every tiled pass of a model goes through
its batcher: tiles of all running requests of that model and tile shape fill one forward batch of
the spec's ``batch_size`` (at least the request's), round robin by request, waiting at most
``TILEWISE_BATCH_WAIT_MS`` to fill. Metrics: ``tilewise_batch_fill`` (tiles per forward pass)
and ``tilewise_batch_requests`` (requests per forward pass). Global-pooling models keep their own
passes (their pool means are state on the predictor).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from models.execution.batching import SharedBatcher, bound_predictor

__all__ = ["SharedBatches"]


class SharedBatches:
    """The batchers of one server process (one per loaded model).

    Args:
        wait_s: how long a batch that is not full waits for tiles.
        metrics: the app's :class:`~service.metrics.Metrics` (``batch_fill``, ``batch_requests``).
    """

    def __init__(self, wait_s: float, metrics: Any = None) -> None:
        self.wait_s = wait_s
        self.metrics = metrics
        self._batchers: dict[int, SharedBatcher] = {}
        self._lock = threading.Lock()

    def _on_batch(self, tiles: int, requests: int, seconds: float) -> None:  # noqa: ARG002
        if self.metrics is not None:
            self.metrics.batch_fill.observe(tiles)
            self.metrics.batch_requests.observe(requests)

    def batcher(self, model: Any) -> SharedBatcher:
        """The batcher of ``model`` (made on first use; a reloaded model gets a new one)."""
        key = id(model.predictor)
        with self._lock:
            batcher = self._batchers.get(key)
            if batcher is None:
                size = int(model.spec.defaults.batch_size or 1)
                batcher = SharedBatcher(model.predictor, size, wait_s=self.wait_s, on_batch=self._on_batch)
                self._batchers[key] = batcher
        return batcher

    @contextlib.contextmanager
    def bind(
        self, model: Any, should_stop: Callable[[], bool] | None = None, batch_size: int | None = None
    ) -> Iterator[None]:
        """Within the block, this thread's tiled passes of ``model`` share forward batches; while
        they wait for the device, ``should_stop`` (the run's) is asked every 0.1 s and true stops
        them (``tiling.RunCancelledError``). ``batch_size``: the request's plan's, when known
        (a forward pass then waits to hold that many tiles of any request)."""
        if model.context is not None:
            yield
            return
        with bound_predictor(self.batcher(model).client(should_stop, batch_size)):
            yield

    def close(self) -> None:
        """Stop every batcher thread."""
        with self._lock:
            batchers = list(self._batchers.values())
            self._batchers.clear()
        for batcher in batchers:
            batcher.close()

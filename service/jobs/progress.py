"""A running job's record: tiles done, the rate (for ``eta_s``), and its finished slabs.

The engine reports every batch (:meth:`RunProgress.tiles`) and the checkpoint every finished slab
(:meth:`RunProgress.save_checkpoint`). The record is written at most every :data:`PROGRESS_WRITE_S`
(so the event streams that read it carry at most about five events a second), and at once, fsync'ed,
for a slab: a later run trusts that record. Only the lease holder writes, and never once the lease
is lost (fencing).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from service.jobs.lease import Lease
from service.jobs.record import JobRecord
from service.jobs.store import JobStore
from service.metrics import Metrics
from tiling import ResumePoint

__all__ = ["PROGRESS_WRITE_S", "RunProgress"]

logger = logging.getLogger(__name__)

#: Least time between two progress writes of a running job (the event stream's finest step).
PROGRESS_WRITE_S = 0.2


class RunProgress:
    """The record of one run, written as it goes, by the lease holder only.

    Args:
        record: the job's record (updated in place; the runner finishes it).
        lease: the job's lease (nothing is written once it is lost).
        store: the jobs folder.
        metrics: tiles computed and resumed are counted here.
    """

    def __init__(self, record: JobRecord, lease: Lease, store: JobStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self.record = record
        self.lease = lease
        self.model = record.model
        self.first = 0
        self.computed = 0
        self.written_at = 0.0
        self.lock = threading.Lock()

    def write(self, *, durable: bool = False, force: bool = False) -> None:
        """Write the record, at most every :data:`PROGRESS_WRITE_S` unless ``force``; never once
        the lease is lost (fencing)."""
        now = time.monotonic()
        if not force and now - self.written_at < PROGRESS_WRITE_S:
            return
        if self.lease.valid():
            self.store.write(self.record, durable=durable)
            self.written_at = now

    def on_start(self, plan: Any, point: ResumePoint) -> None:
        """The plan is made: the tiles to do, and those a previous run finished."""
        with self.lock:
            record = self.record
            self.first = point.first_tile if len(plan.flips) == 1 else 0
            before = record.tiles_done if point.rows_done else 0
            record.tiles_total, record.tiles_skipped = plan.n_tiles, plan.skipped
            record.tiles_done = min(plan.n_tiles, max(before, self.first))
            record.run_started_at, record.run_tiles = time.time(), 0
            if self.first:
                self.metrics.job_tiles_resumed.labels(self.model).inc(self.first)
                logger.info("job %s: resumed at tile %d of %d", record.id, self.first, plan.n_tiles)
            self.write(force=True)

    def on_plan(self, plan: Any) -> None:
        """A run without a checkpoint (on a Dask cluster) made its plan: the tiles to do."""
        with self.lock:
            self.first = 0
            record = self.record
            record.tiles_total, record.tiles_done = plan.n_tiles, 0
            record.tiles_skipped = plan.skipped
            record.run_started_at, record.run_tiles = time.time(), 0
            self.write(force=True)

    def stage(self, text: str) -> None:
        """The run moved on to another stage (the job's ``stage``, e.g. ``dask: running 27 chunks``)."""
        with self.lock:
            self.record.stage = text
            self.write(force=True)

    def tiles(self, n: int) -> None:
        """``n`` more tiles computed (the engine's progress callback, batch by batch)."""
        with self.lock:
            self.computed += n
            record = self.record
            done = max(record.tiles_done, self.first + self.computed)
            record.tiles_done = min(record.tiles_total or 0, done)
            record.run_tiles, record.progress_at = self.computed, time.time()
            self.metrics.tiles.labels(self.model).inc(n)
            self.metrics.job_tiles_computed.labels(self.model).inc(n)
            self.write()

    def save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A slab is on disk: record it (durably, it is what a later run trusts)."""
        with self.lock:
            self.record.checkpoint = checkpoint
            self.write(durable=True, force=True)

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

    def __init__(self, record: dict[str, Any], lease: Lease, store: JobStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self.record = record
        self.lease = lease
        self.model = record["model"]
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
            before = int(record.get("tiles_done") or 0) if point.rows_done else 0
            record.update(
                tiles_total=plan.n_tiles,
                tiles_done=min(plan.n_tiles, max(before, self.first)),
                run_started_at=time.time(),
                run_tiles=0,
            )
            if self.first:
                self.metrics.job_tiles_resumed.labels(self.model).inc(self.first)
                logger.info("job %s: resumed at tile %d of %d", record["id"], self.first, plan.n_tiles)
            self.write(force=True)

    def tiles(self, n: int) -> None:
        """``n`` more tiles computed (the engine's progress callback, batch by batch)."""
        with self.lock:
            self.computed += n
            record = self.record
            total = int(record.get("tiles_total") or 0)
            done = max(int(record.get("tiles_done") or 0), self.first + self.computed)
            record["tiles_done"] = min(total, done)
            record.update(run_tiles=self.computed, progress_at=time.time())
            self.metrics.tiles.labels(self.model).inc(n)
            self.metrics.job_tiles_computed.labels(self.model).inc(n)
            self.write()

    def save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A slab is on disk: record it (durably, it is what a later run trusts)."""
        with self.lock:
            self.record["checkpoint"] = checkpoint
            self.write(durable=True, force=True)

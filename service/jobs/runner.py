"""Running jobs: on the device executor, under a lease, resumable; taking over those of dead replicas.

:class:`JobService` is one per server process. A submitted job takes a slot of the device executor
(the bounded queue that synchronous requests share: 503 when full) and a lease (generation 1); a
keeper thread renews the leases this process holds and notices cancellations asked of other
replicas; a scanner thread looks every ``TILEWISE_JOB_SCAN_S`` for unfinished jobs whose lease is
free (their owner died or stopped) and takes them, while the executor has room, and removes jobs
older than ``TILEWISE_JOB_TTL_S``.

A job runs in the synchronous endpoint's three stages (:mod:`service.stages`), with a
:class:`~service.jobs.checkpoint.SlabCheckpoint`, so its result is the same file, and a run that
starts over continues from the last finished slab: ``prepare`` (header, region source, one plan,
the checkpoint opened) and ``finish`` (the output file completed, encoded) on the job's own CPU
thread (at most :data:`CPU_STAGES` jobs in either at once), only ``execute`` (the tiled network
passes) on the device executor's thread, so a job that encodes never holds the device. An input
that is decoded whole (:func:`service.stages.why_not_streamed`) or sent to a cluster runs as the
synchronous endpoint runs it: :func:`service.pipeline.run_file` on the device thread. A job is
``queued`` (with its ``position``) until its execute stage starts. With ``TILEWISE_DASK_SCHEDULER`` set, a job
whose input has more than ``TILEWISE_DASK_MIN_VOXELS`` voxels runs its tiled passes on that Dask
cluster instead (:class:`service.cluster.ClusterRoute`; the same file, no slab checkpoint: a run
that starts over starts from the beginning); its record's ``cluster`` names the scheduler, and
its ``stage`` and tiles move as each pass goes through the cluster. It stops before its next batch when it is
cancelled (``DELETE``), when the server stops (the job stays unfinished: another replica, or the
restarted one, takes it over) or when its lease was taken over.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.planning.params import InferenceParams, parse_query
from service.admission import load_model
from service.cluster import ClusterRoute
from service.deadline import RunDeadline
from service.errors import NotReadyError, QueueFullError
from service.executor import DeviceExecutor, Slot
from service.http_errors import classify
from service.jobs.checkpoint import SlabCheckpoint
from service.jobs.dicomweb_job import store_job_result
from service.jobs.lease import Lease, Leases
from service.jobs.progress import RunProgress
from service.jobs.record import JobError, JobRecord, JobResult, JobState
from service.jobs.store import INPUT_FILE, PARTIAL_FILE, JobStore
from service.metrics import Metrics
from service.pipeline import InferenceResult, Limits, prepare_file, run_file
from service.sniff import sniff_file
from service.stages import Prepared, RunOptions, execute, finish, result_headers
from tiling import RunCancelledError

__all__ = ["JobService"]

logger = logging.getLogger(__name__)

#: A job whose runs ended this many times with their server dying (killed, out of memory; a graceful
#: stop does not count) fails instead of taking a next server down with it.
MAX_ATTEMPTS = 5
#: Inputs a done job keeps, for the page's deep-zoom view (service.routes.dzi): 2D images.
_VIEWED_KINDS = ("tiff", "png", "jpeg")


def sniff_file_safe(path: Path) -> str | None:
    """The kind of the file at ``path`` (service.sniff), ``None`` for a folder or an unreadable file."""
    try:
        return sniff_file(path) if path.is_file() else None
    except OSError:
        return None


def ended_leftovers(folder: Path, *, done: bool) -> list[Path]:
    """The files an ended job's ``folder`` no longer needs: the partial output; the input (and any
    deep-zoom overview made of it while queued or running, ``input*.dzi-overview*``) unless the job
    is ``done`` with a 2D image (kept for its deep-zoom view); every ``output.*`` of a job not done."""
    doomed = [folder / PARTIAL_FILE]
    if not done or sniff_file_safe(folder / INPUT_FILE) not in _VIEWED_KINDS:
        doomed.append(folder / INPUT_FILE)  # a done 2D image stays for its deep-zoom view
        doomed += sorted(folder.glob(f"{INPUT_FILE}*.dzi-overview*"))
    if not done:
        doomed += sorted(folder.glob("output.*"))
    return doomed


#: Jobs in their prepare or finish stage (CPU work: decompressing, statistics, encoding) at once.
CPU_STAGES = 2


@dataclass
class _Held:
    """A job this process holds: its lease, its stop flag, its order of arrival, and its execute
    stage's place in the executor (``future``, once prepared)."""

    lease: Lease
    seq: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future[Any] | None = None
    started: bool = False  # its execute stage began (running, then finishing)
    thread: threading.Thread | None = None


class JobService:
    """The jobs of one server process.

    Args:
        store: the jobs folder.
        executor: the device executor (shared with synchronous requests).
        repository: returns the model repository (``get(name)``; it may be replaced by a reload).
        metrics: the app's metrics.
        settings: the service settings (limits, ``job_*``).
    """

    def __init__(
        self,
        store: JobStore,
        executor: DeviceExecutor,
        repository: Callable[[], Any],
        metrics: Metrics,
        settings: Any,
    ) -> None:
        self.store = store
        self.executor = executor
        self.repository = repository
        self.metrics = metrics
        self.settings = settings
        self.limits = Limits.from_settings(settings)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.leases = Leases(self.owner, settings.job_lease_s)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.cluster = ClusterRoute(settings)
        #: The server's :class:`~service.sharing.SharedBatches` (``TILEWISE_SHARED_REQUESTS`` > 1).
        self.batches: Any = None
        self._cpu = threading.BoundedSemaphore(CPU_STAGES)
        self._seq = itertools.count()

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the keeper and scanner threads."""
        for target, name in ((self._keep, "tilewise-job-leases"), (self._scan_loop, "tilewise-job-scan")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info("jobs in %s (replica %s)", self.store.root, self.owner)

    def stop_all(self) -> None:
        """Stop taking jobs over, and stop the running one before its next batch (it stays unfinished)."""
        self._closing.set()
        with self._lock:
            for held in self._held.values():
                held.stop.set()

    def close(self) -> None:
        """Stop the threads and let every job still held go (after the executor stopped)."""
        self.stop_all()
        for thread in self._threads:
            thread.join(10)
        with self._lock:
            runs = [h.thread for h in self._held.values() if h.thread is not None]
        for run in runs:  # each stops before its next batch, or its queued execute was cancelled
            run.join(30)
        with self._lock:
            held = list(self._held.items())
            self._held.clear()
        for job_id, h in held:
            h.lease.release()
            logger.info("job %s released for another replica", job_id)
        self.cluster.close()

    # -- submission and cancellation ----------------------------------------------------------------

    def create(
        self, job_id: str, model: str, query: dict[str, str], key_hash: str | None, owner: str | None = None
    ) -> tuple[JobRecord, Lease]:
        """Record a new job whose input is in its folder; returns its record and lease.

        Args:
            owner: the name of the API key that submitted it (``None``: no key configured).
        """
        lease = self.leases.take(self.store.folder(job_id))
        if lease is None:  # pragma: no cover - a fresh folder has no lease
            raise RuntimeError(f"job {job_id}: cannot take the lease of a new job")
        record = JobRecord(
            id=job_id, model=model, query=query, created_at=time.time(), key_hash=key_hash, owner=owner
        )
        self.store.add(record)
        return record, lease

    def enqueue(self, lease: Lease, slot: Slot) -> None:
        """Queue the job of ``lease`` on the executor in ``slot``."""
        job_id = lease.job_id
        held = _Held(lease, seq=next(self._seq))
        slot = slot.hand_over()  # the job's thread holds it until its execute stage is queued
        held.thread = threading.Thread(
            target=self._job, args=(job_id, slot), name=f"tilewise-job-{job_id[:12]}", daemon=True
        )
        with self._lock:
            self._held[job_id] = held
        self.metrics.jobs.labels(JobState.QUEUED.value).inc()
        held.thread.start()

    def cancel(self, job_id: str) -> None:
        """Ask for the job's cancellation; when nobody holds it, cancel it here."""
        record = self.store.read(job_id)
        if record.state.finished:
            return
        self.store.request_cancel(job_id)
        with self._lock:
            held = self._held.get(job_id)
        if held is not None:
            held.stop.set()
            if held.future is not None:
                held.future.cancel()  # not started yet: its thread finishes it
            return
        lease = self.leases.take(self.store.folder(job_id))
        if lease is not None:  # nobody holds it (its owner died): finish it here
            try:
                self._finish(self.store.read(job_id), lease, JobState.CANCELLED)
            finally:
                lease.release()

    # -- the run ----------------------------------------------------------------------------------

    def _job(self, job_id: str, slot: Slot) -> None:
        """The job's own thread: its stages, then its lease and slot let go."""
        try:
            self._run(job_id, slot)
        except Exception:
            logger.exception("job %s: its run failed outside its stages", job_id)
        finally:
            slot.release()  # a no-op once its execute stage took the slot
            with self._lock:
                held = self._held.pop(job_id, None)
            if held is not None:
                held.lease.release()

    def _run(self, job_id: str, slot: Slot) -> None:
        """Prepare here, execute on the device thread (in ``slot``), finish here."""
        with self._lock:
            held = self._held[job_id]
        lease = held.lease
        if not lease.valid():
            return
        record = self.store.read(job_id)
        if record.state.finished:
            return
        if self.store.cancel_requested(job_id):
            self._finish(record, lease, JobState.CANCELLED)
            return
        if held.stop.is_set():
            return
        record.attempts += 1
        if record.attempts > MAX_ATTEMPTS:
            detail = f"the servers running the job died {MAX_ATTEMPTS} times before it finished"
            error = JobError(error="too_many_attempts", detail=detail)
            self._finish(record, lease, JobState.FAILED, error=error)
            return
        self.store.write(record, durable=True)  # an attempt that kills its server counts
        progress = RunProgress(record, lease, self.store, self.metrics)
        folder = self.store.folder(job_id)

        def stopped() -> bool:
            return held.stop.is_set() or not lease.valid() or self.store.cancel_requested(job_id)

        deadline = RunDeadline.of(self.limits)  # past twice max_request_seconds: failed, with why
        should_stop = deadline.should_stop(stopped)
        prepared: Prepared | None = None
        try:
            model = load_model(self.repository(), record.model)
            params = parse_query(record.query.items())
            checkpoint = SlabCheckpoint(
                folder / PARTIAL_FILE, record.checkpoint, progress.save_checkpoint, progress.on_start
            )
            tiled = self._dask_pass(record, folder, progress, params)
            if tiled is None:  # read by region and written as it finishes, when the input allows
                with self._cpu:
                    prepared = prepare_file(model, folder / INPUT_FILE, folder / "output", params,
                                            limits=self.limits, checkpoint=checkpoint)  # fmt: skip
            queued_at = time.perf_counter()

            def device() -> InferenceResult | None:
                """The execute stage (or, for an input decoded whole, the whole run)."""
                self.metrics.stage_seconds.labels("queue").observe(time.perf_counter() - queued_at)
                self._running(record, progress, held)
                with contextlib.ExitStack() as stack:
                    stack.enter_context(deadline.running())
                    if tiled is not None:
                        stack.enter_context(tiled)
                    elif self.batches is not None:
                        batch = int(prepared.plan.batch_size) if prepared is not None else None
                        stack.enter_context(self.batches.bind(model, should_stop, batch))
                    if prepared is not None:
                        execute(prepared, RunOptions(progress.tiles, should_stop))
                        return None
                    options = RunOptions(progress=progress.tiles, should_stop=should_stop, tiled=tiled)
                    return run_file(
                        model, folder / INPUT_FILE, folder / "output", params, limits=self.limits,
                        options=options, checkpoint=checkpoint if tiled is None else None,
                    )  # fmt: skip

            if held.stop.is_set():
                raise RunCancelledError("stopped before its execute stage")
            held.future = self.executor.submit_future(device, slot=slot)
            if held.stop.is_set():  # stopped while it was submitted: drop it if still queued
                held.future.cancel()
            try:
                outcome = held.future.result()
            except concurrent.futures.CancelledError:
                raise RunCancelledError("its queued execute stage was cancelled") from None
            if prepared is not None:
                with self._cpu:
                    done, prepared = prepared, None
                    outcome = finish(done)
            assert outcome is not None
            result = outcome
            for stage, seconds in result.stages.items():
                self.metrics.stage_seconds.labels(stage).observe(seconds)
            stored = store_job_result(self.settings, record, result.path)  # store=true: STOW-RS
            if stored is not None:
                record.stored = stored
        except RunCancelledError:
            with progress.lock:
                if self.store.cancel_requested(job_id):
                    self._finish(record, lease, JobState.CANCELLED)
                elif lease.valid():  # the server stops: another replica continues from the last slab
                    record.state = JobState.QUEUED
                    record.attempts -= 1  # a graceful stop is no failed attempt
                    self.store.write(record, durable=True)
                    logger.info("job %s: stopped with its server; left for another replica", job_id)
        except Exception as exc:
            with progress.lock:
                info = classify(exc)
                if info.status >= 500 and info.status != 503:
                    logger.error("job %s failed", job_id, exc_info=exc)
                error = JobError(error=info.code, detail=info.detail)
                self._finish(record, lease, JobState.FAILED, error=error)
        else:
            with progress.lock:
                self._finish(record, lease, JobState.DONE, result=result)
        finally:
            if prepared is not None:  # not finished: its temporaries go
                prepared.close()

    def _running(self, record: JobRecord, progress: RunProgress, held: _Held) -> None:
        """The execute stage begins (on the device thread): the job is ``running``."""
        with progress.lock:
            held.started = True
            record.state = JobState.RUNNING
            record.started_at = record.started_at or time.time()
            progress.write(durable=True, force=True)
        self.metrics.jobs.labels(JobState.RUNNING.value).inc()
        logger.info("job %s: running model=%s attempt=%d", record.id, record.model, record.attempts)

    def _dask_pass(
        self, record: JobRecord, folder: Any, progress: RunProgress, params: InferenceParams
    ) -> Any:
        """The job's :class:`~service.cluster.DaskPass` when its input goes to the cluster, else ``None``."""
        voxels = self.cluster.voxels_over(folder / INPUT_FILE, params)
        if voxels is None:
            return None
        logger.info(
            "job %s: %d voxels > TILEWISE_DASK_MIN_VOXELS=%d: tiled passes on the Dask cluster %s",
            record.id, voxels, self.settings.dask_min_voxels, self.cluster.address,
        )  # fmt: skip
        with progress.lock:
            record.cluster = self.cluster.address
        progress.stage("dask: connecting to the cluster")
        return self.cluster.dask_pass(folder, on_stage=progress.stage, on_plan=progress.on_plan)

    def _finish(
        self,
        record: JobRecord,
        lease: Lease,
        state: JobState,
        *,
        error: JobError | None = None,
        result: InferenceResult | None = None,
    ) -> None:
        """Record the job's end (if this process still holds it) and drop what it no longer needs;
        then, with ``TILEWISE_JOBS_MAX_BYTES``, remove the oldest finished jobs over it."""
        if not lease.valid():
            return
        job_id = record.id
        folder = self.store.folder(job_id)
        record.state, record.finished_at, record.error = state, time.time(), error
        if result is not None:
            record.tiles_done = record.tiles_total or result.n_tiles
            record.tiles_skipped = result.plan.skipped
            self.metrics.tiles_skipped.labels(record.model).inc(result.plan.skipped or 0)
            record.result = JobResult(
                file=result.path.name,
                media_type=result.media_type,
                filename=f"{record.model}-output{result.path.name[len('output') :]}",
                headers=result_headers(record.model, result),
                size_bytes=result.size_bytes,
            )
        for path in ended_leftovers(folder, done=state is JobState.DONE):
            if path.is_dir():  # a DICOM series (several files, or pulled by DICOMweb)
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.store.finished(record)
        self.metrics.jobs.labels(state.value).inc()
        logger.info("job %s: %s%s", job_id, state.value, f" ({error.error})" if error else "")
        max_bytes = self.settings.jobs_max_bytes
        if max_bytes is not None:
            self.store.cap_bytes(max_bytes, keep=job_id)

    # -- keeper and scanner -------------------------------------------------------------------------

    def _keep(self) -> None:
        """Renew held leases (every third of ``lease_s``, or every scan when that is sooner) and
        pass on cancellations asked of another replica (a queued job is dropped at once; a running
        one checks for itself before every batch)."""
        interval = max(0.05, min(self.settings.job_lease_s / 3, self.settings.job_scan_s))
        while not self._closing.wait(interval):
            with self._lock:
                held = list(self._held.items())
            for job_id, h in held:
                try:
                    if not h.lease.renew():
                        h.stop.set()
                    elif not h.stop.is_set() and self.store.cancel_requested(job_id):
                        h.stop.set()
                        if h.future is not None:
                            h.future.cancel()
                except Exception:
                    logger.exception("job %s: lease renewal failed", job_id)

    def _scan_loop(self) -> None:
        ttl_s = self.settings.job_ttl_s
        sweep_every = min(60.0, max(self.settings.job_scan_s, ttl_s / 4))
        orphan_s = 2 * self.settings.upload_idle_s + 60
        next_sweep = 0.0
        while not self._closing.wait(self.settings.job_scan_s):
            try:
                self.scan()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + sweep_every
                    self.store.sweep(ttl_s, orphan_s, max_bytes=self.settings.jobs_max_bytes)
            except Exception:
                logger.exception("job scan failed")

    def scan(self) -> int:
        """Take over the unfinished jobs nobody holds, while the executor has room; returns how many."""
        taken = 0
        for job_id in self.store.active():
            if self._closing.is_set() or not self.executor.has_room():
                break
            with self._lock:
                if job_id in self._held:
                    continue
            folder = self.store.folder(job_id)
            if not folder.is_dir():
                self.store.set_active(job_id, False)
                continue
            try:
                slot = self.executor.reserve()
            except (QueueFullError, NotReadyError):
                break
            lease = self.leases.take(folder) if self.store.exists(job_id) else None
            if lease is None:
                slot.release()
                continue
            try:
                record = self.store.read(job_id)
                if record.state.finished:
                    self.store.set_active(job_id, False)
                    lease.release()
                    slot.release()
                    continue
                record.state = JobState.QUEUED
                self.store.write(record, durable=True)
                self.enqueue(lease, slot)
            except BaseException:
                lease.release()
                slot.release()
                raise
            self.metrics.job_takeovers.inc()
            taken += 1
        return taken

    def position(self, job_id: str) -> int | None:
        """The job's place in this replica's device queue (1 = next), or ``None``."""
        with self._lock:
            held = self._held.get(job_id)
            if held is None or held.started:
                return None
            if held.future is None:  # preparing: behind what waits for the device, and older jobs
                ahead = sum(1 for h in self._held.values() if h.future is None and not h.started
                            and h.seq < held.seq)  # fmt: skip
                return self.executor.waiting() + ahead + 1
        return self.executor.position(held.future)

    def held(self) -> list[str]:
        """Ids of the jobs this process holds."""
        with self._lock:
            return list(self._held)

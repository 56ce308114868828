"""Two job services in one process sharing one jobs folder (two replicas without HTTP): a
cancellation asked of one reaches a job queued on the other, and a replica that stops gracefully
hands its job to the other, which finishes it from the last slab."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from models import ModelRepository
from models.planning.params import InferenceParams
from service.errors import JobNotFoundError
from service.executor import DeviceExecutor
from service.jobs import JobService, JobStore
from service.jobs.runner import MAX_ATTEMPTS
from service.jobs.store import INPUT_FILE
from service.metrics import Metrics
from service.pipeline import run_file


@pytest.fixture(scope="module")
def repository():
    return ModelRepository(None, device="cpu")


@pytest.fixture
def replica(tmp_path: Path, make_settings, repository) -> Iterator[Callable[..., JobService]]:
    """Starts a job service on its own executor, on the test's shared jobs folder."""
    services: list[JobService] = []

    def start(**overrides: object) -> JobService:
        options = {"job_scan_s": 0.1, "job_lease_s": 2, "queue_size": 1, **overrides}
        settings = make_settings(jobs_dir=tmp_path / "jobs", **options)
        executor = DeviceExecutor("cpu", settings.queue_size)
        service = JobService(JobStore(tmp_path / "jobs"), executor, lambda: repository, Metrics(), settings)
        service.start()
        services.append(service)
        return service

    yield start
    for service in services:
        stop(service)


def stop(service: JobService) -> None:
    """What the app's shutdown does: stop the running job, the executor, then release the rest."""
    service.stop_all()
    service.executor.shutdown(wait=True)
    service.close()


def sample(service: JobService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def submit(service: JobService, tmp_path: Path, query: dict[str, str], attempts: int = 0) -> str:
    """What POST /v1/jobs does once the upload is in the job's folder (``attempts``: runs that
    ended with their server dying, as if it had happened)."""
    job_id, folder = service.store.new_folder()
    data = np.random.default_rng(0).random((48, 20, 20), dtype=np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "in.nii")
    (folder / INPUT_FILE).write_bytes((tmp_path / "in.nii").read_bytes())
    slot = service.executor.reserve()
    record, lease = service.create(job_id, "gaussian-3d", query, None)
    if attempts:
        service.store.write(record.model_copy(update={"attempts": attempts}))
    service.enqueue(lease, slot)
    return job_id


def wait_state(store: JobStore, job_id: str, state: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while (record := store.read(job_id)).state != state:
        assert time.monotonic() < deadline, record
        time.sleep(0.02)
    return record


def test_a_cancellation_asked_of_another_replica_drops_a_queued_job(replica, tmp_path):
    a, b = replica(), replica()
    busy = threading.Event()
    blocker = a.executor.submit_future(busy.wait)  # a's device is busy: the job waits in its queue
    try:
        job_id = submit(a, tmp_path, {"tile": "16", "halo": "4"})
        assert a.store.read(job_id).state == "queued" and a.held() == [job_id]
        b.cancel(job_id)  # b does not hold it: it flags it, and a's keeper drops it from its queue
        record = wait_state(a.store, job_id, "cancelled", timeout=60)
        # dropped from the queue while a's device was still busy (not when the job came to run)
        assert not blocker.done() and record.finished_at is not None
        assert a.held() == [] and record.tiles_done == 0
    finally:
        busy.set()
        blocker.result(10)


def test_a_replica_that_stops_hands_its_job_to_another(replica, tmp_path):
    a = replica()
    query = {"tile": "16", "halo": "4", "batch_size": "1"}
    job_id = submit(a, tmp_path, query)
    deadline = time.monotonic() + 60
    while not (a.store.read(job_id).checkpoint or {}).get("rows_done"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop(a)  # SIGTERM: the running job stops before its next batch, and its lease is released
    left = a.store.read(job_id)
    assert left.state == "queued" and left.tiles_done < left.tiles_total
    assert left.attempts == 0  # a graceful stop is no failed attempt
    rows = left.checkpoint["rows_done"]
    per_slab = left.tiles_total // left.checkpoint["key"]["grid"][0]
    b = replica()  # its scanner takes the job over
    record = wait_state(b.store, job_id, "done")
    assert record.attempts == 1
    assert sample(b, "tilewise_job_takeovers_total") == 1
    assert sample(b, "tilewise_job_tiles_resumed_total", model="gaussian-3d") == rows * per_slab > 0
    reference = run_file(
        b.repository().get("gaussian-3d"), tmp_path / "in.nii", tmp_path / "sync", InferenceParams(**query)
    )
    assert (b.store.folder(job_id) / record.result.file).read_bytes() == reference.path.read_bytes()


def test_finished_jobs_expire_after_the_ttl(replica, tmp_path):
    a = replica(job_ttl_s=0.5)
    job_id = submit(a, tmp_path, {"tile": "16", "halo": "4"})
    wait_state(a.store, job_id, "done")
    assert (a.store.folder(job_id) / "output.nii.gz").is_file()
    deadline = time.monotonic() + 10
    while a.store.folder(job_id).exists():  # the scanner's sweep removes it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(JobNotFoundError):
        a.store.read(job_id)
    assert a.store.active() == []


def test_a_job_whose_servers_keep_dying_fails(replica, tmp_path):
    a = replica()
    job_id = submit(a, tmp_path, {"tile": "16", "halo": "4"}, attempts=MAX_ATTEMPTS)
    record = wait_state(a.store, job_id, "failed")
    assert record.error.error == "too_many_attempts" and record.tiles_done == 0


def test_finished_jobs_keep_at_most_jobs_max_bytes_oldest_removed_first(replica, tmp_path):
    """TILEWISE_JOBS_MAX_BYTES: each finished job's result counts; when one more finishes over the
    cap, the oldest finished go first, and the one just finished stays (its client downloads it)."""
    probe = replica()
    first = submit(probe, tmp_path, {"tile": "16", "halo": "4"})
    size = probe.store.folder_bytes(first) if wait_state(probe.store, first, "done") else 0
    stop(probe)
    assert size > 1000
    service = replica(jobs_max_bytes=int(2.5 * size))  # room for two results, not three
    ids = [first]
    for _ in range(3):
        ids.append(submit(service, tmp_path, {"tile": "16", "halo": "4"}))
        wait_state(service.store, ids[-1], "done")
    # the cap is applied just after the last record says done: wait for it (a loaded machine)
    deadline = time.monotonic() + 60
    while True:
        kept = [job_id for job_id in ids if service.store.exists(job_id)]
        finished = [e for e in service.store.index.entries().values() if e.finished_at is not None]
        if kept == ids[-2:] and len(finished) == 2:
            break
        assert time.monotonic() < deadline, (kept, finished)
        time.sleep(0.05)
    with pytest.raises(JobNotFoundError):
        service.store.read(ids[0])
    assert sum(e.bytes for e in finished) <= 2.5 * size

"""Jobs in three stages (issue 20): prepare and finish on the job's own thread, only execute on the
device executor's thread.

Proof without timing: the job's finish stage waits (up to 30 s) until another request's work has
run on the device thread; were finish on the device thread, that work could not start and the
wait would end unmet. Oracle: ``scipy.ndimage.gaussian_filter`` (gaussian-3d's).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import scipy.ndimage as ndi

import service.jobs.runner as runner
from models import ModelRepository
from service.executor import DeviceExecutor
from service.jobs import JobService, JobStore
from service.jobs.store import INPUT_FILE
from service.metrics import Metrics


@pytest.fixture(scope="module")
def repository():
    return ModelRepository(None, device="cpu")


@pytest.fixture
def jobs(tmp_path: Path, make_settings, repository):
    settings = make_settings(jobs_dir=tmp_path / "jobs", job_scan_s=0.1, job_lease_s=5, queue_size=2)
    executor = DeviceExecutor("cpu", settings.queue_size)
    service = JobService(JobStore(tmp_path / "jobs"), executor, lambda: repository, Metrics(), settings)
    service.start()
    yield service
    service.stop_all()
    executor.shutdown(wait=True)
    service.close()


def _submit(service: JobService, tmp_path: Path, data: np.ndarray) -> str:
    job_id, folder = service.store.new_folder()
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "in.nii")
    (folder / INPUT_FILE).write_bytes((tmp_path / "in.nii").read_bytes())
    slot = service.executor.reserve()
    _, lease = service.create(job_id, "gaussian-3d", {"tile": "24", "halo": "8", "format": "nii"}, None)
    service.enqueue(lease, slot)
    return job_id


def _wait(service: JobService, job_id: str, state: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while (record := service.store.read(job_id)).state != state:
        assert time.monotonic() < deadline, record
        time.sleep(0.02)
    return record


def _data() -> np.ndarray:
    return np.random.default_rng(3).random((37, 29, 31), dtype=np.float32)  # primes: odd tiles


def test_another_request_executes_while_a_job_finishes(jobs, tmp_path, monkeypatch):
    device_threads = {t.name for t in jobs.executor._threads}
    other_ran = threading.Event()
    in_finish = threading.Event()
    seen: dict[str, object] = {}
    real_finish = runner.finish

    def finish(prepared):  # the real stage, entered only once the other request has run
        seen["thread"] = threading.current_thread().name
        in_finish.set()
        seen["other_ran_first"] = other_ran.wait(30)
        return real_finish(prepared)

    monkeypatch.setattr(runner, "finish", finish)
    data = _data()
    job_id = _submit(jobs, tmp_path, data)
    assert in_finish.wait(60), jobs.store.read(job_id)

    def other() -> str:  # another request's execute stage, on the device thread
        other_ran.set()
        return threading.current_thread().name

    assert jobs.executor.submit_future(other).result(30) in device_threads
    record = _wait(jobs, job_id, "done")
    assert seen["other_ran_first"] is True and seen["thread"] not in device_threads
    out = np.asarray(nib.load(jobs.store.folder(job_id) / record.result.file).dataobj)
    oracle = ndi.gaussian_filter(data.astype(np.float64), 2.0, truncate=4.0, mode="constant")
    assert float(np.abs(out - oracle).max()) < 1e-5  # float32 arithmetic on unit-range data
    stages = {s.labels["stage"] for m in jobs.metrics.stage_seconds.collect() for s in m.samples
              if s.name.endswith("_count") and s.value > 0}  # fmt: skip
    assert {"prepare", "queue", "execute", "finish"} <= stages


def test_a_prepared_job_waits_queued_with_its_position_and_tiles(jobs, tmp_path):
    busy = threading.Event()
    blocker = jobs.executor.submit_future(busy.wait)  # the device is busy with another request
    try:
        job_id = _submit(jobs, tmp_path, _data())
        deadline = time.monotonic() + 60
        while jobs.executor.waiting() == 0:  # prepared: its execute stage waits for the device
            assert time.monotonic() < deadline
            time.sleep(0.02)
        record = jobs.store.read(job_id)
        assert record.state == "queued" and record.tiles_total and record.tiles_done == 0
        assert jobs.position(job_id) == 1
    finally:
        busy.set()
        blocker.result(10)
    record = _wait(jobs, job_id, "done")
    assert record.tiles_done == record.tiles_total and jobs.position(job_id) is None

"""Jobs without a server: the folder (ids, records, keys, expiry), leases, the slab checkpoint
through the one pipeline, and the status document."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from models import ModelRepository
from models.execution.options import RunOptions
from models.planning.params import InferenceParams
from service.errors import JobNotFoundError
from service.jobs import JobRecord, JobState, JobStore, job_status
from service.jobs.checkpoint import SlabCheckpoint
from service.jobs.lease import Leases
from service.pipeline import run_file
from tiling import RunCancelledError

# -- the folder -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job_id",
    [
        "../../etc/passwd",
        "..",
        "",
        "A" * 32,
        "0" * 31,
        "0" * 33,
        "0" * 31 + "/",
        "state.json",
        "0" * 31 + "\n",
        "0" * 32 + "\n",  # re.match with $ accepted it: fullmatch does not
    ],
)
def test_malformed_ids_never_reach_the_file_system(tmp_path: Path, job_id: str) -> None:
    store = JobStore(tmp_path)
    with pytest.raises(JobNotFoundError):
        store.folder(job_id)
    with pytest.raises(JobNotFoundError):
        store.read(job_id)


def test_records_are_written_whole_and_listed_newest_first(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    ids = []
    for i in range(3):
        job_id, folder = store.new_folder()
        assert folder == store.folder(job_id) and folder.is_dir()
        store.add(JobRecord(id=job_id, model="m", created_at=100.0 + i))
        ids.append(job_id)
    with pytest.raises(JobNotFoundError):
        store.read("f" * 32)
    assert [r.id for r in store.recent(2)] == ids[::-1][:2]
    assert store.read(ids[0]) == JobRecord(id=ids[0], model="m", created_at=100.0)
    assert not [p for p in store.jobs.rglob(".*.tmp")]  # no temporary file left behind


def test_an_idempotency_key_binds_one_job_even_when_raced(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    key = store.key_hash("retry-me/../../etc")
    assert len(key) == 64 and store.find_key(key) is None
    ids = []
    for _ in range(8):
        job_id, _ = store.new_folder()
        store.add(JobRecord(id=job_id, model="m", key_hash=key))
        ids.append(job_id)
    bound: list[str] = []
    threads = [threading.Thread(target=lambda j=j: bound.append(store.bind_key(key, j))) for j in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(bound)) == 1 and bound[0] in ids and store.find_key(key) == bound[0]
    store.remove(bound[0])  # the key goes with its job, and may name a new one
    assert store.find_key(key) is None
    assert store.bind_key(key, ids[-1]) == ids[-1] or ids[-1] == bound[0]


def test_sweep_removes_expired_jobs_and_dead_uploads_only(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    now = time.time()
    old, _ = store.new_folder()
    store.add(JobRecord(id=old, model="m"))
    store.finished(JobRecord(id=old, model="m", state="done", finished_at=now - 100))
    fresh, _ = store.new_folder()
    store.add(JobRecord(id=fresh, model="m"))
    store.finished(JobRecord(id=fresh, model="m", state="done", finished_at=now - 10))
    running, _ = store.new_folder()
    store.add(JobRecord(id=running, model="m", state="running"))
    orphan, folder = store.new_folder()  # an upload whose replica died
    (folder / "input").write_bytes(b"x")
    os.utime(folder / "input", (now - 1000, now - 1000))
    uploading, folder = store.new_folder()
    (folder / "input").write_bytes(b"x")
    assert store.sweep(ttl_s=50, orphan_s=500, now=now) == 2
    assert not store.folder(old).exists() and not store.folder(orphan).exists()
    assert all(store.folder(j).exists() for j in (fresh, running, uploading))
    assert store.active() == [running]


# -- leases ---------------------------------------------------------------------------------------


def test_one_holder_at_a_time_and_takeover_after_release(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    a, b = Leases("a", lease_s=30), Leases("b", lease_s=30)
    first = a.take(folder)
    assert first is not None and first.generation == 1 and first.renew()
    assert b.take(folder) is None  # held: fresh and locked
    first.release()
    second = b.take(folder)
    assert second is not None and second.generation == 2
    assert not (folder / "lease.1").exists()
    assert not first.valid() and not first.renew()  # fenced: it never writes again
    assert a.take(folder) is None
    second.release()


def test_a_lease_is_free_when_its_owner_is_gone_or_silent(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    leases = Leases("b", lease_s=30)
    dead = Leases("a", lease_s=30).take(folder)
    assert dead is not None
    assert dead._handle is not None
    dead._handle.close()  # what the kernel does when the owner's process ends: its lock goes
    taken = leases.take(folder)
    assert taken is not None and taken.generation == 2
    # A live owner (lock held) that stopped renewing: free once lease_s has passed.
    os.utime(taken.path, (time.time() - 31, time.time() - 31))
    again = leases.take(folder)
    assert again is not None and again.generation == 3
    assert not taken.valid()
    for lease in (taken, again):
        lease.release()


def test_racing_takers_make_one_owner(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    won = []
    barrier = threading.Barrier(6)

    def take(i: int) -> None:
        barrier.wait()
        lease = Leases(f"r{i}", lease_s=30).take(folder)
        if lease is not None:
            won.append(lease)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    won[0].release()


# -- the checkpoint, through the one pipeline -------------------------------------------------------


@pytest.fixture(scope="module")
def gaussian():
    return ModelRepository(None, device="cpu").get("gaussian-3d")


def _volume(path: Path) -> Path:
    data = np.random.default_rng(0).random((40, 22, 20), dtype=np.float32)
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 1.5, 1.0, 1.0])), path)
    return path


@pytest.mark.parametrize(
    "query",
    [
        pytest.param({"tile": "16", "halo": "4", "batch_size": "3"}, id="abutting"),
        pytest.param({"tile": "16", "halo": "4", "overlap": "4", "blend": "gaussian"}, id="blended"),
        pytest.param({"tile": "16", "halo": "4", "output": "labels", "format": "nii"}, id="labels"),
    ],
)
def test_a_job_stopped_and_resumed_writes_the_synchronous_file(tmp_path, gaussian, query) -> None:
    source = _volume(tmp_path / "in.nii.gz")
    params = InferenceParams.model_validate(query)
    reference = run_file(gaussian, source, tmp_path / "sync", params)
    saved: dict = {}
    started = []

    def save(record: dict) -> None:
        saved.clear()
        saved.update(record)

    def checkpoint() -> SlabCheckpoint:
        return SlabCheckpoint(
            tmp_path / "partial.npy", dict(saved) or None, save, lambda p, pt: started.append(pt)
        )

    done = [0]

    def count(n: int) -> None:
        done[0] += n

    with pytest.raises(RunCancelledError):
        half = RunOptions(progress=count, should_stop=lambda: done[0] >= reference.n_tiles // 2)
        run_file(gaussian, source, tmp_path / "job", params, checkpoint=checkpoint(), options=half)
    rows = saved["rows_done"]
    assert rows > 0 and started[0].first_tile == 0
    computed = done[0]
    done[0] = 0
    result = run_file(
        gaussian,
        source,
        tmp_path / "job",
        params,
        checkpoint=checkpoint(),
        options=RunOptions(progress=count),
    )
    assert result.path.read_bytes() == reference.path.read_bytes()
    assert started[1].rows_done == rows and started[1].first_tile > 0
    assert done[0] == reference.n_tiles - started[1].first_tile
    per_row = reference.n_tiles // reference.plan.grid.grid_shape[0]
    assert computed + done[0] - reference.n_tiles <= 2 * per_row  # the row in progress (+1 blended)
    # Another plan for the same file starts from zero (the record names the plan).
    other = InferenceParams.model_validate({**query, "tile": "20"})
    run_file(
        gaussian,
        source,
        tmp_path / "other",
        other,
        checkpoint=checkpoint(),
        options=RunOptions(progress=count),
    )
    assert started[2].first_tile == 0


# -- the status document -------------------------------------------------------------------------------


def test_status_progress_and_eta() -> None:
    record = JobRecord(id="a" * 32, model="m", state="running", created_at=0.0, started_at=1.0,
                       tiles_total=40, tiles_done=10, run_tiles=8, run_started_at=10.0,
                       progress_at=14.0)  # fmt: skip
    status = job_status(record)
    assert status["progress"] == 0.25 and status["eta_s"] == 15.0  # 30 tiles left at 2 tiles/s
    assert status["created"] == "1970-01-01T00:00:00.000Z" and status["finished"] is None
    assert sorted(status) == sorted(
        ["id", "model", "state", "tiles_done", "tiles_total", "tiles_skipped", "progress", "eta_s", "created",
         "started", "finished", "error", "params", "stage"]
    )  # fmt: skip
    queued = job_status(
        record.model_copy(update={"state": JobState.QUEUED, "tiles_total": None, "tiles_done": 0})
    )
    assert queued["progress"] == 0.0 and queued["eta_s"] is None
    done = job_status(record.model_copy(update={"state": JobState.DONE, "finished_at": 20.0}))
    assert done["progress"] == 1.0 and done["eta_s"] == 0.0
    assert [s.finished for s in JobState] == [False, False, True, True, True]


def test_a_tta_job_starts_over_and_still_writes_the_synchronous_file(tmp_path, gaussian) -> None:
    """tta=mirror averages its passes in memory: a stopped run records no slab and runs again whole."""
    source = _volume(tmp_path / "in.nii.gz")
    params = InferenceParams.model_validate({"tile": "16", "halo": "4", "tta": "mirror"})
    reference = run_file(gaussian, source, tmp_path / "sync", params)
    saved: dict = {}
    started = []

    def checkpoint() -> SlabCheckpoint:
        return SlabCheckpoint(tmp_path / "partial.npy", dict(saved) or None, saved.update,
                              lambda plan, point: started.append(point))  # fmt: skip

    done = [0]
    with pytest.raises(RunCancelledError):
        options = RunOptions(progress=lambda n: done.__setitem__(0, done[0] + n),
                             should_stop=lambda: done[0] >= reference.n_tiles // 2)  # fmt: skip
        run_file(gaussian, source, tmp_path / "job", params, checkpoint=checkpoint(), options=options)
    assert saved["rows_done"] == 0
    result = run_file(gaussian, source, tmp_path / "job", params, checkpoint=checkpoint())
    assert [p.first_tile for p in started] == [0, 0]
    assert result.path.read_bytes() == reference.path.read_bytes()

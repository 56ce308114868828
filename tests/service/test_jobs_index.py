"""The jobs folder's index (issue 24 item 9): listing reads ``limit`` records however many jobs
there are, owners filter the listing, expiry and the byte cap read no record, an old folder
without an index is indexed once, and replicas appending at once lose no entry."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from service.jobs import JobRecord, JobState, JobStore
from service.jobs.index import INDEX_FILE

N_JOBS = 3000


class CountingStore(JobStore):
    """The real store, counting the records it reads."""

    reads = 0

    def read(self, job_id: str) -> JobRecord:
        self.reads += 1
        return super().read(job_id)


def _fill(store: JobStore, n: int, owners: tuple[str, ...] = ("alice", "bob")) -> list[JobRecord]:
    records = []
    for i in range(n):
        job_id, _ = store.new_folder()
        record = JobRecord(id=job_id, model="m", created_at=1000.0 + i, owner=owners[i % len(owners)])
        store.add(record)
        records.append(record)
    return records


def test_listing_reads_limit_records_of_thousands(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    records = _fill(store, N_JOBS)
    store.reads = 0
    newest = store.recent(20)
    assert [r.id for r in newest] == [r.id for r in records[::-1][:20]]
    assert store.reads == 20  # not N_JOBS
    store.reads = 0
    mine = store.recent(10, "bob", everyone=False)
    assert [r.id for r in mine] == [r.id for r in records[::-1] if r.owner == "bob"][:10]
    assert store.reads == 10 and all(r.owner == "bob" for r in mine)
    assert store.recent(5, "carol", everyone=False) == [] and store.reads == 10
    # Removed jobs leave the listing (and are not read).
    for record in records[-5:]:
        store.remove(record.id)
    store.reads = 0
    assert [r.id for r in store.recent(3)] == [r.id for r in records[-8:-5][::-1]]
    assert store.reads == 3
    # A second store (another replica) on the folder sees the same, reading as few.
    other = CountingStore(tmp_path)
    assert [r.id for r in other.recent(4)] == [r.id for r in records[-9:-5][::-1]] and other.reads == 4


def test_expiry_and_the_byte_cap_read_no_record(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    now = time.time()
    records = _fill(store, 300)
    for i, record in enumerate(records[:200]):  # 200 finished, 100 bytes each, oldest first
        (store.folder(record.id) / "output.bin").write_bytes(b"x" * 100)
        store.finished(record.model_copy(update={"state": JobState.DONE, "finished_at": now - 1000 + i}))
    store.reads = 0
    assert store.sweep(ttl_s=1000 - 49.5, orphan_s=3600, now=now) == 50  # finished before now-950.5
    entries = store.index.entries()
    sizes = [entries[r.id].bytes for r in records[100:200]]
    assert all(size >= 100 for size in sizes)  # the output and the record
    assert store.cap_bytes(sum(sizes)) == 50  # 150 left: the 50 oldest go
    assert store.reads <= 100  # remove() reads each removed record once (its idempotency key)
    left = [r for r in records if store.exists(r.id)]
    assert left == records[100:]
    store.index.compact()
    assert len((tmp_path / INDEX_FILE).read_text().splitlines()) == 200 + 100  # created + finished


def test_a_folder_without_an_index_is_indexed_once(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    records = _fill(store, 30)
    (tmp_path / INDEX_FILE).unlink()  # as an older version left it
    fresh = CountingStore(tmp_path)
    assert [r.id for r in fresh.recent(30)] == [r.id for r in records[::-1]]
    fresh.reads = 0
    assert len(fresh.recent(2)) == 2 and fresh.reads == 2
    assert (tmp_path / INDEX_FILE).is_file()


def test_an_empty_store_leaves_no_trace(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    assert store.recent(10) == [] and store.sweep(1, 1) == 0
    assert not (tmp_path / "jobs").exists()


def _replica(root: str, n: int, compact: bool) -> None:
    store = JobStore(Path(root))
    for i in range(n):
        job_id, _ = store.new_folder()
        store.add(JobRecord(id=job_id, model="m", created_at=float(i)))
        if compact and i % 10 == 0:
            store.remove(job_id)
            store.index.compact()


def test_replicas_appending_and_compacting_at_once_lose_no_entry(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_replica, args=(str(tmp_path), 150, i == 0)) for i in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    store = JobStore(tmp_path)
    on_disk = {p.name for p in store.jobs.iterdir()}
    assert set(store.index.entries()) == on_disk and len(on_disk) == 4 * 150 - 15

"""The jobs folder (``TILEWISE_JOBS_DIR``): every job's state and files, shared by all replicas.

Layout (every name is made here; a client's string never becomes a path: ids are checked against
:data:`ID_RE`, idempotency keys are hashed)::

    <root>/jobs/<id>/state.json     the job's record (written whole: a temporary file, then rename)
                    input           the upload, streamed here
                    partial.npy     the network's output so far (a memmap, :mod:`service.jobs.checkpoint`)
                    output.<ext>    the result (the synchronous endpoint's file)
                    lease.<n>       the owner's lease, generation n (:mod:`service.jobs.lease`)
                    cancel          present once a DELETE asked for cancellation
    <root>/active/<id>              one empty file per job not finished yet (what replicas scan)
    <root>/keys/<sha256 of key>     the id of the job an Idempotency-Key made, and its body's sha256
    <root>/index                    one line per event: created (id, time, owner), finished (id,
                                    time, bytes kept), removed (id); see :mod:`service.jobs.index`

Listing, expiry and the byte cap (``TILEWISE_JOBS_MAX_BYTES``) read the index, not the records:
a listing of ``limit`` jobs reads ``limit`` records whatever the number of jobs.

Writers: ``state.json`` is written by whoever holds the job's lease (one replica), and by the
replica that creates the job. Readers (status, events, result, listing) may be any replica: a
rename is atomic, so they see the old record or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from service.errors import JobNotFoundError
from service.jobs.index import ID_RE, IndexEntry, JobIndex
from service.jobs.record import JobRecord, JobState

__all__ = ["ID_RE", "JobState", "JobStore", "iso_utc"]

logger = logging.getLogger(__name__)

_KEY_HEX = frozenset("0123456789abcdef")

STATE_FILE = "state.json"
INPUT_FILE = "input"
PARTIAL_FILE = "partial.npy"
CANCEL_FILE = "cancel"


def iso_utc(epoch_s: float | None) -> str | None:
    """ISO 8601 UTC with milliseconds (``2026-12-01T13:49:34.988Z``), or ``None``."""
    if epoch_s is None:
        return None
    moment = dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
    """Write ``path`` whole: a temporary file beside it, then a rename (fsync'ed when ``durable``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class JobStore:
    """The jobs folder: ids, records, flags, idempotency keys and expiry.

    Args:
        root: the folder; share it between replicas to share their jobs. Nothing is created in it
            before the first job (a server that runs none leaves no trace).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.jobs = self.root / "jobs"
        self.active_dir = self.root / "active"
        self.keys = self.root / "keys"
        self.index = JobIndex(self.root, self._index_records)

    # -- ids and folders --------------------------------------------------------------------------

    @staticmethod
    def check_id(job_id: str) -> str:
        """``job_id`` when it is well formed.

        Raises:
            JobNotFoundError: anything but 32 lower-case hex digits (never used as a path).
        """
        if not isinstance(job_id, str) or not ID_RE.fullmatch(job_id):
            raise JobNotFoundError("no job of this id (ids are 32 hex digits)")
        return job_id

    def folder(self, job_id: str) -> Path:
        """The job's folder (the id checked first)."""
        return self.jobs / self.check_id(job_id)

    def new_folder(self) -> tuple[str, Path]:
        """A fresh id and its (empty) folder."""
        self.jobs.mkdir(parents=True, exist_ok=True)
        while True:
            job_id = secrets.token_hex(16)
            folder = self.jobs / job_id
            try:
                folder.mkdir()
            except FileExistsError:  # pragma: no cover - 128 random bits
                continue
            return job_id, folder

    # -- records ----------------------------------------------------------------------------------

    def read(self, job_id: str) -> JobRecord:
        """The job's record.

        Raises:
            JobNotFoundError: no such job (malformed id, never created, or expired).
        """
        path = self.folder(job_id) / STATE_FILE
        try:
            return JobRecord.from_json(path.read_bytes())
        except FileNotFoundError:
            raise JobNotFoundError(f"no job {job_id} (never submitted, or expired)") from None

    def write(self, record: JobRecord, *, durable: bool = False) -> None:
        """Replace the job's record (``record.id``) atomically; ``durable`` also fsyncs it."""
        path = self.folder(record.id) / STATE_FILE
        _write_atomic(path, record.to_json(), durable=durable)

    def add(self, record: JobRecord) -> None:
        """Record a new job (durably), and index it; it becomes active (unfinished)."""
        self.write(record, durable=True)
        self.index.created(record.id, record.created_at, record.owner)
        self.set_active(record.id, True)

    def finished(self, record: JobRecord) -> None:
        """Write a finished job's record (durably), index its end and the bytes its folder keeps."""
        self.write(record, durable=True)
        self.set_active(record.id, False)
        self.index.finished(record.id, record.finished_at or time.time(), self.folder_bytes(record.id))

    def exists(self, job_id: str) -> bool:
        """Whether the job has a record."""
        return (self.folder(job_id) / STATE_FILE).is_file()

    def folder_bytes(self, job_id: str) -> int:
        """Bytes of the files in the job's folder (0 when it is gone)."""
        total = 0
        for path in self._listing(self.folder(job_id)):
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def recent(self, limit: int, owner: str | None = None, *, everyone: bool = True) -> list[JobRecord]:
        """Up to ``limit`` records, newest first: every job's when ``everyone``, else ``owner``'s.

        Reads the index and then only the records listed (``limit`` of them, plus any removed
        meanwhile), never every record.
        """
        entries = [e for e in self.index.entries().values() if everyone or e.owner == owner]
        entries.sort(key=lambda e: (e.created_at, e.id), reverse=True)
        records: list[JobRecord] = []
        for entry in entries:
            if len(records) >= limit:
                break
            with contextlib.suppress(JobNotFoundError, OSError, ValueError):
                records.append(self.read(entry.id))
        return records

    def _index_records(self) -> list[IndexEntry]:
        """Index entries made from the records (a folder written before the index existed)."""
        entries = []
        for folder in self._listing(self.jobs):
            if ID_RE.fullmatch(folder.name):
                with contextlib.suppress(JobNotFoundError, OSError, ValueError):
                    record = self.read(folder.name)
                    entry = IndexEntry(record.id, record.created_at, record.owner)
                    if record.state.finished:
                        entry.finished_at = record.finished_at or record.created_at
                        entry.bytes = self.folder_bytes(record.id)
                    entries.append(entry)
        return entries

    # -- the active index and the cancel flag ------------------------------------------------------

    def set_active(self, job_id: str, active: bool) -> None:
        """Add the job to the index of unfinished jobs, or remove it."""
        marker = self.active_dir / self.check_id(job_id)
        if active:
            self.active_dir.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def active(self) -> list[str]:
        """Ids of the unfinished jobs."""
        return [p.name for p in self._listing(self.active_dir) if ID_RE.fullmatch(p.name)]

    @staticmethod
    def _listing(folder: Path) -> list[Path]:
        """The entries of ``folder`` (none before it exists)."""
        try:
            return list(folder.iterdir())
        except FileNotFoundError:
            return []

    def request_cancel(self, job_id: str) -> None:
        """Flag the job for cancellation (its owner stops it before its next batch)."""
        (self.folder(job_id) / CANCEL_FILE).touch()

    def cancel_requested(self, job_id: str) -> bool:
        """Whether a DELETE asked for the job's cancellation."""
        return (self.folder(job_id) / CANCEL_FILE).exists()

    # -- idempotency keys ---------------------------------------------------------------------------

    @staticmethod
    def key_hash(key: str, owner: str | None = None) -> str:
        """The file name of an ``Idempotency-Key`` of ``owner`` (the SHA-256 of both: the key
        itself is never a path, and two owners' equal keys name two jobs)."""
        return hashlib.sha256(f"{owner or ''}\0{key}".encode()).hexdigest()

    def find_key(self, key_hash: str) -> str | None:
        """The id of the job made with this key, if it still exists."""
        found = self._read_key(key_hash)
        return found[0] if found is not None else None

    def key_digest(self, key_hash: str) -> str | None:
        """The SHA-256 (hex) of the body the key's job was made from; ``None`` if not recorded."""
        found = self._read_key(key_hash)
        return found[1] if found is not None else None

    def _read_key(self, key_hash: str) -> tuple[str, str | None] | None:
        try:
            words = (self.keys / key_hash).read_text().split()
        except FileNotFoundError:
            return None
        if not words or not ID_RE.fullmatch(words[0]) or not self.exists(words[0]):
            return None
        return words[0], words[1] if len(words) > 1 else None

    def bind_key(self, key_hash: str, job_id: str, digest: str | None = None) -> str:
        """Make the key name ``job_id`` unless it names a job already; returns the id it names.

        ``digest``: the SHA-256 of the job's body, kept with the key (a retry with the same key
        and another file is refused by comparing it; :meth:`key_digest`).

        Atomic across replicas: the key file appears whole (``os.link`` of a finished temporary
        file, which fails when the name exists), so two submissions with one key make one job.
        """
        self.keys.mkdir(parents=True, exist_ok=True)
        target = self.keys / key_hash
        tmp = self.keys / f".{key_hash}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(job_id if digest is None else f"{job_id}\n{digest}\n")
        try:
            for _ in range(3):
                try:
                    os.link(tmp, target)
                    return job_id
                except FileExistsError:
                    existing = self.find_key(key_hash)
                    if existing is not None:
                        return existing
                    target.unlink(missing_ok=True)  # names an expired job: replace it
            raise OSError(f"cannot bind idempotency key {key_hash[:12]}")  # pragma: no cover
        finally:
            tmp.unlink(missing_ok=True)

    # -- removal and expiry -----------------------------------------------------------------------

    def remove(self, job_id: str) -> None:
        """Delete the job's folder, index entry and key."""
        folder = self.folder(job_id)
        key_hash = None
        with contextlib.suppress(JobNotFoundError, OSError, ValueError):
            key_hash = self.read(job_id).key_hash
        self.set_active(job_id, False)
        if key_hash is not None and len(key_hash) == 64 and set(key_hash) <= _KEY_HEX:
            with contextlib.suppress(FileNotFoundError):
                if (self.keys / key_hash).read_text().strip() == job_id:
                    (self.keys / key_hash).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        self.index.removed(job_id)

    def sweep(
        self, ttl_s: float, orphan_s: float, now: float | None = None, max_bytes: int | None = None
    ) -> int:
        """Remove jobs finished more than ``ttl_s`` ago, the oldest finished jobs while those
        keep more than ``max_bytes``, and folders that never became jobs (an upload cut off by a
        dying replica) untouched for ``orphan_s``; returns how many. Reads the index, not the
        records."""
        now = time.time() if now is None else now
        entries = self.index.entries()
        removed = 0
        for entry in entries.values():
            if entry.finished_at is not None and now - entry.finished_at > ttl_s:
                self.remove(entry.id)
                removed += 1
        if max_bytes is not None:
            removed += self.cap_bytes(max_bytes)
        for folder in self._listing(self.jobs):
            if not ID_RE.fullmatch(folder.name) or folder.name in entries:
                continue
            if (folder / STATE_FILE).exists():  # a record the index missed (a crash in between)
                with contextlib.suppress(JobNotFoundError, OSError, ValueError):
                    record = self.read(folder.name)
                    if self.index.entries().get(record.id) is None:
                        self.index.created(record.id, record.created_at, record.owner)
                continue
            with contextlib.suppress(OSError):
                newest = max((p.stat().st_mtime for p in folder.iterdir()), default=folder.stat().st_mtime)
                if now - newest > orphan_s:
                    shutil.rmtree(folder, ignore_errors=True)
                    removed += 1
        if removed:
            logger.info("removed %d expired job folder(s) from %s", removed, self.root)
            self.index.compact()
        return removed

    def cap_bytes(self, max_bytes: int, keep: str | None = None) -> int:
        """Remove finished jobs, oldest first, while finished jobs keep more than ``max_bytes``
        (``TILEWISE_JOBS_MAX_BYTES``); ``keep`` (the job that just finished) is never removed.
        Returns how many were removed."""
        finished = sorted(
            (e for e in self.index.entries().values() if e.finished_at is not None),
            key=lambda e: (e.finished_at or 0.0, e.id),
        )
        total = sum(e.bytes for e in finished)
        removed = 0
        for entry in finished:
            if total <= max_bytes:
                break
            if entry.id == keep:
                continue
            self.remove(entry.id)
            total -= entry.bytes
            removed += 1
        if removed:
            logger.info(
                "removed %d finished job(s): kept bytes over TILEWISE_JOBS_MAX_BYTES=%d", removed, max_bytes
            )
        return removed

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

Writers: ``state.json`` is written by whoever holds the job's lease (one replica), and by the
replica that creates the job. Readers (status, events, result, listing) may be any replica: a
rename is atomic, so they see the old record or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from service.errors import JobNotFoundError

__all__ = ["ID_RE", "JobState", "JobStore", "iso_utc"]

logger = logging.getLogger(__name__)

#: A job id: 128 random bits in hex.
ID_RE = re.compile(r"^[0-9a-f]{32}$")
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")

STATE_FILE = "state.json"
INPUT_FILE = "input"
PARTIAL_FILE = "partial.npy"
CANCEL_FILE = "cancel"


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Whether the job will not change any more."""
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


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

    # -- ids and folders --------------------------------------------------------------------------

    @staticmethod
    def check_id(job_id: str) -> str:
        """``job_id`` when it is well formed.

        Raises:
            JobNotFoundError: anything but 32 lower-case hex digits (never used as a path).
        """
        if not isinstance(job_id, str) or not ID_RE.match(job_id):
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

    def read(self, job_id: str) -> dict[str, Any]:
        """The job's record.

        Raises:
            JobNotFoundError: no such job (malformed id, never created, or expired).
        """
        path = self.folder(job_id) / STATE_FILE
        try:
            record: dict[str, Any] = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise JobNotFoundError(f"no job {job_id} (never submitted, or expired)") from None
        return record

    def write(self, record: dict[str, Any], *, durable: bool = False) -> None:
        """Replace the job's record (``record["id"]``) atomically; ``durable`` also fsyncs it."""
        path = self.folder(record["id"]) / STATE_FILE
        _write_atomic(path, json.dumps(record, sort_keys=True).encode(), durable=durable)

    def exists(self, job_id: str) -> bool:
        """Whether the job has a record."""
        return (self.folder(job_id) / STATE_FILE).is_file()

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records, newest first."""
        records = []
        for folder in self._listing(self.jobs):
            if ID_RE.match(folder.name):
                with contextlib.suppress(JobNotFoundError, OSError, ValueError):
                    records.append(self.read(folder.name))
        records.sort(key=lambda r: (r.get("created_at", 0.0), r["id"]), reverse=True)
        return records[:limit]

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
        return [p.name for p in self._listing(self.active_dir) if ID_RE.match(p.name)]

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
    def key_hash(key: str) -> str:
        """The file name of an ``Idempotency-Key`` (its SHA-256; the key itself is never a path)."""
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

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
        if not words or not ID_RE.match(words[0]) or not self.exists(words[0]):
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
            key_hash = self.read(job_id).get("key_hash")
        self.set_active(job_id, False)
        if isinstance(key_hash, str) and _KEY_RE.match(key_hash):
            with contextlib.suppress(FileNotFoundError):
                if (self.keys / key_hash).read_text().strip() == job_id:
                    (self.keys / key_hash).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)

    def sweep(self, ttl_s: float, orphan_s: float, now: float | None = None) -> int:
        """Remove jobs finished more than ``ttl_s`` ago, and folders that never became jobs (an
        upload cut off by a dying replica) untouched for ``orphan_s``; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for folder in self._listing(self.jobs):
            if not ID_RE.match(folder.name):
                continue
            try:
                record = self.read(folder.name)
            except JobNotFoundError:
                newest = max((p.stat().st_mtime for p in folder.iterdir()), default=folder.stat().st_mtime)
                if now - newest > orphan_s:
                    shutil.rmtree(folder, ignore_errors=True)
                    removed += 1
                continue
            except (OSError, ValueError):
                continue
            finished_at = record.get("finished_at")
            if finished_at is not None and now - finished_at > ttl_s:
                self.remove(folder.name)
                removed += 1
        if removed:
            logger.info("removed %d expired job folder(s) from %s", removed, self.root)
        return removed

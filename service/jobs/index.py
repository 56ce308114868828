"""The jobs folder's index: which jobs exist, whose, when made and finished, and the bytes they keep.

Listing jobs, expiring them and capping the bytes that finished jobs keep
(``TILEWISE_JOBS_MAX_BYTES``) read this one file instead of every job's record, so listing
``limit`` jobs reads ``limit`` records however many jobs the folder holds.

``<root>/index`` is a log of one-line events, space-separated ASCII::

    c <id> <created_at> <owner or ->       a job was made (owner: its API key's name)
    f <id> <finished_at> <bytes>           it finished, keeping <bytes> in its folder
    r <id>                                 it was removed

Safe across replicas sharing the folder (any POSIX filesystem with ``flock``; see
:mod:`service.jobs.lease`): an event is one ``write`` to a file opened ``O_APPEND`` under a shared
``flock`` of ``<root>/index.lock``; compaction (rewriting the live entries to a temporary file,
then a rename) holds the lock exclusively, so no event is lost to a file being replaced. Readers
take no lock: lines are whole or absent, and an unparsable line is skipped. A folder without an
index (made by an older version) is indexed once from its records.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ID_RE", "OWNER_RE", "IndexEntry", "JobIndex"]

logger = logging.getLogger(__name__)

#: A job id: 128 random bits in hex (checked with ``fullmatch``: no trailing newline).
ID_RE = re.compile(r"[0-9a-f]{32}")
#: An API key's name (a job's owner): no spaces, so that it fits an index line.
OWNER_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}")

INDEX_FILE = "index"
LOCK_FILE = "index.lock"


@dataclass
class IndexEntry:
    """What the index knows of one job."""

    id: str
    created_at: float
    owner: str | None
    finished_at: float | None = None
    bytes: int = 0


class JobIndex:
    """The index of the jobs folder ``root``.

    Args:
        root: the jobs folder (shared by the replicas).
        rebuild: returns the entries of the folder's records, for a folder without an index.
    """

    def __init__(self, root: Path, rebuild: Callable[[], list[IndexEntry]]) -> None:
        self.path = Path(root) / INDEX_FILE
        self.lock_path = Path(root) / LOCK_FILE
        self._rebuild = rebuild
        self._mutex = threading.Lock()
        self._ino: int | None = None
        self._offset = 0
        self._lines = 0
        self._entries: dict[str, IndexEntry] = {}

    # -- writing ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):  # ENOLCK (no locks on this filesystem): go on unlocked
                fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _append(self, line: str) -> None:
        self._ensure()
        with self._locked(fcntl.LOCK_SH):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode("ascii"))
            finally:
                os.close(fd)

    def created(self, job_id: str, created_at: float, owner: str | None) -> None:
        """Record a new job."""
        self._append(f"c {job_id} {created_at!r} {owner or '-'}\n")

    def finished(self, job_id: str, finished_at: float, n_bytes: int) -> None:
        """Record that a job finished, keeping ``n_bytes`` in its folder."""
        self._append(f"f {job_id} {finished_at!r} {max(0, int(n_bytes))}\n")

    def removed(self, job_id: str) -> None:
        """Record that a job was removed."""
        self._append(f"r {job_id}\n")

    def compact(self) -> None:
        """Rewrite the index with the live entries only (when removals made it much longer)."""
        with self._locked(fcntl.LOCK_EX):
            entries = self.entries()
            if self._lines <= 2 * len(entries) + 64:
                return
            tmp = self.path.with_name(f".{INDEX_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
            lines = [_created_line(e) for e in entries.values()]
            lines += [f"f {e.id} {e.finished_at!r} {e.bytes}\n" for e in entries.values() if e.finished_at]
            try:
                tmp.write_text("".join(lines), encoding="ascii")
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
        logger.info("job index compacted: %d lines to %d", self._lines, len(lines))

    def _ensure(self, *, create: bool = True) -> None:
        """Index a folder that has records but no index yet (once, under the exclusive lock);
        without ``create``, a folder without jobs stays untouched."""
        if self.path.exists():
            return
        if not create and not self._rebuild():
            return
        with self._locked(fcntl.LOCK_EX):
            if self.path.exists():
                return
            entries = self._rebuild()
            lines = [_created_line(e) for e in entries]
            lines += [f"f {e.id} {e.finished_at!r} {e.bytes}\n" for e in entries if e.finished_at]
            tmp = self.path.with_name(f".{INDEX_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
            try:
                tmp.write_text("".join(lines), encoding="ascii")
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            if entries:
                logger.info("indexed %d existing jobs in %s", len(entries), self.path)

    # -- reading ------------------------------------------------------------------------------------

    def entries(self) -> dict[str, IndexEntry]:
        """The live jobs by id (a new dict; its entries are shared: do not change them). Only what
        was appended since the last call is parsed."""
        self._ensure(create=False)
        with self._mutex:
            try:
                fh = self.path.open("rb")
            except FileNotFoundError:
                return {}
            with fh:
                ino = os.fstat(fh.fileno()).st_ino
                size = os.fstat(fh.fileno()).st_size
                if ino != self._ino or size < self._offset:  # replaced (compacted): read it again
                    self._ino, self._offset, self._lines, self._entries = ino, 0, 0, {}
                fh.seek(self._offset)
                data = fh.read(size - self._offset)
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            for raw in data[:end].splitlines():
                self._lines += 1
                self._apply(raw.decode("ascii", "replace").split(" "))
            self._offset += end
            return dict(self._entries)

    def _apply(self, fields: list[str]) -> None:
        try:
            kind, job_id = fields[0], fields[1]
            if not ID_RE.fullmatch(job_id):
                return
            if kind == "c" and len(fields) == 4:
                owner = None if fields[3] == "-" else fields[3]
                self._entries[job_id] = IndexEntry(job_id, float(fields[2]), owner)
            elif kind == "f" and len(fields) == 4 and job_id in self._entries:
                old = self._entries[job_id]  # replaced, not changed: callers may hold the old one
                self._entries[job_id] = IndexEntry(
                    old.id, old.created_at, old.owner, float(fields[2]), int(fields[3])
                )
            elif kind == "r":
                self._entries.pop(job_id, None)
        except (IndexError, ValueError):
            logger.warning("job index: skipped a line that does not parse: %r", " ".join(fields)[:120])


def _created_line(entry: IndexEntry) -> str:
    return f"c {entry.id} {entry.created_at!r} {entry.owner or '-'}\n"

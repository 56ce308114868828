"""Job leases: one replica runs (or queues) each job, and another takes it over when that one dies.

A lease is a file ``lease.<n>`` in the job's folder (``n``: its generation, 1 for the replica that
accepted the job), holding the owner's id. It works on any POSIX filesystem that the replicas share
(a local disk, a Docker volume mounted into every container, NFS):

- **Taking** (atomic): the taker writes its owner id to a temporary file, locks it with ``flock``,
  and ``os.link``\\ s it to ``lease.<n+1>``; ``link`` fails when the name exists, so of two replicas
  racing for a job exactly one wins. The winner removes the older generations.
- **Holding**: the owner touches the file (its mtime) every third of ``lease_s`` and keeps the
  ``flock`` as long as its process lives.
- **Free**: the newest lease is free when its mtime is older than ``lease_s`` (the owner stopped
  renewing: hung, or its host or network died), or at once when its lock can be taken: the kernel
  drops the locks of a process that ends, killed or not (on one host, containers included; on NFS
  once the server's lock lease lapses). Where the filesystem cannot lock (``ENOLCK``), the expiry
  alone decides.
- **Fencing**: an owner that finds ``lease.<n+1>``, or its own file gone, was presumed dead (paused
  or cut off for longer than ``lease_s``): it has lost the job, stops before its next batch and
  writes nothing more to it.
- **Releasing** (finished, or a graceful stop): the mtime is set to 0 (expired) and the lock dropped,
  so another replica may take the job at its next scan.

Expiry compares a file's mtime (set when touched: by the kernel, or by the NFS server) with the
reader's clock: replicas on different hosts need clocks in step (NTP) to well within ``lease_s``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import IO

__all__ = ["Lease", "Leases"]

logger = logging.getLogger(__name__)

_LEASE_RE = re.compile(r"^lease\.(\d{1,9})$")


class Lease:
    """A lease this process holds on one job (from :meth:`Leases.take`)."""

    def __init__(self, folder: Path, generation: int, handle: IO[bytes]) -> None:
        self.folder = folder
        self.generation = generation
        self.lost = False
        self._handle: IO[bytes] | None = handle

    @property
    def path(self) -> Path:
        """The lease file."""
        return self.folder / f"lease.{self.generation}"

    @property
    def job_id(self) -> str:
        """The id of the job (its folder's name)."""
        return self.folder.name

    def valid(self) -> bool:
        """Whether this process still holds the job (no newer generation, the file still there)."""
        if not self.lost and (
            (self.folder / f"lease.{self.generation + 1}").exists() or not self.path.exists()
        ):
            self.lost = True
            logger.warning("job %s: lease %d was taken over; stopping", self.job_id, self.generation)
        return not self.lost

    def renew(self) -> bool:
        """Touch the lease (unless lost); returns whether it is still held."""
        if not self.valid():
            return False
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.lost = True
        return not self.lost

    def release(self) -> None:
        """Let the job go: the lease expires now and its lock is dropped."""
        if self._handle is None:
            return
        if self.valid():
            with contextlib.suppress(OSError):
                os.utime(self.path, (0, 0))
        self._handle.close()  # drops the flock
        self._handle = None


class Leases:
    """Takes leases for this process.

    Args:
        owner: this replica's id (written into its lease files, for people reading the folder).
        lease_s: how long a lease outlives its owner's last renewal.
    """

    def __init__(self, owner: str, lease_s: float) -> None:
        self.owner = owner
        self.lease_s = lease_s

    @staticmethod
    def newest(folder: Path) -> int:
        """The newest lease generation in ``folder`` (0: none)."""
        generations = [int(m.group(1)) for p in folder.iterdir() if (m := _LEASE_RE.match(p.name))]
        return max(generations, default=0)

    def is_free(self, path: Path) -> bool:
        """Whether the lease at ``path`` is free: expired, or its owner's process is gone."""
        try:
            if time.time() - path.stat().st_mtime > self.lease_s:
                return True
            with path.open("rb+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True  # nobody holds it: the owner is gone (the lock closes with the file)
        except BlockingIOError:
            return False
        except FileNotFoundError:
            return False  # replaced meanwhile: look again at the next scan
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            return False  # no locks here: only the expiry frees a lease

    def take(self, folder: Path) -> Lease | None:
        """Take the job of ``folder`` when nobody holds it (a new job, or a free lease); ``None``
        when someone does, or another replica took it first."""
        current = self.newest(folder)
        if current and not self.is_free(folder / f"lease.{current}"):
            return None
        tmp = folder / f".lease-{secrets.token_hex(6)}"
        handle = tmp.open("xb")
        try:
            body = {"owner": self.owner, "pid": os.getpid(), "taken_at": time.time()}
            handle.write(json.dumps(body).encode())
            handle.flush()
            with contextlib.suppress(OSError):  # no locks on this filesystem: expiry only
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.link(tmp, folder / f"lease.{current + 1}")
            except FileExistsError:
                handle.close()
                return None
        except BaseException:
            handle.close()
            raise
        finally:
            tmp.unlink(missing_ok=True)
        for older in range(1, current + 1):
            (folder / f"lease.{older}").unlink(missing_ok=True)
        if current:
            logger.info("job %s: taken over (lease %d)", folder.name, current + 1)
        return Lease(folder, current + 1, handle)

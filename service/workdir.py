"""The server's temporary folders: one per process under a known root, swept at start-up.

Every request's upload and result live in a folder of its own inside the process folder
``<root>/tilewise-work/<pid>-<random>/`` (``root``: ``TILEWISE_TMP_DIR``, else the system's temporary
folder). The process holds an exclusive ``flock`` on ``.owner`` in its folder for its whole life,
and the kernel drops that lock whenever the process ends, killed or not. So:

- at start-up, a process folder whose lock can be taken belongs to a process that is gone (killed,
  out of memory, a crashed container restarted on the same disk): it is removed, with every
  request folder it still held; folders of live processes (other replicas on the same disk) are
  left alone, even when a PID was reused (a container's server is often PID 7 every time);
- on shutdown, the process removes its own folder, including the folders of requests that were
  cut off or ran too long.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["WorkRoot", "pid_alive", "sweep"]

logger = logging.getLogger(__name__)

_FOLDER = "tilewise-work"
_LOCK = ".owner"


class WorkRoot:
    """This process's temporary folder (create with :meth:`open`, end with :meth:`close`).

    Attributes:
        root: the folder shared by every process (``<tmp>/tilewise-work``).
        path: this process's folder inside it.
    """

    def __init__(self, root: Path, path: Path, lock: IO[bytes]) -> None:
        self.root = root
        self.path = path
        self._lock = lock

    @classmethod
    def open(cls, tmp_dir: Path | str | None = None) -> WorkRoot:
        """Sweep the leftovers of dead processes, then create and lock this process's folder."""
        root = Path(tmp_dir or tempfile.gettempdir()) / _FOLDER
        root.mkdir(parents=True, exist_ok=True)
        removed = sweep(root)
        if removed:
            logger.info("removed %d temporary folder(s) of stopped processes under %s", removed, root)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it takes its final name, so no other process's sweep ever sees it unlocked.
        staging = root / f".new-{name}"
        staging.mkdir(mode=0o700)
        lock = (staging / _LOCK).open("wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.write(f"{os.getpid()}\n".encode())
            lock.flush()
            path = root / name
            staging.rename(path)
        except BaseException:
            lock.close()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(root, path, lock)

    def mkdtemp(self) -> Path:
        """A new folder for one request, inside this process's folder."""
        return Path(tempfile.mkdtemp(prefix="req-", dir=self.path))

    def close(self) -> None:
        """Remove this process's folder (every request folder in it), release the lock, and remove
        the shared root when no other process uses it."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()
        try:
            self.root.rmdir()
        except OSError:
            pass  # another process's folder is in it


def sweep(root: Path) -> int:
    """Remove the process folders under ``root`` whose owner is gone; returns how many."""
    removed = 0
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            with (folder / _LOCK).open("rb") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live process holds it
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        except FileNotFoundError:
            # No lock file: a process that died between mkdir and lock (``.new-<pid>-...``).
            pid = folder.name.removeprefix(".new-").partition("-")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        except OSError as exc:
            logger.warning("could not check temporary folder %s: %s", folder, exc)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (signal 0; another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""What a batch run completed, so that a resumed run trusts only what it can verify.

``OUTPUT_DIR/tilewise-manifest.jsonl`` (beside the report) holds one JSON line per completed file,
appended (and fsync'ed) right after its output was renamed into place::

    {"input": "a/scan.nii.gz", "input_size": 1234, "input_mtime_ns": 1700000000000000000,
     "output": "a/scan.nii.gz", "size": 5678, "sha256": "9f86d0...", "model": "gaussian-3d",
     "params": {"tile": "64"}}

A resumed run skips an input only when its latest line matches: same model and parameters, the
input unchanged (size and modification time), and the output present with the recorded size and
SHA-256. A truncated, altered or foreign file under a final name is redone, and so is an output
with no line (written by something else, or by a run killed between rename and record). A line
cut short by a crash is ignored. At the end of each run the file is rewritten with one line per
input (atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["MANIFEST_NAME", "Entry", "Manifest", "sha256_file"]

logger = logging.getLogger(__name__)

#: File name of the manifest inside OUTPUT_DIR.
MANIFEST_NAME = "tilewise-manifest.jsonl"
_HASH_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Entry:
    """One completed input: where its output is and what it was made from."""

    input: str
    input_size: int
    input_mtime_ns: int
    output: str
    size: int
    sha256: str
    model: str
    params: dict[str, str] = field(default_factory=dict)


class Manifest:
    """The completed files of OUTPUT_DIR (thread-safe appends).

    Args:
        output_dir: the run's OUTPUT_DIR (the manifest lives there).
    """

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / MANIFEST_NAME
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._load()

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            logger.warning("cannot read %s (%s): every existing output will be redone", self.path, exc)
            return
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                entry = Entry(**json.loads(line))
            except (ValueError, TypeError):
                logger.debug("%s:%d: not a manifest line; ignored", self.path.name, number)
                continue
            self._entries[entry.input] = entry

    def get(self, rel: str) -> Entry | None:
        """The latest entry of input ``rel``, if any."""
        return self._entries.get(rel)

    def verify(
        self, rel: str, source: Path, output_dir: Path, model: str, params: Mapping[str, str]
    ) -> tuple[Entry | None, str]:
        """Whether input ``rel`` was completed by an identical run and its output is intact.

        Returns:
            ``(entry, "")`` when verified; ``(None, why not)`` otherwise.
        """
        entry = self._entries.get(rel)
        if entry is None:
            return None, "not in the manifest"
        if entry.model != model or entry.params != dict(params):
            return None, "made with another model or other parameters"
        try:
            stat = source.stat()
        except OSError as exc:
            return None, f"input unreadable ({exc})"
        if (stat.st_size, stat.st_mtime_ns) != (entry.input_size, entry.input_mtime_ns):
            return None, "input changed since"
        output = output_dir / entry.output
        try:
            size = output.stat().st_size
            if size != entry.size:
                return None, f"output is {size} bytes, the manifest says {entry.size}"
            if sha256_file(output) != entry.sha256:
                return None, "output's SHA-256 differs from the manifest"
        except FileNotFoundError:
            return None, "output missing"
        except OSError as exc:
            return None, f"output unreadable ({exc})"
        return entry, ""

    def record(self, entry: Entry) -> None:
        """Append ``entry`` (fsync'ed: it survives a crash right after).

        Raises:
            OSError: the manifest cannot be written.
        """
        line = json.dumps(asdict(entry), separators=(",", ":")) + "\n"
        with self._lock:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self._entries[entry.input] = entry

    def compact(self) -> None:
        """Rewrite the manifest with one line per input (atomically). Errors are logged, not
        raised (the outputs are already safe)."""
        with self._lock:
            entries = [e for _, e in sorted(self._entries.items())]
            if not entries and not self.path.exists():
                return
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", suffix=".part", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as fh:
                        for entry in entries:
                            fh.write(json.dumps(asdict(entry), separators=(",", ":")) + "\n")
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                logger.warning("cannot rewrite %s: %s", self.path, exc)

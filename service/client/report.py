"""The per-file outcome of a batch run and the ``tilewise-report.json`` written at its end.

Schema (DESIGN "Interfaces in detail"; extra keys may be added, none removed)::

    {"files": [{"input", "output", "status": "done"|"skipped"|"failed", "seconds", "error",
                "attempts", "bytes_in", "bytes_out"}],
     "summary": {"done", "skipped", "failed", "seconds", "files_per_s"},
     "model", "url", "input_dir", "output_dir", "params", "manifest", "interrupted"}

``input`` is relative to ``input_dir`` and ``output`` to ``output_dir`` (POSIX separators);
``output`` names a file that exists (written now, or found by a resumed run), else ``null``.
``error`` is the server's ``"HTTP <status> <code>: <detail>"``, a connection failure, or why a file
was skipped (unsupported content or DICOM, a symlink not followed, output verified by the
manifest, interrupted before it was sent). ``interrupted`` is true after Ctrl-C.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = ["REPORT_NAME", "FileResult", "Status", "summarize", "write_report"]

#: File name of the report inside OUTPUT_DIR.
REPORT_NAME = "tilewise-report.json"


class Status(str, Enum):
    """Outcome of one input file."""

    DONE = "done"
    SKIPPED = "skipped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class FileResult:
    """Outcome of one input file (one entry of the report's ``files`` list)."""

    input: str
    output: str | None
    status: Status
    seconds: float = 0.0
    error: str | None = None
    attempts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def to_json(self) -> dict[str, Any]:
        """This entry as JSON-ready data."""
        data = asdict(self)
        data["status"] = self.status.value
        data["seconds"] = round(self.seconds, 3)
        return data


def summarize(results: Sequence[FileResult], seconds: float) -> dict[str, Any]:
    """Counts per status, wall time, and the throughput of the files sent (done or failed)."""
    counts = {status.value: 0 for status in Status}
    for result in results:
        counts[result.status.value] += 1
    sent = counts["done"] + counts["failed"]
    return {
        **counts,
        "seconds": round(seconds, 3),
        "files_per_s": round(sent / seconds, 4) if seconds > 0 else 0.0,
    }


def write_report(
    output_dir: Path,
    results: Sequence[FileResult],
    seconds: float,
    *,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``OUTPUT_DIR/tilewise-report.json`` atomically (temporary name, then rename).

    Returns:
        the report's path.
    """
    payload = {
        "files": [r.to_json() for r in sorted(results, key=lambda r: r.input)],
        "summary": summarize(results, seconds),
        **(meta or {}),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / REPORT_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{REPORT_NAME}.", suffix=".part", dir=output_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

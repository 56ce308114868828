"""OUTPUT_DIR safety for a batch run: prove it writable, never write outside it, clear stale temporaries.

One job: the checks and cleanup on the output folder that :func:`service.client.runner.run_batch`
does before sending anything and before each write.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path, PurePosixPath

from service.client.errors import OutputDirError
from service.client.plan import inside
from service.workdir import pid_alive

__all__ = ["remove_stale_parts"]

_PART_RE = re.compile(r"^\..+\.(\d+)-[0-9a-f]{8}\.part$")


def remove_stale_parts(output_dir: Path) -> int:
    """Delete temporary outputs left by batch processes that no longer run; returns how many."""
    removed = 0
    for dirpath, _, filenames in os.walk(output_dir):
        for name in filenames:
            match = _PART_RE.match(name)
            if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
                (Path(dirpath) / name).unlink(missing_ok=True)
                removed += 1
    return removed


def _prepare_output_dir(output_dir: Path) -> None:
    """Create OUTPUT_DIR and prove it writable: a file written, fsync'ed and removed.

    Raises:
        OutputDirError: read-only, full, or no permission (one line, with the OS's reason).
    """
    probe = output_dir / f".tilewise-write-check.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            with probe.open("wb") as fh:
                fh.write(b"\0" * 65536)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OutputDirError(f"OUTPUT_DIR {output_dir} is not writable: {reason}") from exc


def _output_escape(root: str, out_rel: PurePosixPath) -> str | None:
    """Why writing ``out_rel`` would leave OUTPUT_DIR (a symlinked folder on the way), or ``None``."""
    parent = os.path.realpath(os.path.join(root, *out_rel.parent.parts))
    if inside(parent, root):
        return None
    return f"output path {out_rel} leaves OUTPUT_DIR (its folder resolves to {parent}): not written"

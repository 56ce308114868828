"""The data of a batch run: its options, its outcome, one file's job and what the run's threads share.

One job: the plain records passed between :mod:`service.client.runner`, :mod:`service.client.batch_plan`
and :mod:`service.client.send`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from service.client.api import TilewiseClient
from service.client.manifest import Manifest
from service.client.plan import Candidate
from service.client.progress import Progress
from service.client.report import FileResult, Status

__all__ = ["BatchOptions", "BatchOutcome"]


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """What to run over which folder.

    Attributes:
        input_dir: folder of inputs.
        output_dir: folder of outputs (created); must differ from ``input_dir``.
        model: model name on the server.
        params: inference query parameters as strings (``tile``, ``halo``, ``format`` ...).
        patterns: globs on relative paths (:func:`service.client.plan.glob_to_regex`).
        recursive: walk subfolders.
        overwrite: redo outputs that exist.
        jobs: send every file as a job (:mod:`service.client.jobs`) instead of a synchronous request.
        jobs_min_bytes: send files of at least this many bytes as jobs (``None``: only ``jobs``).
    """

    input_dir: Path
    output_dir: Path
    model: str
    params: Mapping[str, str] = field(default_factory=dict)
    patterns: Sequence[str] = ()
    recursive: bool = False
    overwrite: bool = False
    jobs: bool = False
    jobs_min_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """Results of a run: one per input file, the wall time and where the report went."""

    results: list[FileResult]
    seconds: float
    report_path: Path

    def count(self, status: Status) -> int:
        """Number of files with ``status``."""
        return sum(r.status is status for r in self.results)

    @property
    def ok(self) -> bool:
        """True when no file failed."""
        return self.count(Status.FAILED) == 0


@dataclass(frozen=True, slots=True)
class _Job:
    candidate: Candidate
    out_rel: PurePosixPath
    fmt: str


@dataclass
class _Run:
    """What the run's threads share."""

    client: TilewiseClient
    options: BatchOptions
    output_root: str  # OUTPUT_DIR, resolved
    manifest: Manifest
    progress: Progress
    stopping: threading.Event = field(default_factory=threading.Event)  # first Ctrl-C
    abort: threading.Event = field(default_factory=threading.Event)  # second Ctrl-C
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: dict[str, Path] = field(default_factory=dict)  # input -> its temporary file

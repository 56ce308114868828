"""Run a folder through a tilewise server: plan, skip what is done, send the rest, report.

Every output is written to a hidden temporary name next to its final place
(``.scan.nii.gz.<pid>-<hex>.part``) and renamed into place with :func:`os.replace` only once the
whole answer is on disk and fsync'ed, so OUTPUT_DIR never holds a partial output under a final
name, whenever the client or the server dies. A re-run skips every output that exists (resume)
and sends no request for it; ``overwrite=True`` redoes them. Temporary files left by a killed run
are removed at the next start (only those of processes that no longer exist).
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from service.client.api import InferAnswer, TilewiseClient
from service.client.errors import ClientError, TransportFailure
from service.client.plan import FORMAT_SUFFIXES, Candidate, discover, output_format, output_relpath
from service.client.progress import LogProgress, Progress
from service.client.report import FileResult, Status, write_report
from service.sniff import DICOM_ADVICE

__all__ = ["BatchOptions", "BatchOutcome", "run_batch"]

logger = logging.getLogger(__name__)

_PART_RE = re.compile(r"^\..+\.(\d+)-[0-9a-f]{8}\.part$")
_CONTENT_TYPE_FORMATS = {
    "image/png": "png",
    "image/tiff": "tiff",
    "application/x-npy": "npy",
    "application/octet-stream+npy": "npy",
}


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
    """

    input_dir: Path
    output_dir: Path
    model: str
    params: Mapping[str, str] = field(default_factory=dict)
    patterns: Sequence[str] = ()
    recursive: bool = False
    overwrite: bool = False


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_parts(output_dir: Path) -> int:
    """Delete temporary outputs left by batch processes that no longer run; returns how many."""
    removed = 0
    for dirpath, _, filenames in os.walk(output_dir):
        for name in filenames:
            match = _PART_RE.match(name)
            if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
                (Path(dirpath) / name).unlink(missing_ok=True)
                removed += 1
    return removed


def _server_format(answer: InferAnswer) -> str | None:
    """The output format an answer declares: ``X-Tilewise-Format``, else its file name or type."""
    if answer.format in FORMAT_SUFFIXES:
        return answer.format
    content_type, filename = answer.content_type, answer.filename
    if filename:
        lower = filename.lower()
        for fmt, suffix in sorted(FORMAT_SUFFIXES.items(), key=lambda kv: -len(kv[1])):
            if lower.endswith(suffix):
                return fmt
    return _CONTENT_TYPE_FORMATS.get(content_type.split(";")[0].strip().lower())


def _send(client: TilewiseClient, job: _Job, options: BatchOptions) -> FileResult:
    """Send one file and rename its answer into place; never raises for a per-file failure."""
    rel = str(job.candidate.rel)
    final = options.output_dir / job.out_rel
    tmp = final.parent / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    t0 = time.monotonic()
    out_rel, attempts, bytes_out = str(job.out_rel), 0, 0
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        answer = client.infer_to_file(job.candidate.path, tmp, options.model, options.params, label=rel)
        attempts, bytes_out = answer.attempts, answer.bytes_out
        declared = _server_format(answer)
        if declared and declared != job.fmt and "format" not in options.params:
            # The server chose another format than the one planned: keep its suffix, and say how
            # to make the name predictable (a re-run looks for the planned name).
            renamed = output_relpath(job.out_rel, declared)
            logger.warning(
                "%s: server answered %s, not %s; writing %s (pass --format to fix names)",
                rel,
                declared,
                job.fmt,
                renamed,
            )
            out_rel, final = str(renamed), options.output_dir / renamed
        os.replace(tmp, final)
    except ClientError as exc:
        return _failed(job, t0, str(exc), exc.attempts)
    except OSError as exc:
        return _failed(job, t0, f"{type(exc).__name__}: {exc}", max(attempts, 1))
    except Exception as exc:  # a bug must not lose the report of the other files
        logger.exception("%s: unexpected error", rel)
        return _failed(job, t0, f"{type(exc).__name__}: {exc}", max(attempts, 1))
    finally:
        tmp.unlink(missing_ok=True)
    return FileResult(
        input=rel,
        output=out_rel,
        status=Status.DONE,
        seconds=time.monotonic() - t0,
        attempts=attempts,
        bytes_in=job.candidate.size_bytes,
        bytes_out=bytes_out,
    )


def _failed(job: _Job, t0: float, error: str, attempts: int) -> FileResult:
    return FileResult(
        input=str(job.candidate.rel),
        output=None,
        status=Status.FAILED,
        seconds=time.monotonic() - t0,
        error=error,
        attempts=attempts,
        bytes_in=job.candidate.size_bytes,
    )


def _model_defaults(client: TilewiseClient, model: str, *, reachable: bool) -> dict[str, Any] | None:
    """The model's ``defaults`` from the server.

    Args:
        reachable: when False, an unreachable server gives ``None`` instead of an error.

    Raises:
        ClientError: the server refused (unknown model, wrong API key ...) or, with ``reachable``,
            stayed unreachable through every retry.
    """
    try:
        info = client.model_info(model)
    except TransportFailure as exc:
        if reachable:
            raise
        logger.warning("cannot read the model list (%s); using the documented defaults", exc)
        return None
    defaults = info.get("defaults")
    return defaults if isinstance(defaults, dict) else {}


def _plan(
    candidates: Sequence[Candidate],
    options: BatchOptions,
    defaults: Mapping[str, Any] | None,
) -> tuple[list[_Job], list[FileResult]]:
    """Split candidates into jobs to send and results known without the server."""
    jobs: list[_Job] = []
    known: list[FileResult] = []
    owners: dict[PurePosixPath, str] = {}
    for cand in candidates:
        rel = str(cand.rel)
        if not cand.sendable:
            reason = (
                f"DICOM: {DICOM_ADVICE}"
                if cand.kind == "dicom"
                else "not a format the server reads (content)"
            )
            known.append(FileResult(rel, None, Status.SKIPPED, error=reason))
            continue
        fmt = output_format(
            cand.effective_kind,
            fmt=options.params.get("format"),
            output=options.params.get("output"),
            defaults=defaults,
        )
        out_rel = output_relpath(cand.rel, fmt)
        if out_rel in owners:
            clash = f"output {out_rel} is also that of {owners[out_rel]}"
            known.append(FileResult(rel, None, Status.FAILED, error=clash))
            continue
        owners[out_rel] = rel
        if not options.overwrite and (options.output_dir / out_rel).exists():
            known.append(FileResult(rel, str(out_rel), Status.SKIPPED, error="output exists"))
            continue
        jobs.append(_Job(cand, out_rel, fmt))
    return jobs, known


def run_batch(
    options: BatchOptions,
    client: TilewiseClient,
    *,
    progress: Progress | None = None,
) -> BatchOutcome:
    """Send every readable file of ``options.input_dir`` to the server and write the outputs.

    Files are sent ``client.settings.concurrency`` at a time. A file whose request fails (after
    the client's retries) is reported and the run goes on; the report is written even when the
    run is interrupted.

    Returns:
        the outcome; ``outcome.ok`` is False when any file failed.

    Raises:
        NotADirectoryError: ``input_dir`` is not a folder.
        ValueError: ``output_dir`` is ``input_dir``.
        ClientError: the server refused the run as a whole (unknown model, wrong API key), or
            was unreachable before anything was sent.
    """
    t0 = time.monotonic()
    progress = progress or LogProgress()
    input_dir, output_dir = options.input_dir, options.output_dir
    if not input_dir.is_dir():
        raise NotADirectoryError(f"INPUT_DIR {input_dir} is not a folder")
    if input_dir.resolve() == output_dir.resolve():
        raise ValueError("OUTPUT_DIR must differ from INPUT_DIR (outputs keep the input names)")
    output_dir.mkdir(parents=True, exist_ok=True)
    if n := remove_stale_parts(output_dir):
        logger.info("removed %d temporary file(s) left by an interrupted run", n)

    candidates = discover(
        input_dir, patterns=options.patterns, recursive=options.recursive, exclude=output_dir
    )
    sendable = [c for c in candidates if c.sendable]
    defaults: Mapping[str, Any] | None = None
    if sendable and "format" not in options.params:
        # Output names may depend on the model's defaults; a re-run with nothing left to send
        # must work without the server, so an unreachable one is tolerated here.
        defaults = _model_defaults(client, options.model, reachable=False)
    jobs, results = _plan(candidates, options, defaults)
    logger.info(
        "%d files found: %d to send, %d skipped or refused before sending",
        len(candidates),
        len(jobs),
        len(results),
    )
    if jobs and defaults is None:
        # Fail fast on an unknown model, a wrong key or a server that is not there.
        _model_defaults(client, options.model, reachable=True)

    meta = {
        "model": options.model,
        "url": client.settings.url,
        "input_dir": str(input_dir),
        "output_dir": str(output_dir),
        "params": dict(options.params),
    }
    progress.start(len(jobs), sum(j.candidate.size_bytes for j in jobs))
    pool = ThreadPoolExecutor(max_workers=client.settings.concurrency, thread_name_prefix="tilewise")
    try:
        futures = {}
        for job in jobs:
            futures[pool.submit(_run_one, client, job, options, progress)] = job
        for future in as_completed(futures):
            results.append(future.result())
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        done = {r.input for r in results}
        results.extend(
            FileResult(str(j.candidate.rel), None, Status.FAILED, error="interrupted")
            for j in jobs
            if str(j.candidate.rel) not in done
        )
        write_report(output_dir, results, time.monotonic() - t0, meta=meta)
        raise
    finally:
        pool.shutdown(wait=True)
        progress.close()
    seconds = time.monotonic() - t0
    report_path = write_report(output_dir, results, seconds, meta=meta)
    return BatchOutcome(sorted(results, key=lambda r: r.input), seconds, report_path)


def _run_one(client: TilewiseClient, job: _Job, options: BatchOptions, progress: Progress) -> FileResult:
    progress.file_started(str(job.candidate.rel))
    result = _send(client, job, options)
    progress.file_finished(result)
    return result

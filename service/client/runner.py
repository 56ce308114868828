"""Run a folder through a tilewise server: plan, skip what is done, send the rest, report.

Every output is written to a hidden temporary name next to its final place
(``.scan.nii.gz.<pid>-<hex>.part``) and renamed into place with :func:`os.replace` only once the
whole answer is on disk and fsync'ed, so OUTPUT_DIR never holds a partial output under a final
name, whenever the client or the server dies. Temporary files left by a killed run are removed at
the next start (only those of processes that no longer exist).

- **Never outside OUTPUT_DIR**: every output path is resolved before anything is created or
  sent; one that leaves OUTPUT_DIR (through a symlinked folder inside it) fails with the reason
  and its input is not uploaded.
- **Resume**: each completed output is recorded with its size and SHA-256 in
  ``OUTPUT_DIR/tilewise-manifest.jsonl`` (:mod:`service.client.manifest`). A re-run skips an input
  only when that record verifies (same model and parameters, input unchanged, output intact);
  anything else is redone. ``overwrite=True`` redoes everything.
- **OUTPUT_DIR is checked before the first upload**: created, then a file written, fsync'ed and
  removed; a read-only or full folder stops the run (:class:`~service.client.errors.OutputDirError`).
- **Ctrl-C**: the first stops starting files and lets those in flight finish (their outputs are
  reported ``done``); a second aborts them: their uploads and downloads stop at the next chunk,
  their temporary files are removed, and they are reported ``failed`` ("interrupted"). Files never
  started are reported ``skipped`` ("interrupted before it was sent"). The report is written, with
  ``"interrupted": true``, and :class:`KeyboardInterrupt` is raised again for the caller (exit 130).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from service.client.api import InferAnswer, TilewiseClient
from service.client.errors import ClientError, Interrupted, OutputDirError, TransportFailure
from service.client.manifest import MANIFEST_NAME, Entry, Manifest, sha256_file
from service.client.plan import (
    FORMAT_SUFFIXES,
    Candidate,
    discover,
    inside,
    output_format,
    output_relpath,
)
from service.client.progress import LogProgress, Progress
from service.client.report import REPORT_NAME, FileResult, Status, write_report
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
_ABORT_GRACE_S = 2.0  # after a second Ctrl-C, how long aborting transfers get to stop on their own
NOT_SENT = "interrupted before it was sent"
ABORTED = "interrupted while in flight: aborted, nothing written"


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


def _send(run: _Run, job: _Job) -> FileResult:
    """Send one file and rename its answer into place; never raises for a per-file failure."""
    options, rel = run.options, str(job.candidate.rel)
    root = Path(run.output_root)
    final = root / job.out_rel
    tmp = final.parent / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    t0 = time.monotonic()
    out_rel, attempts, bytes_out = job.out_rel, 0, 0
    run.in_flight[rel] = tmp
    try:
        escape = _output_escape(run.output_root, job.out_rel)
        if escape:
            return _failed(job, t0, escape, 0)
        final.parent.mkdir(parents=True, exist_ok=True)
        as_job = options.jobs or (
            options.jobs_min_bytes is not None and job.candidate.size_bytes >= options.jobs_min_bytes
        )
        if as_job:  # survives a replica dying mid-file: another takes the job over, polls go on
            on_progress = functools.partial(run.progress.file_progress, rel)
            answer = run.client.run_job(
                job.candidate.path, tmp, options.model, options.params, label=rel, abort=run.abort,
                on_progress=on_progress,
            )  # fmt: skip
        else:
            answer = run.client.infer_to_file(
                job.candidate.path, tmp, options.model, options.params, label=rel, abort=run.abort
            )
        attempts, bytes_out = answer.attempts, answer.bytes_out
        declared = _server_format(answer)
        if declared and declared != job.fmt and "format" not in options.params:
            # The server chose another format than the one planned: keep its suffix, and say how
            # to make the name predictable.
            out_rel = output_relpath(job.out_rel, declared)
            logger.warning(
                "%s: server answered %s, not %s; writing %s (pass --format to fix names)",
                rel,
                declared,
                job.fmt,
                out_rel,
            )
            final = root / out_rel
        digest, size = sha256_file(tmp), tmp.stat().st_size
        source = job.candidate.path.stat()
        with run.commit_lock:  # after an abort, nothing more is renamed into place
            if run.abort.is_set():
                raise Interrupted("interrupted")
            os.replace(tmp, final)
            entry = Entry(
                input=rel,
                input_size=source.st_size,
                input_mtime_ns=source.st_mtime_ns,
                output=str(out_rel),
                size=size,
                sha256=digest,
                model=options.model,
                params=dict(options.params),
            )
            try:
                run.manifest.record(entry)
            except OSError as exc:  # the output is complete; only a resume will redo it
                logger.warning("%s: done, but the manifest could not record it: %s", rel, exc)
    except Interrupted:
        return _failed(job, t0, ABORTED, max(attempts, 1))
    except ClientError as exc:
        return _failed(job, t0, str(exc), exc.attempts)
    except OSError as exc:
        return _failed(job, t0, f"{type(exc).__name__}: {exc}", max(attempts, 1))
    except Exception as exc:  # a bug must not lose the report of the other files
        logger.exception("%s: unexpected error", rel)
        return _failed(job, t0, f"{type(exc).__name__}: {exc}", max(attempts, 1))
    finally:
        tmp.unlink(missing_ok=True)
        run.in_flight.pop(rel, None)
    return FileResult(
        input=rel,
        output=str(out_rel),
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
    manifest: Manifest,
    output_root: str,
) -> tuple[list[_Job], list[FileResult]]:
    """Split candidates into jobs to send and results known without the server."""
    jobs: list[_Job] = []
    known: list[FileResult] = []
    owners: dict[PurePosixPath, str] = {}
    for cand in candidates:
        rel = str(cand.rel)
        if cand.unreadable is not None:
            known.append(FileResult(rel, None, Status.FAILED, error=cand.unreadable))
            continue
        if not cand.sendable:
            if cand.skipped is not None:
                reason = cand.skipped
            elif cand.kind == "dicom":
                reason = f"DICOM: {DICOM_ADVICE}"
            else:
                reason = "not a format the server reads (content)"
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
        escape = _output_escape(output_root, out_rel)
        if escape:
            known.append(FileResult(rel, None, Status.FAILED, error=escape))
            continue
        if not options.overwrite:
            entry, why = manifest.verify(rel, cand.path, Path(output_root), options.model, options.params)
            if entry is not None and _output_escape(output_root, PurePosixPath(entry.output)) is None:
                known.append(FileResult(rel, entry.output, Status.SKIPPED, error="output exists (verified)"))
                continue
            if (Path(output_root) / out_rel).exists():
                logger.warning("%s: existing output %s is not trusted (%s); redoing it", rel, out_rel, why)
        jobs.append(_Job(cand, out_rel, fmt))
    return jobs, known


def _worker(run: _Run, jobs: queue.Queue[_Job], results: queue.Queue[FileResult]) -> None:
    """Take jobs until none is left; after a first Ctrl-C, report the rest as not sent."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        rel = str(job.candidate.rel)
        if run.stopping.is_set():
            results.put(FileResult(rel, None, Status.SKIPPED, error=NOT_SENT, bytes_in=0))
            continue
        run.progress.file_started(rel)
        result = _send(run, job)
        run.progress.file_finished(result)
        results.put(result)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore further Ctrl-C while the report is written (main thread only; no-op elsewhere)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _execute(run: _Run, jobs: list[_Job]) -> tuple[list[FileResult], bool]:
    """Send ``jobs`` on ``concurrency`` daemon threads; handle Ctrl-C as the module says.

    Returns:
        ``(results, interrupted)``: one result per job.
    """
    todo: queue.Queue[_Job] = queue.Queue()
    for job in jobs:
        todo.put(job)
    done: queue.Queue[FileResult] = queue.Queue()
    n_threads = min(run.client.settings.concurrency, len(jobs))
    for i in range(n_threads):
        # Daemon threads: a transfer blocked on the network cannot keep an aborted run alive.
        threading.Thread(target=_worker, args=(run, todo, done), name=f"tilewise-{i}", daemon=True).start()
    results: list[FileResult] = []
    interrupts = 0
    deadline: float | None = None
    while len(results) < len(jobs):
        try:
            if deadline is not None and time.monotonic() >= deadline:
                break
            with contextlib.suppress(queue.Empty):
                results.append(done.get(timeout=0.1))
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                run.stopping.set()
                logger.warning(
                    "interrupted: finishing the %d file(s) in flight; press Ctrl-C again to abort them",
                    len(run.in_flight),
                )
            elif deadline is None:
                logger.warning("aborting the %d file(s) in flight", len(run.in_flight))
                run.stopping.set()
                with run.commit_lock:
                    run.abort.set()
                deadline = time.monotonic() + _ABORT_GRACE_S
    if len(results) < len(jobs):  # transfers still blocked on the network after an abort
        with _sigint_ignored():
            with run.commit_lock:
                stuck = dict(run.in_flight)
            for tmp in stuck.values():
                tmp.unlink(missing_ok=True)
            reported = {r.input for r in results}
            for job in jobs:
                rel = str(job.candidate.rel)
                if rel not in reported:
                    error = ABORTED if rel in stuck else NOT_SENT
                    status = Status.FAILED if rel in stuck else Status.SKIPPED
                    results.append(
                        FileResult(rel, None, status, error=error, bytes_in=job.candidate.size_bytes)
                    )
    return results, interrupts > 0


def run_batch(
    options: BatchOptions,
    client: TilewiseClient,
    *,
    progress: Progress | None = None,
) -> BatchOutcome:
    """Send every readable file of ``options.input_dir`` to the server and write the outputs.

    Files are sent ``client.settings.concurrency`` at a time. A file whose request fails (after
    the client's retries) is reported and the run goes on; the report lists every input, and is
    written even when the run is interrupted.

    Returns:
        the outcome; ``outcome.ok`` is False when any file failed.

    Raises:
        NotADirectoryError: ``input_dir`` is not a folder.
        ValueError: ``output_dir`` is ``input_dir``.
        OutputDirError: OUTPUT_DIR cannot be created or written (checked before any upload), or
            the report could not be written.
        ClientError: the server refused the run as a whole (unknown model, wrong API key), or
            was unreachable before anything was sent.
        KeyboardInterrupt: after Ctrl-C, once the report is written.
    """
    t0 = time.monotonic()
    progress = progress or LogProgress()
    input_dir, output_dir = options.input_dir, options.output_dir
    if not input_dir.is_dir():
        raise NotADirectoryError(f"INPUT_DIR {input_dir} is not a folder")
    if input_dir.resolve() == output_dir.resolve():
        raise ValueError("OUTPUT_DIR must differ from INPUT_DIR (outputs keep the input names)")
    _prepare_output_dir(output_dir)
    output_root = os.path.realpath(output_dir)
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
    manifest = Manifest(output_dir)
    jobs, results = _plan(candidates, options, defaults, manifest, output_root)
    logger.info(
        "%d files found: %d to send, %d skipped or refused before sending",
        len(candidates),
        len(jobs),
        len(results),
    )
    if jobs and defaults is None:
        # Fail fast on an unknown model, a wrong key or a server that is not there.
        _model_defaults(client, options.model, reachable=True)

    meta: dict[str, Any] = {
        "model": options.model,
        "url": client.settings.url,
        "input_dir": str(input_dir),
        "output_dir": str(output_dir),
        "params": dict(options.params),
        "manifest": MANIFEST_NAME,
    }
    run = _Run(client, options, output_root, manifest, progress)
    progress.start(len(jobs), sum(j.candidate.size_bytes for j in jobs))
    try:
        sent, interrupted = _execute(run, jobs)
    finally:
        progress.close()
    results.extend(sent)
    seconds = time.monotonic() - t0
    with _sigint_ignored() if interrupted else contextlib.nullcontext():
        manifest.compact()
        try:
            report_path = write_report(
                output_dir, results, seconds, meta={**meta, "interrupted": interrupted}
            )
        except OSError as exc:
            raise OutputDirError(f"cannot write {output_dir / REPORT_NAME}: {exc.strerror or exc}") from exc
    if interrupted:
        raise KeyboardInterrupt
    return BatchOutcome(sorted(results, key=lambda r: r.input), seconds, report_path)

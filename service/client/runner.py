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
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from service.client.api import TilewiseClient
from service.client.batch_plan import _model_defaults, _plan
from service.client.batch_types import BatchOptions, BatchOutcome, _Job, _Run
from service.client.errors import OutputDirError
from service.client.manifest import MANIFEST_NAME, Manifest
from service.client.outdir import _prepare_output_dir, remove_stale_parts
from service.client.plan import discover, unwalked_folders
from service.client.progress import LogProgress, Progress
from service.client.report import REPORT_NAME, FileResult, Status, write_report
from service.client.send import ABORTED, NOT_SENT, _send

__all__ = ["BatchOptions", "BatchOutcome", "run_batch"]

logger = logging.getLogger(__name__)

_ABORT_GRACE_S = 2.0  # after a second Ctrl-C, how long aborting transfers get to stop on their own


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
    if folders := unwalked_folders(input_dir, patterns=options.patterns, recursive=options.recursive):
        shown = ", ".join(folders[:3]) + (", ..." if len(folders) > 3 else "")
        logger.log(
            logging.INFO if jobs else logging.WARNING,
            "%d subfolder(s) of %s not walked (%s): add -r (--recursive) to send their files",
            len(folders), input_dir, shown,
        )  # fmt: skip
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

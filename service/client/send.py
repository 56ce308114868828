"""Send one file of a batch run and rename its answer into place (or report why not).

One job: a single file's round trip: upload (synchronous or as a job), the answer into a hidden
temporary file, its format checked, then renamed into place and recorded in the manifest under the
run's commit lock. Never raises for a per-file failure: it returns a ``FileResult``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from pathlib import Path

from service.client.api import InferAnswer
from service.client.batch_types import _Job, _Run
from service.client.errors import ClientError, Interrupted
from service.client.manifest import Entry, sha256_file
from service.client.outdir import _output_escape
from service.client.plan import FORMAT_SUFFIXES, output_relpath
from service.client.report import FileResult, Status

__all__: list[str] = []

logger = logging.getLogger("service.client.runner")

_CONTENT_TYPE_FORMATS = {
    "image/png": "png",
    "image/tiff": "tiff",
    "application/x-npy": "npy",
    "application/octet-stream+npy": "npy",
    "application/geo+json": "geojson",
    "application/zip": "ome.zarr",
}
NOT_SENT = "interrupted before it was sent"
ABORTED = "interrupted while in flight: aborted, nothing written"


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

"""What clients see of a job: its status document, and its server-sent event stream.

The status (``GET /v1/jobs/{id}``, and the data of every event) is made from the record in the
shared folder, so every replica answers alike for every job::

    {"id", "model", "state", "tiles_done", "tiles_total", "progress", "eta_s",
     "created", "started", "finished", "error", "params"}

``progress`` is ``tiles_done / tiles_total`` (0 until the plan is made, 1 once done); ``eta_s`` is
the remaining tiles at the current run's rate (``null`` until its first batch, 0 once finished).

The event stream polls the record every :data:`POLL_S` and sends one ``progress`` event per change
(state, tiles, error), then one ``done``, ``failed`` or ``cancelled`` event and ends; a comment line
every :data:`KEEPALIVE_S` keeps proxies from closing an idle stream. The record is written at most
every 0.2 s while a job runs, so a stream carries at most about five events a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from service.errors import JobNotFoundError
from service.jobs.record import JobRecord, JobState
from service.jobs.store import iso_utc

__all__ = ["KEEPALIVE_S", "POLL_S", "event_stream", "job_status"]

POLL_S = 0.1
KEEPALIVE_S = 15.0


def job_status(record: JobRecord) -> dict[str, Any]:
    """The public status document of a job record."""
    state = record.state
    total = record.tiles_total
    done = record.tiles_done
    progress = 1.0 if state is JobState.DONE else (min(1.0, done / total) if total else 0.0)
    eta: float | None = None
    if state.finished:
        eta = 0.0
    elif state is JobState.RUNNING and total and record.run_tiles:
        started = record.run_started_at or 0.0
        rate = record.run_tiles / max(1e-6, (record.progress_at or started) - started)
        eta = round(max(0, total - done) / rate, 1)
    return {
        "id": record.id,
        "model": record.model,
        "state": state.value,
        "tiles_done": done,
        "tiles_total": total,
        "tiles_skipped": record.tiles_skipped,
        "progress": round(progress, 4),
        "eta_s": eta,
        "created": iso_utc(record.created_at),
        "started": iso_utc(record.started_at),
        "finished": iso_utc(record.finished_at),
        "error": record.error.model_dump() if record.error else None,
        "params": record.query,
        "stage": record.stage,
        **({"stored": record.stored} if record.stored else {}),
    }


def _event(name: str, data: dict[str, Any], event_id: int) -> bytes:
    return f"event: {name}\nid: {event_id}\ndata: {json.dumps(data)}\n\n".encode()


async def event_stream(
    read: Callable[[], JobRecord], *, poll_s: float = POLL_S, keepalive_s: float = KEEPALIVE_S
) -> AsyncIterator[bytes]:
    """Server-sent events of one job: ``progress`` per change, then its final state.

    Args:
        read: returns the job's current record (run in a worker thread: the folder may be remote).
        poll_s: seconds between two reads.
        keepalive_s: seconds of silence before a comment line is sent.
    """
    last: tuple[Any, ...] | None = None
    sent = 0
    quiet_since = time.monotonic()
    while True:
        try:
            record = await anyio.to_thread.run_sync(read)
        except JobNotFoundError:
            yield b'event: error\ndata: {"error": "unknown_job"}\n\n'
            return
        status = job_status(record)
        key = (
            status["state"], status["tiles_done"], status["tiles_total"], status["stage"],
            json.dumps(status["error"]),
        )  # fmt: skip
        if key != last:
            last = key
            sent += 1
            yield _event("progress", status, sent)
            quiet_since = time.monotonic()
        state = JobState(status["state"])
        if state.finished:
            yield _event(state.value, status, sent + 1)
            return
        if time.monotonic() - quiet_since >= keepalive_s:
            yield b": keep-alive\n\n"
            quiet_since = time.monotonic()
        await anyio.sleep(poll_s)

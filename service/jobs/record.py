"""A job's record: what ``state.json`` in the job's folder holds, as a typed (pydantic) model.

The record is the shared truth every replica reads (:class:`~service.jobs.store.JobStore` writes it
whole, atomically). Clients never see it as such: :func:`service.jobs.events.job_status` makes the
public status document (DESIGN.md's fields) from it. Times are seconds since the epoch (UTC).

Unknown keys in a record on disk (written by a newer replica) are ignored on reading, so replicas
of two versions can share a jobs folder during a rolling update.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JobError", "JobRecord", "JobResult", "JobState"]


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Whether the job will not change any more."""
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=False)


class JobError(_Model):
    """Why a job failed: the JSON error body a synchronous request would have had."""

    error: str
    detail: str


class JobResult(_Model):
    """A done job's output file (in the job's folder) and how to serve it."""

    file: str  # the file's name in the job's folder (``output.<ext>``; never a client's string)
    media_type: str
    filename: str  # the download's name (Content-Disposition)
    headers: dict[str, str] = Field(default_factory=dict)  # X-Tilewise-* of the synchronous answer
    size_bytes: int = Field(default=0, ge=0)


class JobRecord(_Model):
    """One job's record.

    Attributes:
        id: 32 lower-case hex digits (:data:`service.jobs.store.ID_RE`).
        model: the model's name.
        query: the inference parameters, normalised (``InferenceParams.to_query()``).
        state: queued, running, done, failed or cancelled.
        owner: the name of the API key that submitted the job (``None``: no key configured); only
            that key, or an admin key, sees, downloads and cancels it.
        key_hash: the hashed ``Idempotency-Key`` that made the job, if any.
        created_at, started_at, finished_at: epoch seconds (``None`` until it happens).
        tiles_done, tiles_total: progress (``tiles_total`` is ``None`` until the plan is made).
        tiles_skipped: tiles not run (a slide's background, constant inputs): expected from the plan,
            then counted by the run; ``None`` when unknown.
        attempts: runs started (a job whose servers died :data:`~service.jobs.runner.MAX_ATTEMPTS`
            times fails).
        run_started_at, run_tiles, progress_at: the current run's start, tiles and last batch (the
            rate behind ``eta_s``).
        checkpoint: the slab checkpoint of the partial output (:mod:`service.jobs.checkpoint`).
        stage: what a cluster run is doing (``dask: running 27 chunks``), shown as is.
        cluster: the Dask scheduler the job runs on, if any.
        error: why it failed (``None`` otherwise).
        result: the output file once done.
        dicomweb: a job whose input is a series on the DICOMweb server (``study``, ``series``,
            ``store``: :mod:`service.jobs.dicomweb_job`).
        stored: the UIDs (``study``, ``series``, ``sop_instance``) of the SEG stored back, once done.
    """

    id: str
    model: str
    query: dict[str, str] = Field(default_factory=dict)
    state: JobState = JobState.QUEUED
    owner: str | None = None
    key_hash: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    tiles_done: int = 0
    tiles_total: int | None = None
    tiles_skipped: int | None = None
    attempts: int = 0
    run_started_at: float | None = None
    run_tiles: int = 0
    progress_at: float | None = None
    checkpoint: dict[str, Any] | None = None
    stage: str | None = None
    cluster: str | None = None
    error: JobError | None = None
    result: JobResult | None = None
    dicomweb: dict[str, Any] | None = None
    stored: dict[str, str] | None = None

    def to_json(self) -> bytes:
        """The record as ``state.json`` holds it."""
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobRecord:
        """Parse ``state.json``.

        Raises:
            pydantic.ValidationError: not a job record (a ``ValueError``).
        """
        return cls.model_validate_json(data)

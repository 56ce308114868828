"""Asynchronous jobs for large volumes: submit, watch tile by tile, cancel, survive a dead replica.

- :mod:`service.jobs.record`: a job's record (typed);
- :mod:`service.jobs.index`: the index of the jobs folder (listing, expiry, the byte cap);
- :mod:`service.jobs.store`: the jobs folder (``TILEWISE_JOBS_DIR``), shared by every replica;
- :mod:`service.jobs.lease`: which replica runs a job, and taking over from a dead one;
- :mod:`service.jobs.checkpoint`: the partial output on disk, slab by slab, and resuming from it;
- :mod:`service.jobs.progress`: a running job's record (tiles, rate, finished slabs), written as it goes;
- :mod:`service.jobs.runner`: running jobs on the device executor; the lease keeper and scanner;
- :mod:`service.jobs.events`: the status document and the server-sent event stream.

The HTTP side is :mod:`service.routes.jobs`.
"""

from __future__ import annotations

from service.jobs.events import event_stream, job_status
from service.jobs.record import JobRecord, JobState
from service.jobs.runner import JobService
from service.jobs.store import JobStore

__all__ = ["JobRecord", "JobService", "JobState", "JobStore", "event_stream", "job_status"]

"""Prometheus metrics of one app instance (its own registry, so tests can build several apps).

Names follow DESIGN.md: ``tilewise_requests_total{model,status}``,
``tilewise_request_seconds{model}``, ``tilewise_tiles_total{model}``, ``tilewise_queue_depth``,
``tilewise_bytes_in_total`` and ``tilewise_bytes_out_total``; plus
``tilewise_inference_seconds{model,backend}`` (STYLE.md), the device time of each inference.
Jobs (:mod:`service.jobs`): ``tilewise_jobs_total{state}`` (jobs that entered each state on this
replica: ``queued`` when submitted here or taken over, ``running`` at each start, and the three
final states), ``tilewise_jobs_active`` (unfinished jobs in the shared folder: the same on every
replica), ``tilewise_job_tiles_computed_total{model}`` and ``tilewise_job_tiles_resumed_total{model}``
(tiles a run skipped because an earlier run of the job had finished them), and
``tilewise_job_takeovers_total`` (jobs this replica took from one that died or stopped).
Stages and shared batches (issue 20): ``tilewise_stage_seconds{stage}`` (``prepare``, ``queue``,
``execute``, ``finish``), ``tilewise_batch_fill`` and ``tilewise_batch_requests``;
``tilewise_tiles_skipped_total{model}`` (tiles not run: a slide's background, constant inputs). Jobs'
tiles count in ``tilewise_tiles_total`` too.
No per-request labels: ``model`` is a known model name or ``"unknown"``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The service's metrics, registered in a private :class:`CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tilewise_requests",
            "Inference requests by model and HTTP status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "tilewise_request_seconds",
            "Inference request latency (upload to response), seconds.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inference_seconds = Histogram(
            "tilewise_inference_seconds",
            "Decode + inference + encode time on the device executor, seconds.",
            ["model", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tiles = Counter(
            "tilewise_tiles", "Tiles processed, by model.", ["model"], registry=self.registry
        )
        self.tiles_skipped = Counter(
            "tilewise_tiles_skipped",
            "Tiles not run: outside a slide's tissue mask, or a constant input answered from one "
            "computed tile.",
            ["model"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "tilewise_queue_depth",
            "Queue slots in use on the device executor: uploads holding a slot, jobs waiting, "
            "the job running.",
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "tilewise_stage_seconds",
            "Seconds of each stage of a request: prepare, queue, execute, finish.",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_fill = Histogram(
            "tilewise_batch_fill",
            "Tiles per shared forward pass.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=self.registry,
        )
        self.batch_requests = Histogram(
            "tilewise_batch_requests",
            "Requests whose tiles one shared forward pass held.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=self.registry,
        )
        self.bytes_in = Counter("tilewise_bytes_in", "Request body bytes received.", registry=self.registry)
        self.bytes_out = Counter("tilewise_bytes_out", "Response file bytes sent.", registry=self.registry)
        self.jobs = Counter(
            "tilewise_jobs",
            "Jobs that entered each state on this replica.",
            ["state"],
            registry=self.registry,
        )
        self.jobs_active = Gauge(
            "tilewise_jobs_active", "Unfinished jobs in the shared jobs folder.", registry=self.registry
        )
        self.job_tiles_computed = Counter(
            "tilewise_job_tiles_computed",
            "Tiles computed for jobs, by model.",
            ["model"],
            registry=self.registry,
        )
        self.job_tiles_resumed = Counter(
            "tilewise_job_tiles_resumed",
            "Tiles of resumed jobs that were not computed again (finished by an earlier run), by model.",
            ["model"],
            registry=self.registry,
        )
        self.job_takeovers = Counter(
            "tilewise_job_takeovers",
            "Jobs this replica took over from a replica that died or stopped.",
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)

"""Prometheus metrics of one app instance (its own registry, so tests can build several apps).

Names follow DESIGN.md: ``tilewise_requests_total{model,status}``,
``tilewise_request_seconds{model}``, ``tilewise_tiles_total{model}``, ``tilewise_queue_depth``,
``tilewise_bytes_in_total`` and ``tilewise_bytes_out_total``; plus
``tilewise_inference_seconds{model,backend}`` (STYLE.md), the device time of each inference.
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
        self.queue_depth = Gauge(
            "tilewise_queue_depth",
            "Queue slots in use on the device executor: uploads holding a slot, jobs waiting, "
            "the job running.",
            registry=self.registry,
        )
        self.bytes_in = Counter("tilewise_bytes_in", "Request body bytes received.", registry=self.registry)
        self.bytes_out = Counter("tilewise_bytes_out", "Response file bytes sent.", registry=self.registry)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)

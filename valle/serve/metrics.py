"""The server's ``/metrics`` (Prometheus text format, prometheus-client) and its log line per
request. Names and meanings: docs/inference.md, "A synthesis page"."""

from __future__ import annotations

import json
import logging

OUTCOMES = ("ok", "refused", "dropped", "timed_out", "failed")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

request_log = logging.getLogger("valle.serve.requests")


class ServeMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("valle_requests", "synthesis requests by outcome: ok, refused "
                                "(bad input or a full queue), dropped (the client left), timed_out "
                                "(--request-timeout), failed (no audio, or an error)", ["outcome"],
                                registry=self.registry)  # fmt: skip
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome reads 0 before it first happens
        self.latency = Histogram("valle_request_seconds", "seconds from a synthesis request's "
                                 "arrival to its answer, by outcome", ["outcome"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.queue_wait = Histogram("valle_queue_wait_seconds", "seconds a request waited before "
                                    "its batch started", buckets=LATENCY_BUCKETS,
                                    registry=self.registry)  # fmt: skip
        self.batch_rows = Histogram("valle_batch_rows", "rows (requests' texts or sentences) "
                                    "decoded together per batch", buckets=BATCH_BUCKETS,
                                    registry=self.registry)  # fmt: skip
        self.batch_seconds = Histogram("valle_batch_seconds", "seconds a batch took to decode",
                                       buckets=LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.queue_depth = Gauge("valle_queue_depth", "requests waiting (queued, or being "
                                 "checked and prepared)", registry=self.registry)  # fmt: skip
        self.running = Gauge("valle_running_requests", "requests in the batch being decoded",
                             registry=self.registry)  # fmt: skip

    def watch(self, batcher) -> None:
        """The gauges read the queue when scraped."""
        self.queue_depth.set_function(lambda: batcher.depth)
        self.running.set_function(lambda: batcher.running)

    def observe_batch(self, jobs, seconds: float) -> None:
        self.batch_rows.observe(sum(job.rows for job in jobs))
        self.batch_seconds.observe(seconds)
        for job in jobs:
            self.queue_wait.observe(job.started - job.arrived)

    def observe_request(self, outcome: str, seconds: float, **fields) -> None:
        """Count one request and log it as one JSON line (``valle.serve.requests``)."""
        self.requests.labels(outcome).inc()
        self.latency.labels(outcome).observe(seconds)
        request_log.info("%s", json.dumps({"event": "synthesize", "outcome": outcome,
                                           "seconds": round(seconds, 4), **fields}, default=str))  # fmt: skip

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

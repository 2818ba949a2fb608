"""The router's Prometheus metrics, served over HTTP at /metrics (default port 8502).

What an operator (or a HorizontalPodAutoscaler on a custom metric) watches: request counts
by method and status code, latency, requests in flight in this pod, and ready workers. The
names are constants here because deploy/ refers to them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("mpspool.router")

INFLIGHT_METRIC = "mpspool_inflight_requests"
REQUESTS_METRIC = "mpspool_requests"  # exposed as mpspool_requests_total
LATENCY_METRIC = "mpspool_request_duration_seconds"
READY_WORKERS_METRIC = "mpspool_workers_ready"
RETRIES_METRIC = "mpspool_worker_retries"  # exposed as mpspool_worker_retries_total

# Small-batch inference lives between a fraction of a millisecond and a few hundred.
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.requests = Counter(
            REQUESTS_METRIC, "Requests answered, by method and gRPC status code.",
            ["model", "method", "code"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            LATENCY_METRIC, "Time from receiving a request to answering it.",
            ["model", "method"], buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inflight = Gauge(
            INFLIGHT_METRIC, "Requests this router is handling now (a per-pod load signal).",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self.ready_workers = Gauge(
            READY_WORKERS_METRIC, "Workers registered and receiving requests.",
            registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            RETRIES_METRIC, "Requests sent again because their worker left before answering.",
            registry=self.registry,
        )  # fmt: skip
        self._inflight = self.inflight.labels(model)
        self.port = 0

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (a daemon thread); the port it got, 0 if it could not."""
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            # Metrics are for watching the pool; losing them must not stop it serving.
            log.error("metrics endpoint %s:%d unavailable: %s", host, port, exc)
            return 0
        self.port = server.server_address[1]
        return self.port

    @contextmanager
    def request(self, method: str) -> Iterator[list[str]]:
        """Count one request; the caller sets outcome[0] to its status code's name."""
        outcome = ["OK"]
        self._inflight.inc()
        started = time.perf_counter()
        try:
            yield outcome
        except BaseException:
            if outcome[0] == "OK":
                outcome[0] = "UNKNOWN"
            raise
        finally:
            self._inflight.dec()
            self.latency.labels(self.model, method).observe(time.perf_counter() - started)
            self.requests.labels(self.model, method, outcome[0]).inc()

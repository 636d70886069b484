"""Prometheus metrics every service exports, and the HTTP endpoint that serves them (prometheus-client).

Names follow vLLM's, with ``specdec:`` where vLLM has ``vllm:``, so dashboards carry over;
prometheus-client appends ``_total`` to counters and ``_bucket`` / ``_sum`` / ``_count`` to
histograms. Each service owns its registry: several services may share one process (the tests).
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class ServiceMetrics:
    """A service's registry, with the counter of the RPCs it failed (labels ``method`` and
    ``code``, the gRPC status name)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_errors = Counter(
            "specdec:rpc_errors", "RPCs this service failed, by method and gRPC status code.",
            ["method", "code"], registry=self.registry,
        )
        self._http = None

    def track_sessions(self, num_sessions: Callable[[], int], kv_cache_bytes: Callable[[], int]) -> None:
        """Exports the open sessions and the bytes their KV caches hold, read at every scrape."""
        Gauge("specdec:num_sessions", "Open sessions (requests with KV state) on this service.",
              registry=self.registry).set_function(num_sessions)
        Gauge("specdec:kv_cache_bytes", "Bytes held by the KV caches of the open sessions.",
              registry=self.registry).set_function(kv_cache_bytes)

    def serve(self, host: str, port: int) -> None:
        """Serves ``/metrics`` over HTTP on ``host:port`` from a daemon thread; port 0 = off."""
        if port:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        """Stops the HTTP endpoint, if serving."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

"""Prometheus metrics every service exports, and the HTTP endpoint that serves them (prometheus-client).

Names follow vLLM's, with ``specdec_`` where vLLM has ``vllm:``, so dashboards carry over by that one
replacement. Not a colon: Prometheus reserves colons for recording rules, and prometheus-client
escapes them in the OpenMetrics exposition that a Prometheus server negotiates (``specdec:x`` is
stored as ``specdec_x``), while the text format keeps them; an underscore reads the same in both.
prometheus-client appends ``_total`` to counters and ``_bucket`` / ``_sum`` / ``_count`` to
histograms. Each service owns its registry: several services may share one process (the tests).
"""

from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.engine.kv_budget import KVUsage
from specdec.rpc.sessions import SessionRegistry

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
BATCHED_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """What an engine (:mod:`specdec.engine.engine`) reports per step and per call, and its prefills per
    prefix-cache lookup; these report nothing (see :meth:`ServiceMetrics.engine_metrics` for the
    ones that do)."""

    def observe_step(self, num_seqs: int, num_tokens: int, step_ms: float) -> None: ...

    def observe_queue(self, queue_ms: float) -> None: ...

    def observe_prefix_cache(self, num_queried: int, num_hit: int) -> None: ...


class _KVCache(Collector):
    """The KV stores' budget, usage and preemptions (label ``engine``), read from each engine's
    model (:meth:`specdec.engine.batching.BatchedLM.kv_usage`) at every scrape; names as vLLM's
    (``kv_cache_usage_perc``, ``num_preemptions_total``)."""

    def __init__(self) -> None:
        self.usages: dict[str, Callable[[], KVUsage | None]] = {}

    def collect(self):
        usage = GaugeMetricFamily(
            "specdec_kv_cache_usage_perc",
            "Share of the KV budget (--kv-cache-max-bytes) held by open sessions, 0 to 1.",
            labels=["engine"],
        )
        blocks = GaugeMetricFamily(
            "specdec_kv_cache_blocks",
            "KV blocks (16 tokens each) of the budget: total, used (held by open sessions or promised to one "
            "prefilling), free (total - used; the prefix cache's blocks count as free: evictable).",
            labels=["engine", "state"],
        )
        pool = GaugeMetricFamily(
            "specdec_kv_cache_pool_bytes",
            "Bytes the KV pool has allocated now (grows up to the budget, shrinks back as sessions end).",
            labels=["engine"],
        )
        preemptions = CounterMetricFamily(
            "specdec_num_preemptions",
            "Sessions preempted (KV dropped, rebuilt by the coordinator) to give a running one room in a full budget.",
            labels=["engine"],
        )
        for engine, read in self.usages.items():
            if (kv := read()) is None:
                continue
            usage.add_metric([engine], kv.usage_perc)
            for state, value in (("total", kv.budget), ("used", kv.used), ("free", kv.free)):
                blocks.add_metric([engine, state], value)
            pool.add_metric([engine], kv.pool * kv.block_bytes)
            preemptions.add_metric([engine], kv.num_preemptions)
        yield from (usage, blocks, pool, preemptions)


class _EngineFamilies:
    """The metrics of a service's engine loops (label ``engine``): step and queue histograms, the
    calls waiting, prefix-cache counters and size, KV budget and preemptions, registered by the
    first engine that asks (so the coordinator, which has none, exports none)."""

    def __init__(self, registry: CollectorRegistry):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["engine"], buckets=buckets, registry=registry)

        self.batch_size = histogram(
            "specdec_batch_size",
            "Sequences (sessions) per batched forward (step) of an engine loop.",
            BATCH_SIZE_BUCKETS,
        )
        self.batched_tokens = histogram(
            "specdec_num_batched_tokens",
            "New tokens per step (every sequence's verify, decode or prefill tokens).",
            BATCHED_TOKENS_BUCKETS,
        )
        self.step_time = histogram("specdec_step_time_seconds", "A step's forward time.", STEP_BUCKETS)
        self.queue_time = histogram(
            "specdec_queue_time_seconds",
            "Per call: time in the engine's queue before its first step began.",
            QUEUE_BUCKETS,
        )
        self.calls_waiting = Gauge(
            "specdec_num_calls_waiting",
            "Calls queued in the engine that no step has started yet (its queue: what to scale the service on).",
            ["engine"],
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "specdec_prefix_cache_queries",
            "Tokens of prefilled contexts looked up in the prefix cache.",
            ["engine"],
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "specdec_prefix_cache_hits",
            "Tokens of prefilled contexts found in the prefix cache (not computed again).",
            ["engine"],
            registry=registry,
        )
        self.prefix_cache_tokens = Gauge(
            "specdec_prefix_cache_tokens",
            "Tokens the prefix cache keeps for sessions that are gone (bounded by --prefix-cache-max-tokens).",
            ["engine"],
            registry=registry,
        )
        self.kv_cache = _KVCache()
        registry.register(self.kv_cache)


class _EngineView(EngineMetrics):
    """One engine's labelled children of :class:`_EngineFamilies` (the engine and the prefill
    path call its methods)."""

    def __init__(self, families: _EngineFamilies, engine: str):
        self._batch = families.batch_size.labels(engine)
        self._tokens = families.batched_tokens.labels(engine)
        self._step = families.step_time.labels(engine)
        self._queue = families.queue_time.labels(engine)
        self._queries = families.prefix_cache_queries.labels(engine)
        self._hits = families.prefix_cache_hits.labels(engine)

    def observe_step(self, num_seqs: int, num_tokens: int, step_ms: float) -> None:
        self._batch.observe(num_seqs)
        self._tokens.observe(num_tokens)
        self._step.observe(step_ms / 1000)

    def observe_queue(self, queue_ms: float) -> None:
        self._queue.observe(queue_ms / 1000)

    def observe_prefix_cache(self, num_queried: int, num_hit: int) -> None:
        self._queries.inc(num_queried)
        self._hits.inc(num_hit)


class _Evictions(Collector):
    """``specdec_sessions_evicted_total``, read from the registry's count at every scrape."""

    def __init__(self, sessions: SessionRegistry):
        self.sessions = sessions

    def collect(self):
        yield CounterMetricFamily(
            "specdec_sessions_evicted",
            "Sessions released for being idle longer than session_idle_timeout_s "
            "(left by a coordinator that died, or a client that vanished), not by a Release.",
            value=self.sessions.num_evicted,
        )


class ServiceMetrics:
    """A service's registry, with the counter of the RPCs it failed (labels ``method`` and
    ``code``, the gRPC status name)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_errors = Counter(
            "specdec_rpc_errors",
            "RPCs this service failed, by method and gRPC status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self._engines: _EngineFamilies | None = None
        self._http: WSGIServer | None = None

    def engine_metrics(
        self,
        engine: str,
        prefix_cache_tokens: Callable[[], int],
        kv_usage: Callable[[], KVUsage | None] = lambda: None,
        calls_waiting: Callable[[], int] | None = None,
    ) -> EngineMetrics:
        """The metrics of the engine named ``engine`` (its label value); ``prefix_cache_tokens``
        and ``kv_usage`` (its model's :meth:`specdec.engine.batching.BatchedLM.prefix_cache_tokens` and
        :meth:`specdec.engine.batching.BatchedLM.kv_usage`; None: no KV budget metrics), and
        ``calls_waiting`` (the engine's :meth:`specdec.engine.engine.Engine.num_waiting_calls`; None: not
        exported) are read at every scrape."""
        if self._engines is None:
            self._engines = _EngineFamilies(self.registry)
        self._engines.prefix_cache_tokens.labels(engine).set_function(prefix_cache_tokens)
        if calls_waiting is not None:
            self._engines.calls_waiting.labels(engine).set_function(calls_waiting)
        self._engines.kv_cache.usages[engine] = kv_usage
        return _EngineView(self._engines, engine)

    def track_sessions(self, sessions: SessionRegistry) -> None:
        """Exports the open sessions, the bytes their KV caches hold and the sessions evicted as
        idle (a coordinator that died without releasing them), read at every scrape."""
        Gauge(
            "specdec_num_sessions", "Open sessions (requests with KV state) on this service.", registry=self.registry
        ).set_function(lambda: len(sessions))
        Gauge(
            "specdec_kv_cache_bytes", "Bytes held by the KV caches of the open sessions.", registry=self.registry
        ).set_function(sessions.kv_cache_bytes)
        self.registry.register(_Evictions(sessions))

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

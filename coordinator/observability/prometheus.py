"""The coordinator's Prometheus metrics, fed from the same RoundRecords and RequestMetrics the
request's own metrics are built from (names as vLLM's, see :mod:`specdec.observability.prometheus`)."""

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from coordinator.observability.metrics import BONUS, MAIN, RECOVERED, RoundRecord
from specdec.observability.prometheus import ServiceMetrics
from specdec.v1 import common_pb2, coordinator_pb2

# Seconds; vLLM's buckets for the request latencies, finer ones for a round's parts.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
LOAD_BANDS = ((1, "1"), (4, "2-4"), (8, "5-8"), (16, "9-16"), (32, "17-32"))
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


def load_band(batch_size: int) -> str:
    """The ``batch_size`` label of a round whose verify step held ``batch_size`` sequences."""
    return next((band for limit, band in LOAD_BANDS if batch_size <= limit), "33+")


class PlacedReplica(Protocol):
    """What the exporter reads of one replica (placement's
    :class:`coordinator.speculation.placement.ReplicaState`): the sessions this coordinator placed
    there, the prompt tokens they found in its prefix cache, and its last load report."""

    @property
    def placed(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def load(self) -> common_pb2.ServiceLoad | None: ...


class Placements(Protocol):
    """One service's replicas as the exporter reads them at a scrape (placement's
    :class:`coordinator.speculation.placement.Placement`): safe to call from the scrape's thread."""

    def replicas(self) -> Sequence[tuple[str, PlacedReplica]]: ...


class _Placements(Collector):
    """Per replica of the draft and the verify service (labels ``service``, ``replica``), read
    from placement at every scrape: the sessions placed there, the prompt tokens they found in its
    prefix cache, and its last load report."""

    def __init__(self, placements: Mapping[Any, Placements]):
        self.placements = placements

    def collect(self):
        labels = ["service", "replica"]
        placed = CounterMetricFamily(
            "specdec_placements", "Sessions this coordinator opened on the replica.", labels=labels
        )
        cached = CounterMetricFamily(
            "specdec_placement_cached_tokens",
            "Prompt tokens the sessions opened on the replica found in its prefix cache (not computed again).",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "specdec_replica_num_calls_waiting",
            "Calls waiting in the replica's engine, as it last reported (with a Step reply or GetInfo).",
            labels=labels,
        )
        sessions = GaugeMetricFamily(
            "specdec_replica_num_sessions", "Open sessions on the replica, as it last reported.", labels=labels
        )
        for service, placement in self.placements.items():
            for replica, state in placement.replicas():
                placed.add_metric([service, replica], state.placed)
                cached.add_metric([service, replica], state.cached_tokens)
                if state.load is not None:
                    waiting.add_metric([service, replica], state.load.num_waiting_calls)
                    sessions.add_metric([service, replica], state.load.num_sessions)
        yield from (placed, cached, waiting, sessions)


class CoordinatorMetrics(ServiceMetrics):
    """Speculative-decoding counters (by drafter; per draft position), tokens, rounds by K, and
    request and round latency histograms, in seconds."""

    def __init__(self) -> None:
        super().__init__()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.num_requests_running = Gauge(
            "specdec_num_requests_running", "Generate streams in progress.", registry=self.registry
        )
        self.num_requests_waiting = Gauge(
            "specdec_num_requests_waiting",
            "Requests waiting at this coordinator for room on the verify service (every replica was full), "
            "as vLLM's num_requests_waiting.",
            registry=self.registry,
        )
        self.queue_time = histogram(
            "specdec_request_queue_time_seconds",
            "Per request that waited for room on the verify service: from its first refusal to its admission.",
            REQUEST_BUCKETS,
        )
        self.num_drafts = counter(
            "specdec_spec_decode_num_drafts", "Speculative rounds: a non-empty proposal verified.", ("drafter",)
        )
        self.num_draft_tokens = counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed.", ("drafter",))
        self.num_accepted_tokens = counter(
            "specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted.", ("drafter",)
        )
        self.num_forced_draft_tokens = counter(
            "specdec_spec_decode_num_forced_draft_tokens",
            "Draft tokens the request's grammar forced (proposed without a draft forward), by the drafter that "
            "proposed them (forced: the coordinator's forced-token lookup).",
            ("drafter",),
        )
        self.num_draft_tokens_per_pos = counter(
            "specdec_spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed at each position (0 = first) of a proposal.",
            ("drafter", "position"),
        )
        self.num_accepted_tokens_per_pos = counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position (0 = first) of a proposal.",
            ("drafter", "position"),
        )
        self.num_target_forwards = counter(
            "specdec_num_target_forwards", "Rounds (Verify or Decode calls), by the K asked (0 = plain decode).", ("k",)
        )
        self.prompt_tokens = counter("specdec_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("specdec_generation_tokens", "Tokens generated (streamed to clients).")
        self.time_to_first_token = histogram(
            "specdec_time_to_first_token_seconds", "Request start to the first committed round.", TTFT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "specdec_time_per_output_token_seconds",
            "Per request: time after the first token / tokens after the first.",
            TPOT_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "specdec_e2e_request_latency_seconds", "Request start to the last message.", REQUEST_BUCKETS
        )
        self.request_prefill_time = histogram(
            "specdec_request_prefill_time_seconds",
            "Request start until both services finished prefill.",
            REQUEST_BUCKETS,
        )
        self.round_draft_time = histogram(
            "specdec_round_draft_time_seconds", "A round's draft compute time.", ROUND_BUCKETS
        )
        self.round_verify_time = histogram(
            "specdec_round_verify_time_seconds", "A round's verify compute time.", ROUND_BUCKETS
        )
        self.draft_ahead = counter(
            "specdec_draft_ahead_proposals",
            "Proposals drafted ahead (during the previous round's verification) that "
            "a round checked, by outcome (hit: verification went down their branch and the round used them; miss).",
            ("outcome",),
        )
        self.draft_ahead_branch_hits = counter(
            "specdec_draft_ahead_branch_hits",
            "Hits of proposals drafted ahead, by the branch verification went down (main: every token accepted and "
            "the draft's first bonus guess; bonus: another bonus token; recovered: a rejection, then the draft's "
            "second choice).",
            ("branch",),
        )
        for branch in (MAIN, BONUS, RECOVERED):  # exported from the start, at 0
            self.draft_ahead_branch_hits.labels(branch)
        self.draft_ahead_branches = counter(
            "specdec_draft_ahead_branches",
            "Proposals drafted ahead for other outcomes than the main branch (their draft forwards buy the bonus and "
            "recovered hits).",
        )
        self.decoded_ahead = counter(
            "specdec_decoded_ahead_rounds",
            "Plain rounds whose Decode went out with the round before's (decode ahead): their step followed that "
            "one's without waiting for the coordinator's turnaround.",
        )
        self.draft_failures = counter(
            "specdec_draft_failures",
            "Times a request's draft service failed (the request went on without it for a while).",
        )
        self.verify_rebuilds = counter(
            "specdec_verify_rebuilds",
            "Times a request's verify session was rebuilt from its committed log on a replica.",
        )
        # the name predates "request store"; dashboards and alerts query it, so it stays
        self.store_errors = counter(
            "specdec_session_store_errors",
            "Request store (Redis) operations that failed or were skipped while it was down.",
            ("operation",),
        )
        self.k_by_load = Histogram(
            "specdec_num_speculative_tokens_by_load",
            "K asked per round (0 = plain decode), by the number of sequences "
            "in the verify step that served the round (label batch_size: 1, 2-4, 5-8, 9-16, 17-32, 33+).",
            ["batch_size"],
            buckets=K_BUCKETS,
            registry=self.registry,
        )
        self.round_coordination_time = histogram(
            "specdec_round_coordination_time_seconds", "A round's wall time less draft and verify time.", ROUND_BUCKETS
        )

    def track_placements(self, placements: Mapping[Any, Placements]) -> None:
        """Exports each replica's placements and last load (:class:`_Placements`)."""
        self.registry.register(_Placements(placements))

    def observe_round(self, record: RoundRecord, num_committed: int) -> None:
        """Counts one round that streamed ``num_committed`` tokens."""
        self.num_target_forwards.labels(str(record.k)).inc()
        self.k_by_load.labels(load_band(record.batch_size)).observe(record.k)
        self.generation_tokens.inc(num_committed)
        if record.num_drafted:
            self.num_drafts.labels(record.drafter).inc()
            self.num_draft_tokens.labels(record.drafter).inc(record.num_drafted)
            self.num_accepted_tokens.labels(record.drafter).inc(record.num_accepted)
            if record.num_forced:
                self.num_forced_draft_tokens.labels(record.drafter).inc(record.num_forced)
            # a position drafted but never accepted still exports its accepted series (at 0): the
            # per-position curve then shows 0 there instead of leaving the point out
            for position in range(record.num_drafted):
                labels = (record.drafter, str(position))
                self.num_draft_tokens_per_pos.labels(*labels).inc()
                self.num_accepted_tokens_per_pos.labels(*labels).inc(position < record.num_accepted)
        if record.draft_ahead:
            self.draft_ahead.labels(record.draft_ahead).inc()
        if record.draft_ahead_branch:
            self.draft_ahead_branch_hits.labels(record.draft_ahead_branch).inc()
        self.draft_ahead_branches.inc(record.draft_ahead_branches)
        self.decoded_ahead.inc(record.decoded_ahead)
        self.round_draft_time.observe(record.draft_ms / 1000)
        self.round_verify_time.observe(record.verify_ms / 1000)
        self.round_coordination_time.observe(record.coordination_ms / 1000)

    def observe_faults(self, draft_failures: int, verify_rebuilds: int) -> None:
        """Counts a request's draft service failures and verify session rebuilds."""
        self.draft_failures.inc(draft_failures)
        self.verify_rebuilds.inc(verify_rebuilds)

    def observe_request(self, metrics: coordinator_pb2.RequestMetrics) -> None:
        """Records a finished request's latencies and prompt tokens."""
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.time_to_first_token.observe(metrics.time_to_first_token_ms / 1000)
        self.e2e_request_latency.observe(metrics.total_time_ms / 1000)
        self.request_prefill_time.observe(metrics.prefill_time_ms / 1000)
        if metrics.num_generated_tokens > 1:
            after_first_ms = metrics.total_time_ms - metrics.time_to_first_token_ms
            self.time_per_output_token.observe(after_first_ms / (metrics.num_generated_tokens - 1) / 1000)

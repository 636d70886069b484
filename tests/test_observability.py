"""Observability of a real multi-service run: the coordinator, draft and verify services as
separate processes on free ports (the tiny models), and the CLI client, all tracing over OTLP to a
test endpoint built from opentelemetry-proto's own TraceService definition; each service's
Prometheus /metrics scraped and parsed with prometheus-client's parser; the coordinator's JSON
logs. One request: one trace across the four processes whose round spans add up to the request's
metrics, and counters equal to them."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.client import generate
from specdec.observability import telemetry
from specdec.observability.telemetry import configure_tracing, current_span, exporter_names
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specdec_app.launcher import LocalCluster, free_port

pytestmark = pytest.mark.multiprocess

PROMPT = "Tell me a story about a cat."
MAX_NEW, K = 32, 4
SERVICES = ("coordinator", "draft", "verify")
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


def any_value(value):
    """The Python value of an OTLP AnyValue (arrays as lists)."""
    kind = value.WhichOneof("value")
    return [any_value(v) for v in value.array_value.values] if kind == "array_value" else getattr(value, kind)


@dataclass
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def attributes(self) -> dict:
        return {kv.key: any_value(kv.value) for kv in self.span.attributes}


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it is sent, with its service.name."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(ReceivedSpan(resource["service.name"], span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace_of(self, service: str) -> list[ReceivedSpan]:
        """Every span in the trace of ``service``'s (first) span."""
        with self.lock:
            trace_id = next(s.span.trace_id for s in self.spans if s.service == service)
            return [s for s in self.spans if s.span.trace_id == trace_id]


@dataclass
class TracedRun:
    receiver: SpanReceiver
    cluster: LocalCluster
    result: dict  # the CLI's --json object
    log_dir: object


def otel_env(endpoint_port: int) -> dict:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{endpoint_port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms between batch exports
    }


@pytest.fixture(scope="module")
def traced_run(tiny_models, tmp_path_factory):
    receiver = SpanReceiver()
    endpoint = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, endpoint)
    endpoint_port = endpoint.add_insecure_port("127.0.0.1:0")
    endpoint.start()
    log_dir = tmp_path_factory.mktemp("observability-logs")
    cluster = LocalCluster(
        free_port(), free_port(), free_port(), log_dir=log_dir, metrics_ports={s: free_port() for s in SERVICES}
    )
    cluster.extra_args = {
        "verify": ["--model", str(tiny_models.target_dir), "--num-threads", "1"],
        "draft": [
            "--drafters",
            "transformers,ngram",
            "--default-drafter",
            "transformers",
            "--transformers-model",
            str(tiny_models.draft_dir),
            "--num-threads",
            "1",
        ],
        "coordinator": ["--tokenizer", str(tiny_models.target_dir), "--log-format", "json", "--log-level", "DEBUG"],
    }
    env = otel_env(endpoint_port)
    try:
        with pytest.MonkeyPatch.context() as patch:  # the cluster's processes inherit the environment
            for name, value in env.items():
                patch.setenv(name, value)
            cluster.start_all(timeout_s=180)
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec",
                "generate",
                PROMPT,
                "--coordinator",
                cluster.address("coordinator"),
                "--max-new-tokens",
                str(MAX_NEW),
                "-k",
                str(K),
                "--drafter",
                "transformers",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env={**os.environ, **env},
        )
        result = json.loads(cli.stdout.strip().splitlines()[-1])
        yield TracedRun(receiver, cluster, result, log_dir)
    finally:
        cluster.stop()
        endpoint.stop(0)


def complete_trace(run: TracedRun) -> list[ReceivedSpan]:
    """The CLI's trace, once it is whole: every round span, both services' Release (which runs
    after the stream ends), and the parent of every span but the root."""
    rounds = run.result["metrics"]["num_target_forwards"]
    deadline = time.monotonic() + 30
    while True:
        spans = (
            run.receiver.trace_of("specdec-cli") if any(s.service == "specdec-cli" for s in run.receiver.spans) else []
        )
        ids = {s.span.span_id for s in spans}
        orphans = [s.span.name for s in spans if s.span.parent_span_id and s.span.parent_span_id not in ids]
        released = {s.service for s in spans if s.span.kind == SERVER and s.span.name.endswith("/Release")}
        if (
            sum(s.span.name == "round" for s in spans) == rounds
            and not orphans
            and released == {"specdec-draft", "specdec-verify"}
        ):
            return spans
        assert time.monotonic() < deadline, (
            f"incomplete trace after 30 s: {len(spans)} spans, parents missing for {orphans}"
        )
        time.sleep(0.2)


def test_one_trace_spans_all_services_with_parent_links(traced_run):
    spans = complete_trace(traced_run)
    by_id = {s.span.span_id: s for s in spans}
    assert {s.service for s in spans} == {"specdec-cli", "specdec-coordinator", "specdec-draft", "specdec-verify"}
    (root,) = [s for s in spans if not s.span.parent_span_id]
    assert root.service == "specdec-cli" and root.span.kind == CLIENT
    assert all(s.span.parent_span_id in by_id for s in spans if s is not root), "a span's parent is not in the trace"

    def parent(s: ReceivedSpan) -> ReceivedSpan:
        return by_id[s.span.parent_span_id]

    (request,) = [s for s in spans if s.service == "specdec-coordinator" and s.span.kind == SERVER]
    assert request.span.name.endswith("CoordinatorService/Generate") and parent(request) is root
    rounds = [s for s in spans if s.span.name == "round"]
    assert all(parent(r) is request for r in rounds)
    # the draft's proposals and the verify service's verifications: server spans in their own
    # processes, under the coordinator's client span in a round span
    for service, method in (("specdec-draft", "Propose"), ("specdec-verify", "Verify")):
        calls = [s for s in spans if s.service == service and s.span.kind == SERVER and s.span.name.endswith(method)]
        assert calls, f"no {method} span"
        for call in calls:
            client = parent(call)
            assert (
                client.service == "specdec-coordinator"
                and client.span.kind == CLIENT
                and parent(client).span.name == "round"
            )
    # inside them: prefill, model forward, acceptance and rollback
    inside = Counter((s.service, s.span.name, parent(s).span.name.rsplit("/", 1)[-1]) for s in spans if s is not root)
    for service in ("specdec-draft", "specdec-verify"):
        assert inside[(service, "prefill", "Prefill")] == 1
    assert inside[("specdec-draft", "forward", "prefill")] == 1
    # the verify service's prefill decodes the first token in the forward of the prompt (a short
    # one: its only chunk), with its acceptance test
    assert inside[("specdec-verify", "forward", "prefill")] == inside[("specdec-verify", "acceptance", "prefill")] == 1
    proposals = sum(s.service == "specdec-draft" and s.span.name.endswith("/Propose") for s in spans)
    assert inside[("specdec-draft", "forward", "Propose")] >= proposals > 0
    assert inside[("specdec-verify", "acceptance", "Verify")] + inside[
        ("specdec-verify", "acceptance", "Decode")
    ] == len(rounds)
    assert inside[("specdec-verify", "forward", "Verify")] + inside[("specdec-verify", "forward", "Decode")] == len(
        rounds
    )
    # the verify service rolls back exactly the rejected draft tokens, once per round with a rejection
    metrics = traced_run.result["metrics"]
    rollbacks = [s.attributes for s in spans if s.span.name == "rollback" and parent(s).span.name.endswith("/Verify")]
    assert (
        sum(r["specdec.num_dropped"] for r in rollbacks)
        == metrics["num_draft_tokens"] - metrics["num_accepted_draft_tokens"]
        > 0
    )
    rejected = sum(
        r.attributes["specdec.round.num_accepted"] < r.attributes["specdec.round.num_drafted"] for r in rounds
    )
    assert len(rollbacks) == rejected


def test_round_attributes_add_up_to_the_request_metrics(traced_run, tiny_pipeline):
    metrics = traced_run.result["metrics"]
    spans = complete_trace(traced_run)
    rounds = [s.attributes for s in spans if s.span.name == "round"]
    assert len(rounds) == metrics["num_target_forwards"]
    assert sum(r["specdec.round.num_drafted"] > 0 for r in rounds) == metrics["num_spec_steps"]
    assert sum(r["specdec.round.num_drafted"] for r in rounds) == metrics["num_draft_tokens"]
    assert sum(r["specdec.round.num_accepted"] for r in rounds) == metrics["num_accepted_draft_tokens"]
    assert (
        sum(r["specdec.round.num_committed"] for r in rounds) + 1  # the first token: the target's prefill
        == metrics["num_generated_tokens"]
        == len(traced_run.result["token_ids"])
    )
    assert sum(r["specdec.round.draft_ms"] for r in rounds) == pytest.approx(metrics["draft_time_ms"])
    assert sum(r["specdec.round.verify_ms"] for r in rounds) == pytest.approx(metrics["verify_time_ms"])
    k_counts = Counter(r["specdec.round.k"] for r in rounds)
    assert [k_counts[k] for k in range(len(metrics["rounds_per_k"]))] == metrics["rounds_per_k"]
    assert all(r["specdec.round.fallback"] == (r["specdec.round.k"] == 0) for r in rounds)
    assert {r["specdec.round.drafter"] for r in rounds if r["specdec.round.k"]} == {"transformers"}
    ahead = Counter(r["specdec.round.draft_ahead"] for r in rounds)
    assert ahead["hit"] == metrics.get("num_draft_ahead_hits", 0)
    assert ahead["hit"] + ahead["miss"] == metrics["num_draft_ahead_proposals"] > 0
    assert sum(r["specdec.round.decoded_ahead"] for r in rounds) == metrics.get("num_rounds_decoded_ahead", 0)
    # the verify service's own acceptance spans agree with the coordinator's count
    acceptance = [s.attributes for s in spans if s.span.name == "acceptance"]
    assert sum(a["specdec.num_accepted"] for a in acceptance) == metrics["num_accepted_draft_tokens"]
    # the request span carries the request's metrics
    (request,) = [s.attributes for s in spans if s.service == "specdec-coordinator" and s.span.kind == SERVER]
    for name in (
        "num_spec_steps",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
        "num_generated_tokens",
        "num_target_forwards",
        "acceptance_histogram",
        "rounds_per_k",
        "draft_acceptance_rate",
        "tokens_per_second",
    ):
        assert request[f"specdec.request.{name}"] == pytest.approx(metrics[name]), name
    assert request["specdec.request.drafter"] == "transformers"
    assert (
        request["specdec.request.drafter_usage.transformers.num_rounds"]
        == metrics["drafter_usage"]["transformers"]["num_rounds"]
    )
    # tracing does not change the tokens: the same request through the untraced in-process pipeline
    untraced = generate(
        tiny_pipeline.address,
        coordinator_pb2.GenerateRequest(
            text=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=K, drafter="transformers"
        ),
        timeout_s=120,
    )
    assert untraced.token_ids == traced_run.result["token_ids"]


def test_json_logs_carry_the_trace_id(traced_run):
    spans = complete_trace(traced_run)
    trace_id = spans[0].span.trace_id.hex()
    lines = (traced_run.log_dir / "coordinator.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    rounds = [r for r in records if "round:" in r["message"]]
    assert len(rounds) == traced_run.result["metrics"]["num_target_forwards"]
    assert {r["trace_id"] for r in rounds} == {trace_id}
    assert all(r["service"] == "coordinator" and r["level"] == "DEBUG" and r["span_id"] != "0" for r in rounds)


def scrape(url: str) -> dict:
    """{(sample name, sorted label items): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_until(url: str, name: str, expected: float, timeout_s: float = 10.0) -> dict:
    """Scrapes until the unlabelled sample ``name`` equals ``expected`` (sessions are released in
    the background); returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if samples.get((name, ())) == expected or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_coordinator_counters_equal_the_request_metrics(traced_run):
    m = traced_run.result["metrics"]
    samples = scrape_until(traced_run.cluster.metrics_url("coordinator"), "specdec_num_requests_running", 0)
    drafter = (("drafter", "transformers"),)

    def value(name: str, labels=()) -> float:
        return samples.get((name, tuple(sorted(labels))), 0.0)

    assert value("specdec_spec_decode_num_drafts_total", drafter) == m["num_spec_steps"]
    assert value("specdec_spec_decode_num_draft_tokens_total", drafter) == m["num_draft_tokens"]
    assert value("specdec_spec_decode_num_accepted_tokens_total", drafter) == m["num_accepted_draft_tokens"]
    histogram = m["acceptance_histogram"]
    for position in range(K):
        labels = (*drafter, ("position", str(position)))
        assert value("specdec_spec_decode_num_accepted_tokens_per_pos_total", labels) == sum(histogram[position + 1 :])
    assert (
        sum(
            value("specdec_spec_decode_num_draft_tokens_per_pos_total", (*drafter, ("position", str(p))))
            for p in range(K)
        )
        == m["num_draft_tokens"]
    )
    for k, rounds in enumerate(m["rounds_per_k"]):
        assert value("specdec_num_target_forwards_total", (("k", str(k)),)) == rounds
    assert value("specdec_generation_tokens_total") == m["num_generated_tokens"]
    assert value("specdec_prompt_tokens_total") == m["num_prompt_tokens"]
    assert value("specdec_num_requests_running") == 0
    for name, ms in (
        ("time_to_first_token", "time_to_first_token_ms"),
        ("e2e_request_latency", "total_time_ms"),
        ("request_prefill_time", "prefill_time_ms"),
    ):
        assert value(f"specdec_{name}_seconds_count") == 1
        assert value(f"specdec_{name}_seconds_sum") == pytest.approx(m[ms] / 1000)
    for part in ("draft", "verify"):
        assert value(f"specdec_round_{part}_time_seconds_count") == m["num_target_forwards"]
        assert value(f"specdec_round_{part}_time_seconds_sum") == pytest.approx(m[f"{part}_time_ms"] / 1000)
    assert value("specdec_round_coordination_time_seconds_sum") == pytest.approx(m["coordination_time_ms"] / 1000)
    proposals, hits = m.get("num_draft_ahead_proposals", 0), m.get("num_draft_ahead_hits", 0)
    assert proposals > 0  # the transformers drafter drafts ahead
    assert value("specdec_draft_ahead_proposals_total", (("outcome", "hit"),)) == hits
    assert value("specdec_draft_ahead_proposals_total", (("outcome", "miss"),)) == proposals - hits
    assert value("specdec_decoded_ahead_rounds_total") == m.get("num_rounds_decoded_ahead", 0)


def test_session_gauges_kv_bytes_and_errors(traced_run):
    """Sessions and their KV bytes, read at scrape time; failed RPCs counted by status code."""
    # tiny Llama: 2 layers x (key + value) x 2 KV heads x 16 head size x 4 bytes (float32) per cached token
    per_token, prompt = 2 * 2 * 2 * 16 * 4, list(range(10, 20))
    cluster = traced_run.cluster
    services = {
        "verify": (
            verify_pb2_grpc.VerifyServiceStub,
            verify_pb2.VerifyServicePrefillRequest(session_id="kv", token_ids=prompt),
            verify_pb2.VerifyServiceReleaseRequest(session_id="kv"),
        ),
        "draft": (
            draft_pb2_grpc.DraftServiceStub,
            draft_pb2.DraftServicePrefillRequest(session_id="kv", drafter="transformers", token_ids=prompt),
            draft_pb2.DraftServiceReleaseRequest(session_id="kv"),
        ),
    }
    for service, (stub_cls, prefill, release) in services.items():
        url = cluster.metrics_url(service)
        with grpc.insecure_channel(cluster.address(service), options=GRPC_OPTIONS) as channel:
            stub = stub_cls(channel)
            assert scrape_until(url, "specdec_num_sessions", 0)[("specdec_kv_cache_bytes", ())] == 0
            stub.Prefill(prefill, timeout=30)
            samples = scrape(url)
            assert samples[("specdec_num_sessions", ())] == 1
            assert samples[("specdec_kv_cache_bytes", ())] == per_token * (len(prompt) - 1)  # all but the last token
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(prefill, timeout=30)  # the session exists
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            stub.Release(release, timeout=30)
            samples = scrape(url)
            assert samples[("specdec_num_sessions", ())] == 0 and samples[("specdec_kv_cache_bytes", ())] == 0
            assert samples[("specdec_rpc_errors_total", (("code", "ALREADY_EXISTS"), ("method", "Prefill")))] == 1
    with grpc.insecure_channel(cluster.address("coordinator"), options=GRPC_OPTIONS) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=0), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    samples = scrape(cluster.metrics_url("coordinator"))
    assert samples[("specdec_rpc_errors_total", (("code", "INVALID_ARGUMENT"), ("method", "Generate")))] == 1


def test_tracing_is_off_unless_an_exporter_is_named(monkeypatch):
    monkeypatch.setattr(telemetry, "_tracing", None)  # restored after the test
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert configure_tracing("verify") is False
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing("verify") is False
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " otlp, console ")
    assert exporter_names() == ["otlp", "console"]
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing("verify") is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_a_span_with_tracing_off_leaves_the_current_context_alone():
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # no provider in this process
    outer = trace.NonRecordingSpan(trace.SpanContext(1, 2, is_remote=False))
    with trace.use_span(outer), current_span(trace.get_tracer(__name__), "round") as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()
        assert trace.get_current_span() is outer


def test_a_process_configured_without_tracing_does_not_ask_for_a_provider_per_span(monkeypatch):
    monkeypatch.setattr(telemetry, "_tracing", None)  # restored after the test
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert configure_tracing("coordinator") is False
    tracer = trace.get_tracer(__name__)

    def asked():
        raise AssertionError("get_tracer_provider called per span")

    monkeypatch.setattr(trace, "get_tracer_provider", asked)
    with current_span(tracer, "round") as span:
        assert span is trace.INVALID_SPAN


def test_an_exporter_that_is_not_installed_is_an_error(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin_json")
    with pytest.raises(ValueError, match=r"'zipkin_json', which is not installed; installed: .*console"):
        configure_tracing("verify")
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)

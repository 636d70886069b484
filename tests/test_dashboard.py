"""deploy/grafana/specdec-dashboard.json: it loads, its panels are well formed, and every query,
parsed with promql-parser, names only metrics the services export; those names read the same in
both exposition formats a scraper may negotiate. tests/test_prometheus.py runs every query on a
real Prometheus."""

import json
from pathlib import Path

import promql_parser
from prometheus_client import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from coordinator.observability.prometheus import CoordinatorMetrics
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.sessions import SessionRegistry

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/specdec-dashboard.json"
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__range": "1h"}  # Grafana fills these in before querying
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def service_metrics() -> list[ServiceMetrics]:
    """The coordinator's metrics (its per-replica placement metrics included) and a session
    service's (draft, verify)."""
    coordinator = CoordinatorMetrics()
    coordinator.track_placements({})
    session_service = ServiceMetrics()
    session_service.track_sessions(SessionRegistry(1, 60.0))
    session_service.engine_metrics("verify", lambda: 0)
    return [coordinator, session_service]


def exported_sample_names() -> set[str]:
    """Every sample name the coordinator and a session service (draft, verify) expose."""
    return {
        family.name + suffix
        for metrics in service_metrics()
        for family in metrics.registry.collect()
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def metric_names(expr: str) -> set[str]:
    """Names of the vector selectors in a PromQL expression."""
    names = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found.extend((inner["title"], target["expr"]) for target in inner.get("targets", []))
    return found


def test_dashboard_loads_and_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]


def test_names_read_the_same_in_every_exposition_format():
    """Prometheus asks for OpenMetrics, where prometheus-client escapes characters it leaves in the
    text format (a colon becomes an underscore): the dashboard's names must survive both."""
    for metrics in service_metrics():
        text = generate_latest(metrics.registry).decode()
        om = openmetrics.generate_latest(metrics.registry).decode()
        text_names = {sample.name for family in parse_text(text) for sample in family.samples}
        om_names = {sample.name for family in parse_openmetrics(om) for sample in family.samples}
        assert text_names == om_names, f"differ by format: {sorted(text_names ^ om_names)}"


def test_every_query_names_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_sample_names()
    used = set()
    for title, expr in queries(dashboard):
        for variable, value in GRAFANA_RANGES.items():
            expr = expr.replace(variable, value)
        names = metric_names(expr)
        assert names, f"{title}: {expr} names no metric"
        assert names <= exported, f"{title}: {sorted(names - exported)} are not exported"
        used |= names
    # the dashboard's panels: throughput, speedup proxy, acceptance and its per-position curve,
    # latency percentiles, fallback share, sessions, KV memory, errors, faults, load and batching
    for name in (
        "specdec_generation_tokens_total",
        "specdec_num_target_forwards_total",
        "specdec_spec_decode_num_accepted_tokens_per_pos_total",
        "specdec_time_to_first_token_seconds_bucket",
        "specdec_time_per_output_token_seconds_bucket",
        "specdec_num_sessions",
        "specdec_kv_cache_bytes",
        "specdec_rpc_errors_total",
        "specdec_draft_failures_total",
        "specdec_verify_rebuilds_total",
        "specdec_session_store_errors_total",
        "specdec_batch_size_sum",
        "specdec_num_batched_tokens_sum",
        "specdec_queue_time_seconds_bucket",
        "specdec_num_speculative_tokens_by_load_sum",
        # each draft and verify replica: placements, prefix-cache hits at placement, waiting calls,
        # sessions, KV usage per pod, and the coordinators' queue (what the autoscaling triggers read)
        "specdec_placements_total",
        "specdec_placement_cached_tokens_total",
        "specdec_replica_num_calls_waiting",
        "specdec_replica_num_sessions",
        "specdec_num_calls_waiting",
        "specdec_kv_cache_usage_perc",
        "specdec_num_requests_waiting",
        "specdec_request_queue_time_seconds_count",
    ):
        assert name in used, f"no panel shows {name}"

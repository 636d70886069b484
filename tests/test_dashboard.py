"""deploy/grafana/specdec-dashboard.json: it loads, its panels are well formed, and every query,
parsed with promql-parser, names only metrics the services export."""

import json
from pathlib import Path

import promql_parser

from coordinator.prometheus import CoordinatorMetrics
from specdec.prom import ServiceMetrics
from specdec.sessions import SessionRegistry

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/specdec-dashboard.json"
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__range": "1h"}  # Grafana fills these in before querying
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_sample_names() -> set[str]:
    """Every sample name the coordinator and a session service (draft, verify) expose."""
    session_service = ServiceMetrics()
    session_service.track_sessions(SessionRegistry(1, 60.0))
    session_service.engine_metrics("verify")
    return {
        family.name + suffix
        for metrics in (CoordinatorMetrics(), session_service)
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
    # the panels: throughput, speedup proxy, acceptance and its per-position curve,
    # latency percentiles, fallback share, sessions, KV memory, errors, faults, load and batching
    for name in (
        "specdec:generation_tokens_total",
        "specdec:num_target_forwards_total",
        "specdec:spec_decode_num_accepted_tokens_per_pos_total",
        "specdec:time_to_first_token_seconds_bucket",
        "specdec:time_per_output_token_seconds_bucket",
        "specdec:num_sessions",
        "specdec:kv_cache_bytes",
        "specdec:rpc_errors_total",
        "specdec:draft_failures_total",
        "specdec:verify_rebuilds_total",
        "specdec:session_store_errors_total",
        "specdec:batch_size_sum",
        "specdec:num_batched_tokens_sum",
        "specdec:queue_time_seconds_bucket",
        "specdec:num_speculative_tokens_by_load_sum",
    ):
        assert name in used, f"no panel shows {name}"

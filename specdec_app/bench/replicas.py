"""``specdec bench replicas``: the services as replicas, measured against the mode's targets.

Every service is a process of its own on a loopback address of its own (verify replicas on
127.0.0.2-4, draft replicas on 127.0.0.5-6, coordinators on 127.0.0.7-8: separate hosts on one
machine), the coordinators given the replicas' ``IP:port`` lists (``--verify-addresses``,
``--draft-addresses``; no DNS name but in the spread scenario: discovery is not what the others
measure). Four scenarios, one run each, each on a fleet of its own, each reporting its targets met
or missed:

1. **spread** (near-free model, self-drafted): 3 verify replicas behind one DNS name (served by
   :class:`specdec_app.bench.dns_server.DnsServer`, as a Kubernetes headless Service resolves
   them), 2 draft replicas, 2 coordinators; ``spread_bursts`` consecutive bursts of 48 requests
   (24 to each coordinator, each burst its own prompts), K = 4, 160 new tokens: per burst each
   replica's sessions (``RequestMetrics.verify_replicas[0]``, ``draft_replicas[0]``) and share of
   its service's CPU time, and the largest deviation from an even share of the CPU in the worst
   burst (target: at most 25%, for the verify and for the draft replicas).
2. **prefix-affinity** (SmolLM2, verify replicas on one thread each, K = 0): 3 verify replicas, 1
   coordinator; 4 system prompts of about 600 tokens x 12 questions, client c sending system
   prompt c's requests one after the other; run with ``--placement prefix-load``, then
   ``round-robin``, then on one replica alone, each run with system prompts of its own (the
   replicas' prefix caches keep what earlier runs prefilled): the prompt tokens found in the
   prefix caches against the single replica's (target: prefix-load at least 0.95 of it) and the
   TTFT (target: prefix-load's mean below round-robin's).
3. **load** (near-free model, K = 0): 3 verify replicas, one of them slowed by the verify
   service's test hook (``--debug-rpc-delay-ms Verify=d,Decode=d``), 1 coordinator; 16
   closed-loop clients x 4 requests, 64 new tokens, under prefix-load then round-robin: the slowed
   replica's share of the sessions (target: at most half an even share under prefix-load) and the
   p90 request latency (target: prefix-load's at most 0.8x round-robin's).
4. **draft-pool** (near-free model, self-drafted): 1 verify and 2 draft replicas, 1 coordinator;
   the 16 prompts as a burst at K = 0 (plain decoding through the pipeline), then at K = 4 with
   the draft replica holding the most sessions SIGKILLed after 1 s: requests completed, outputs
   identical to K = 0's, and for the requests whose draft session was on the killed replica the
   time from the kill to their first message of more than one token, i.e. speculating again on
   the other replica (target: within 1 s).

Before each measured run of the prefix-affinity, load and draft-pool scenarios its coordinator
serves an unmeasured warm-up burst (two short requests per replica), as the other modes warm up:
its first requests would otherwise pay for connecting to every replica and for the services' first
steps, and the load scenario's first placements would not know the slowed replica's round trip;
the spread scenario's burst meets a fresh fleet (a warm-up leaves each coordinator round trips
measured at different loads, which its placement then weighs the burst by). Prompts are Spec-Bench's
(``--questions``), categories interleaved, each scenario its own slice; the prefix-affinity
scenario takes its questions from the short categories (:data:`AFFINITY_CATEGORIES`) so that the
system prompt is most of each prompt, as in a chat deployment.
"""

import operator
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from coordinator.api.client import FINISH_REASONS, stream
from specdec.rpc.server import GRPC_OPTIONS
from specdec.timing import ms_since
from specdec.v1 import coordinator_pb2, draft_pb2, draft_pb2_grpc
from specdec_app.bench.ceiling import near_free_model
from specdec_app.bench.concurrency import interleave_categories
from specdec_app.bench.conversation import SYSTEM_PROMPT, read_system_prompt
from specdec_app.bench.cpu_time import CpuClock
from specdec_app.bench.dns_server import DnsServer
from specdec_app.bench.questions import Question, generate_request, load_questions
from specdec_app.bench.report import _cell, _table, machine_line, percentile, write_json
from specdec_app.bench.run import machine_info
from specdec_app.launcher import (
    LocalCluster,
    ServiceProcess,
    configured_api_key,
    free_port,
    service_env,
    start_all,
    stop_all,
)

SPREAD, AFFINITY, LOAD, POOL = "spread", "prefix-affinity", "load", "draft-pool"
SCENARIOS = (SPREAD, AFFINITY, LOAD, POOL)
REPORT_FILES = ("report-replicas.json", "report-replicas.md")
VERIFY_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
DRAFT_HOSTS = ("127.0.0.5", "127.0.0.6")
COORDINATOR_HOSTS = ("127.0.0.7", "127.0.0.8")
PREFIX_LOAD, ROUND_ROBIN, SINGLE = "prefix-load", "round-robin", "single replica"
AFFINITY_CATEGORIES = ("qa", "translation", "math_reasoning")
WARM_UP_TOKENS = 8
REQUEST_TIMEOUT_S = 600.0
START_TIMEOUT_S = 600.0
# the mode's targets
SPREAD_MAX_DEVIATION = 0.25  # every replica's share of its service's CPU within 25% of an even share
VERIFY_NAME = "verify.specdec.bench"  # the spread scenario's verify replicas, behind one DNS name
AFFINITY_MIN_HIT_RATIO = 0.95  # prefix-load's cached prompt tokens / one replica's
SLOWED_MAX_SHARE_OF_EVEN = 0.5  # the slowed replica's share of sessions / an even share, prefix-load
LOAD_MAX_P90_RATIO = 0.8  # prefix-load's p90 latency / round-robin's
RESUME_MAX_MS = 1000.0  # from the kill to speculating again on the other draft replica


@dataclass
class ReplicasConfig:
    """What ``specdec bench replicas`` runs: the scenarios (:data:`SCENARIOS`) with the mode's
    sizes (fields, so that a quick look can shrink them); ``slow_delay_ms`` is the load scenario's
    hook delay of each Verify and Decode call of the slowed replica, chosen to make its calls
    several times slower than the others' (the report gives both per-token times)."""

    questions: Path
    out: Path
    command: str = ""
    scenarios: tuple[str, ...] = SCENARIOS
    system_prompt: Path = SYSTEM_PROMPT
    affinity_target: str = "smollm2"
    k: int = 4
    spread_requests: int = 48
    spread_bursts: int = 5
    spread_max_new_tokens: int = 160
    affinity_clients: int = 4
    affinity_questions: int = 12
    affinity_max_new_tokens: int = 8
    load_clients: int = 16
    load_requests_per_client: int = 4
    load_max_new_tokens: int = 64
    slow_delay_ms: int = 50
    pool_requests: int = 16
    pool_max_new_tokens: int = 256
    kill_after_s: float = 1.0


# ---- the fleet ----


class Fleet:
    """A scenario's services, by name, each a :class:`ServiceProcess` logging to
    ``<log_dir>/<name>.log``; with ``--insecure`` where a service started here needs it
    (:attr:`LocalCluster.insecure`). A context manager: every process is stopped on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.processes: dict[str, ServiceProcess] = {}
        self._insecure = LocalCluster().insecure

    def add(self, name: str, service: str, host: str, port: int, args: list[str]) -> ServiceProcess:
        security = ["--insecure"] if service in self._insecure else []
        self.processes[name] = ServiceProcess(
            service, port, host, [*args, *security], log_file=self.log_dir / f"{name}.log", env=service_env(service)
        )
        return self.processes[name]

    def start(self, names: Sequence[str] | None = None) -> None:
        """Starts ``names`` (every process not running when None) and waits until each is SERVING.
        Raises RuntimeError when one exits or is not SERVING within START_TIMEOUT_S."""
        chosen = [self.processes[n] for n in names] if names is not None else list(self.processes.values())
        chosen = [p for p in chosen if p.process is None or p.process.poll() is not None]
        start_all(chosen, START_TIMEOUT_S)

    def stop(self, names: Sequence[str]) -> None:
        stop_all([self.processes.pop(name) for name in names])

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        stop_all(self.processes.values())


def verify_replicas(fleet: Fleet, hosts: Sequence[str], model: str, extra: dict[str, list[str]] | None = None) -> str:
    """Adds a verify replica of ``model`` (one torch thread) on each of ``hosts``, all on one
    port (``extra``: more flags by host); returns the port."""
    port = free_port()
    for host in hosts:
        args = ["--model", model, "--num-threads", "1", *(extra or {}).get(host, [])]
        fleet.add(f"verify-{host}", "verify", host, port, args)
    return str(port)


def draft_replicas(fleet: Fleet, hosts: Sequence[str], model: str) -> str:
    """Adds a draft replica on each of ``hosts`` whose only drafter is ``transformers`` on
    ``model`` (the near-free model drafting for itself, so every draft passes); returns the port."""
    port = free_port()
    args = ["--drafters", "transformers", "--default-drafter", "transformers", "--transformers-model", model]
    for host in hosts:
        fleet.add(f"draft-{host}", "draft", host, port, [*args, "--num-threads", "1"])
    return str(port)


def add_coordinator(
    fleet: Fleet,
    name: str,
    host: str,
    tokenizer: str,
    verify: list[str],
    draft: list[str],
    placement: str,
    extra: Sequence[str] = (),
) -> ServiceProcess:
    """A coordinator on ``host`` (a fresh port) given the replicas' ``host:port`` lists (or DNS
    names: ``extra`` then names the nameserver); every request of the bench comes from one address,
    so the per-client stream limit is off."""
    args = ["--tokenizer", tokenizer, "--verify-addresses", ",".join(verify), "--draft-addresses", ",".join(draft)]
    args += ["--placement", placement, "--max-streams-per-client", "0", *extra]
    return fleet.add(name, "coordinator", host, free_port(), args)


def addresses(hosts: Sequence[str], port: str) -> list[str]:
    return [f"{host}:{port}" for host in hosts]


# ---- the clients ----


@dataclass
class Sent:
    """One request as its client saw it: ``start_s`` after its run began, ``ttft_ms`` and
    ``latency_ms`` (to the last message) from its start; the replicas its sessions opened on, in
    order (``RequestMetrics.verify_replicas`` and ``draft_replicas``); the prompt tokens and those
    the verify replica found in its prefix cache; ``arrivals``: each message's time.monotonic()
    and token count. ``identical`` and ``speculating_again_ms``: set by the draft-pool scenario."""

    run: str
    client: int
    question_id: int
    coordinator: str
    start_s: float = 0.0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    verify_replicas: list[str] = field(default_factory=list)
    draft_replicas: list[str] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    identical: bool | None = None
    speculating_again_ms: float | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    arrivals: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("token_ids", "arrivals")}


@dataclass(frozen=True)
class Job:
    """A request to send: to ``coordinator``, for ``question_id``."""

    coordinator: str
    request: coordinator_pb2.GenerateRequest
    question_id: int


def send(job: Job, run: str, client: int, run_start: float, api_key: str | None) -> Sent:
    """Streams ``job`` to its end; a failure is recorded in ``error``."""
    sent = Sent(run, client, job.question_id, job.coordinator, start_s=time.monotonic() - run_start)
    start = time.perf_counter()
    try:
        for response in stream(job.coordinator, job.request, REQUEST_TIMEOUT_S, api_key):
            if response.token_ids and sent.ttft_ms is None:
                sent.ttft_ms = ms_since(start)
            sent.arrivals.append((time.monotonic(), len(response.token_ids)))
            sent.token_ids.extend(response.token_ids)
            if response.finish_reason:
                _add_metrics(sent, response)
    except grpc.RpcError as err:
        sent.error = f"{err.code().name}: {err.details()}"
    sent.latency_ms = ms_since(start)
    sent.num_tokens = len(sent.token_ids)
    if sent.error is None and not sent.finish_reason:
        sent.error = "the stream ended without a finish reason"
    return sent


def _add_metrics(sent: Sent, response: coordinator_pb2.GenerateResponse) -> None:
    metrics = response.metrics
    sent.finish_reason = FINISH_REASONS.get(response.finish_reason, str(response.finish_reason))
    sent.num_prompt_tokens = metrics.num_prompt_tokens
    sent.num_cached_prompt_tokens = metrics.num_cached_prompt_tokens
    sent.verify_replicas, sent.draft_replicas = list(metrics.verify_replicas), list(metrics.draft_replicas)


def run_clients(plan: list[list[Job]], run: str, on_start: Callable[[], None] | None = None) -> list[Sent]:
    """Sends ``plan``: one client (a thread) per list, all starting together, each sending its
    jobs one after the other (a burst: one job per client). ``on_start`` runs in this thread once
    they are started (the draft-pool scenario's kill). Returns the records, client by client."""
    api_key = configured_api_key()
    start = time.monotonic()

    def client(index: int) -> list[Sent]:
        return [send(job, run, index, start, api_key) for job in plan[index]]

    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        futures = [pool.submit(client, i) for i in range(len(plan))]
        if on_start is not None:
            on_start()
        return [sent for future in futures for sent in future.result()]


def request(question: Question, max_new_tokens: int, k: int) -> coordinator_pb2.GenerateRequest:
    """The question as a greedy request at a fixed K, every token generated (no EOS)."""
    message = generate_request(question)
    message.max_new_tokens, message.num_speculative_tokens, message.ignore_eos = max_new_tokens, k, True
    message.temperature = 0.0
    return message


def burst(coordinators: Sequence[str], questions: Sequence[Question], max_new_tokens: int, k: int) -> list[list[Job]]:
    """One client per question, question i sent to coordinator i mod their number."""
    return [
        [Job(coordinators[i % len(coordinators)], request(q, max_new_tokens, k), q.question_id)]
        for i, q in enumerate(questions)
    ]


def warm_up(coordinator: str, num_requests: int, k: int) -> None:
    """An unmeasured burst of short requests (prompts that share nothing with the measured ones but
    what the chat template puts first).
    Raises RuntimeError when one fails."""
    questions = [
        Question(-1 - i, "warm-up", f"(Warm-up {i}.) Name three colours of the rainbow.") for i in range(num_requests)
    ]
    for sent in run_clients(burst([coordinator], questions, WARM_UP_TOKENS, k), "warm-up"):
        if sent.error:
            raise RuntimeError(f"a warm-up request to {coordinator} failed: {sent.error}")


# ---- arithmetic ----


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def shares(placed: Sequence[str], replicas: Sequence[str]) -> dict[str, int]:
    """Sessions per replica (every one of ``replicas``, 0 where none), from the replicas (hosts)
    ``placed`` lists, one per session; others (none: a request without a draft session) under
    their own name."""
    counts = Counter(placed)
    return {r: counts.get(r, 0) for r in replicas} | {r: n for r, n in counts.items() if r not in replicas}


OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt}


def check(name: str, value: float | None, op: str, bound: float | None, unit: str = "") -> dict:
    """A target: ``value`` against ``bound`` under ``op`` (``<=``, ``>=`` or ``<``); missed when
    either is None (not measured)."""
    met = value is not None and bound is not None and OPS[op](value, bound)
    return {"name": name, "value": value, "op": op, "bound": bound, "unit": unit, "met": met}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def latency_stats(values: list[float]) -> dict:
    """Mean, p50 and p90 (ms); None each without values."""
    return {
        "mean": statistics.fmean(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
    }


def completed(records: list[Sent]) -> list[Sent]:
    return [r for r in records if r.error is None]


# ---- scenario 1: spread ----


def spread(config: ReplicasConfig, questions: list[Question], console: Console) -> dict:
    """Scenario 1 (see the module docstring)."""
    model = str(near_free_model(console))
    dns = DnsServer()
    dns.records[VERIFY_NAME] = list(VERIFY_HOSTS)
    bursts: list[list[Sent]] = []
    cpu: list[dict[str, float | None]] = []
    try:
        with Fleet(config.out / "logs" / SPREAD) as fleet:
            verify = [f"{VERIFY_NAME}:{verify_replicas(fleet, VERIFY_HOSTS, model)}"]
            draft = addresses(DRAFT_HOSTS, draft_replicas(fleet, DRAFT_HOSTS, model))
            nameserver = ["--dns-nameservers", dns.address]
            coordinators = [
                add_coordinator(fleet, f"coordinator-{h}", h, model, verify, draft, PREFIX_LOAD, nameserver).address
                for h in COORDINATOR_HOSTS
            ]
            console.print(f"{SPREAD}: starting 3 verify, 2 draft replicas and 2 coordinators...")
            fleet.start()
            replicas = [f"verify-{h}" for h in VERIFY_HOSTS] + [f"draft-{h}" for h in DRAFT_HOSTS]
            pids = {name: fleet.processes[name].started.pid for name in replicas}
            for b in range(config.spread_bursts):
                size = config.spread_requests
                console.print(f"{SPREAD}: burst {b + 1}/{config.spread_bursts}, {size} requests, K={config.k}...")
                chosen = questions[b * config.spread_requests : (b + 1) * config.spread_requests]
                clock = CpuClock(pids)
                clock.start()
                bursts.append(run_clients(burst(coordinators, chosen, config.spread_max_new_tokens, config.k), SPREAD))
                cpu.append(clock.stop())
    finally:
        dns.stop()
    return spread_section(bursts, cpu, config)


def cpu_shares(cpu: dict[str, float | None], service: str, hosts: Sequence[str]) -> dict[str, float | None]:
    """Each of ``service``'s replicas' share of their CPU time (seconds by ``<service>-<host>``)."""
    seconds = [cpu.get(f"{service}-{h}") for h in hosts]
    known = [s for s in seconds if s is not None]
    total = sum(known)
    return {h: (s / total if s is not None and total > 0 else None) for h, s in zip(hosts, seconds, strict=True)}


def share_deviation(shares: dict[str, float | None]) -> float | None:
    """The largest deviation of a share from an even one, as a fraction of it (None: unmeasured)."""
    if not shares or any(s is None for s in shares.values()):
        return None
    even = 1 / len(shares)
    return max(abs(s - even) for s in shares.values() if s is not None) / even


def burst_figures(records: list[Sent], cpu: dict[str, float | None]) -> dict:
    """One spread burst's sessions and CPU shares per replica."""
    done = completed(records)
    verify_cpu, draft_cpu = cpu_shares(cpu, "verify", VERIFY_HOSTS), cpu_shares(cpu, "draft", DRAFT_HOSTS)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "verify_sessions": shares([host_of(r.verify_replicas[0]) for r in done if r.verify_replicas], VERIFY_HOSTS),
        "draft_sessions": shares(
            [host_of(r.draft_replicas[0]) if r.draft_replicas else "none" for r in done], DRAFT_HOSTS
        ),
        "verify_prompt_tokens": {
            h: sum(r.num_prompt_tokens for r in done if r.verify_replicas and host_of(r.verify_replicas[0]) == h)
            for h in VERIFY_HOSTS
        },
        "verify_cpu_shares": verify_cpu,
        "draft_cpu_shares": draft_cpu,
        "verify_cpu_deviation": share_deviation(verify_cpu),
        "draft_cpu_deviation": share_deviation(draft_cpu),
    }


def worst(values: list[float | None]) -> float | None:
    """The largest of ``values``; None when any is unmeasured."""
    return None if not values or any(v is None for v in values) else max(v for v in values if v is not None)


def spread_section(bursts: list[list[Sent]], cpu: list[dict[str, float | None]], config: ReplicasConfig) -> dict:
    """The spread scenario's figures and targets from each burst's records and its replicas' CPU
    seconds (by ``<service>-<host>``)."""
    per_burst = [burst_figures(records, seconds) for records, seconds in zip(bursts, cpu, strict=True)]
    records = [r for records in bursts for r in records]
    done = completed(records)
    figures: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "bursts": per_burst,
        "verify_cpu_worst_deviation": worst([b["verify_cpu_deviation"] for b in per_burst]),
        "draft_cpu_worst_deviation": worst([b["draft_cpu_deviation"] for b in per_burst]),
        "latency_ms": latency_stats([r.latency_ms for r in done]),
    }
    targets = [
        check(
            "verify replicas: largest deviation from an even share of the CPU, worst burst",
            figures["verify_cpu_worst_deviation"],
            "<=",
            SPREAD_MAX_DEVIATION,
            "%",
        ),
        check(
            "draft replicas: largest deviation from an even share of the CPU, worst burst",
            figures["draft_cpu_worst_deviation"],
            "<=",
            SPREAD_MAX_DEVIATION,
            "%",
        ),
        check("requests completed", len(done), ">=", len(records)),
    ]
    setup = (
        f"near-free model, self-drafted (transformers drafter on the same folder); 3 verify replicas "
        f"({', '.join(VERIFY_HOSTS)}) behind the DNS name {VERIFY_NAME}, 2 draft replicas ({', '.join(DRAFT_HOSTS)}), "
        f"2 coordinators ({', '.join(COORDINATOR_HOSTS)}), --placement prefix-load; {len(bursts)} consecutive "
        f"bursts of {config.spread_requests} requests sent at once, alternating over the coordinators, K={config.k}, "
        f"{config.spread_max_new_tokens} new tokens (ignore_eos), distinct Spec-Bench prompts"
    )
    return {"setup": setup, "figures": figures, "targets": targets, "records": [r.to_json() for r in records]}


# ---- scenario 2: prefix affinity ----


def system_prompts(text: str, first: int, count: int) -> list[str]:
    """``count`` system prompts of ``text``'s length, each opening with a number of its own
    (``first``, ``first + 1``, ...), so that no two share a block of tokens."""
    return [f"This is assistant profile {first + i}. {text}" for i in range(count)]


def affinity_plan(
    coordinator: str, systems: list[str], questions: list[Question], max_new_tokens: int
) -> list[list[Job]]:
    """Client c sends system prompt c's requests, one per question, one after the other."""
    return [
        [
            Job(coordinator, request(replace(q, messages=(("system", system),)), max_new_tokens, 0), q.question_id)
            for q in questions
        ]
        for system in systems
    ]


AFFINITY_RUNS = ((PREFIX_LOAD, PREFIX_LOAD), (ROUND_ROBIN, ROUND_ROBIN), (SINGLE, PREFIX_LOAD))  # (run, --placement)


def affinity(config: ReplicasConfig, questions: list[Question], console: Console) -> dict:
    """Scenario 2 (see the module docstring): one coordinator per run, started afresh."""
    text = read_system_prompt(config.system_prompt)
    runs: dict[str, list[Sent]] = {}
    with Fleet(config.out / "logs" / AFFINITY) as fleet:
        verify = addresses(VERIFY_HOSTS, verify_replicas(fleet, VERIFY_HOSTS, config.affinity_target))
        console.print(f"{AFFINITY}: starting 3 verify replicas of {config.affinity_target} (one thread each)...")
        fleet.start()
        for i, (run, placement) in enumerate(AFFINITY_RUNS):
            replicas = verify[:1] if run == SINGLE else verify
            name = f"coordinator-{placement}" if run != SINGLE else "coordinator-single"
            coordinator = add_coordinator(
                fleet, name, COORDINATOR_HOSTS[0], config.affinity_target, replicas, [unused_draft()], placement
            )
            fleet.start([name])
            warm_up(coordinator.address, 2 * len(replicas), 0)
            systems = system_prompts(text, 1 + i * config.affinity_clients, config.affinity_clients)
            console.print(f"{AFFINITY}: {run}, {len(systems)} clients x {len(questions)} requests...")
            runs[run] = run_clients(
                affinity_plan(coordinator.address, systems, questions, config.affinity_max_new_tokens), run
            )
            fleet.stop([name])
    return affinity_section(runs, config, text)


def unused_draft() -> str:
    """A draft address where nothing listens, for a coordinator whose requests (K = 0) never
    use the draft."""
    return f"{DRAFT_HOSTS[0]}:{free_port()}"


def affinity_section(runs: dict[str, list[Sent]], config: ReplicasConfig, system_text: str) -> dict:
    """The prefix-affinity scenario's figures per run and its targets."""
    figures = {run: affinity_figures(records) for run, records in runs.items()}
    single = figures.get(SINGLE, {}).get("cached_prompt_tokens")
    for stats in figures.values():
        stats["cached_vs_single"] = ratio(stats["cached_prompt_tokens"], single)
    prefix_load, round_robin = figures.get(PREFIX_LOAD, {}), figures.get(ROUND_ROBIN, {})
    targets = [
        check(
            "prefix-load: cached prompt tokens / the single replica's",
            prefix_load.get("cached_vs_single"),
            ">=",
            AFFINITY_MIN_HIT_RATIO,
        ),
        check(
            "prefix-load: mean TTFT (ms), below round-robin's",
            prefix_load.get("ttft_ms", {}).get("mean"),
            "<",
            round_robin.get("ttft_ms", {}).get("mean"),
            "ms",
        ),
    ]
    setup = (
        f"`{config.affinity_target}` on 3 verify replicas ({', '.join(VERIFY_HOSTS)}, --num-threads 1 each), "
        f"1 coordinator ({COORDINATOR_HOSTS[0]}) started afresh for each run; K=0, "
        f"{config.affinity_max_new_tokens} new tokens; "
        f"{config.affinity_clients} system prompts (benchmarks/conversation/system_prompt.txt, {len(system_text)} "
        'characters, each opening with "This is assistant profile <n>.", new numbers in each run) x '
        f"{len(next(iter(runs.values()), [])) // max(1, config.affinity_clients)} Spec-Bench questions "
        f"({', '.join(AFFINITY_CATEGORIES)}), client c sending system prompt c's requests one after the other; runs: "
        "--placement prefix-load, --placement round-robin, and a coordinator given the first replica alone"
    )
    records = [r.to_json() for records in runs.values() for r in records]
    return {"setup": setup, "figures": figures, "targets": targets, "records": records}


def affinity_figures(records: list[Sent]) -> dict:
    """One run's prefix-cache hits (sum of ``num_cached_prompt_tokens``), prompt tokens, TTFT
    stats and the replicas each system prompt's requests (one client's) opened on."""
    done = completed(records)
    homes: dict[int, Counter] = {}
    for r in done:
        homes.setdefault(r.client, Counter())[host_of(r.verify_replicas[0])] += 1
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_short_hits": short_hits(done),
        "cached_prompt_tokens": sum(r.num_cached_prompt_tokens for r in done),
        "prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "ttft_ms": latency_stats([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "replicas_per_system_prompt": {str(c): dict(sorted(h.items())) for c, h in sorted(homes.items())},
    }


def short_hits(records: list[Sent]) -> int:
    """Requests that found less of their prompt cached than the most another request of their
    client (the same system prompt) found: a system prompt prefilled before and evicted since,
    in part or whole, or prefilled on another replica."""
    by_client: dict[int, list[int]] = {}
    for r in records:  # each client's in the order it sent them
        by_client.setdefault(r.client, []).append(r.num_cached_prompt_tokens)
    return sum(n < max(cached) for cached in by_client.values() for n in cached[1:])


# ---- scenario 3: load ----

LOAD_RUNS = (PREFIX_LOAD, ROUND_ROBIN)


def load_plan(coordinator: str, questions: list[Question], run: str, config: ReplicasConfig) -> list[list[Job]]:
    """``load_clients`` closed-loop clients: client c's request j is question ``j * clients + c``,
    opened by the run's name (so that no run finds a prompt the other prefilled)."""
    n = config.load_clients

    def job(q: Question) -> Job:
        return Job(
            coordinator,
            request(replace(q, prompt=f"({run} run.) {q.prompt}"), config.load_max_new_tokens, 0),
            q.question_id,
        )

    return [[job(questions[j * n + c]) for j in range(config.load_requests_per_client)] for c in range(n)]


def load(config: ReplicasConfig, questions: list[Question], console: Console) -> dict:
    """Scenario 3 (see the module docstring): the last verify replica slowed."""
    model = str(near_free_model(console))
    delay = f"Verify={config.slow_delay_ms},Decode={config.slow_delay_ms}"
    runs: dict[str, list[Sent]] = {}
    with Fleet(config.out / "logs" / LOAD) as fleet:
        port = verify_replicas(fleet, VERIFY_HOSTS, model, {VERIFY_HOSTS[-1]: ["--debug-rpc-delay-ms", delay]})
        verify = addresses(VERIFY_HOSTS, port)
        console.print(f"{LOAD}: starting 3 verify replicas, {VERIFY_HOSTS[-1]} with --debug-rpc-delay-ms {delay}...")
        fleet.start()
        for placement in LOAD_RUNS:
            name = f"coordinator-{placement}"
            coordinator = add_coordinator(fleet, name, COORDINATOR_HOSTS[0], model, verify, [unused_draft()], placement)
            fleet.start([name])
            warm_up(coordinator.address, 2 * len(VERIFY_HOSTS), 0)
            console.print(
                f"{LOAD}: {placement}, {config.load_clients} closed-loop clients x {config.load_requests_per_client}..."
            )
            runs[placement] = run_clients(load_plan(coordinator.address, questions, placement, config), placement)
            fleet.stop([name])
    return load_section(runs, config)


def load_section(runs: dict[str, list[Sent]], config: ReplicasConfig) -> dict:
    """The load scenario's figures per run and its targets."""
    slowed = VERIFY_HOSTS[-1]
    figures = {run: load_figures(records, slowed) for run, records in runs.items()}
    prefix_load, round_robin = figures.get(PREFIX_LOAD, {}), figures.get(ROUND_ROBIN, {})
    even = 1 / len(VERIFY_HOSTS)
    p90 = ratio(prefix_load.get("latency_ms", {}).get("p90"), round_robin.get("latency_ms", {}).get("p90"))
    targets = [
        check(
            "prefix-load: the slowed replica's share of sessions",
            prefix_load.get("slowed_share"),
            "<=",
            SLOWED_MAX_SHARE_OF_EVEN * even,
            "%",
        ),
        check("prefix-load: p90 request latency / round-robin's", p90, "<=", LOAD_MAX_P90_RATIO, "x"),
    ]
    setup = (
        f"near-free model on 3 verify replicas ({', '.join(VERIFY_HOSTS)}), {slowed} started with "
        f"--debug-rpc-delay-ms Verify={config.slow_delay_ms},Decode={config.slow_delay_ms} (each of its Verify and "
        f"Decode calls waits {config.slow_delay_ms} ms first); 1 coordinator ({COORDINATOR_HOSTS[0]}) started afresh "
        f"for each run; K=0, {config.load_clients} closed-loop clients x {config.load_requests_per_client} requests, "
        f"{config.load_max_new_tokens} new tokens (ignore_eos), distinct Spec-Bench prompts (the same in both runs, "
        "each opened by the run's name); runs: --placement prefix-load, then round-robin"
    )
    records = [r.to_json() for records in runs.values() for r in records]
    return {
        "setup": setup,
        "slowed_replica": slowed,
        "figures": figures,
        "p90_ratio": p90,
        "targets": targets,
        "records": records,
    }


def load_figures(records: list[Sent], slowed: str) -> dict:
    """One run's sessions per replica, the slowed one's share, the request latency stats, and the
    median ms per token of the requests on the slowed replica and on the others (how much slower
    its calls are)."""
    done = completed(records)
    sessions = shares([host_of(r.verify_replicas[0]) for r in done], VERIFY_HOSTS)
    per_token: dict[bool, list[float]] = {True: [], False: []}
    for r in done:
        if r.num_tokens:
            per_token[host_of(r.verify_replicas[0]) == slowed].append(r.latency_ms / r.num_tokens)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "verify_sessions": sessions,
        "slowed_share": ratio(sessions.get(slowed, 0), len(done)),
        "latency_ms": latency_stats([r.latency_ms for r in done]),
        "ms_per_token_slowed": percentile(per_token[True], 50),
        "ms_per_token_others": percentile(per_token[False], 50),
    }


# ---- scenario 4: draft pool ----


def draft_sessions(address: str) -> int | None:
    """The draft replica's open sessions (its GetInfo load report); None when it does not answer."""
    try:
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=5)
    except grpc.RpcError:
        return None
    return info.load.num_sessions


@dataclass
class Kill:
    """The draft-pool scenario's kill: the replica, when (time.monotonic()), and each replica's
    sessions just before."""

    replica: str = ""
    at: float = 0.0
    sessions: dict[str, int | None] = field(default_factory=dict)


def kill_busiest(fleet: Fleet, draft: list[str], after_s: float, kill: Kill) -> None:
    """After ``after_s``, SIGKILLs the draft replica holding the most sessions; fills ``kill``."""
    time.sleep(after_s)
    kill.sessions = {host_of(a): draft_sessions(a) for a in draft}
    kill.replica = max(kill.sessions, key=lambda h: kill.sessions[h] or 0)
    fleet.processes[f"draft-{kill.replica}"].kill()
    kill.at = time.monotonic()


def pool(config: ReplicasConfig, questions: list[Question], console: Console) -> dict:
    """Scenario 4 (see the module docstring)."""
    model = str(near_free_model(console))
    hosts = VERIFY_HOSTS[:1]
    kill = Kill()
    with Fleet(config.out / "logs" / POOL) as fleet:
        verify = addresses(hosts, verify_replicas(fleet, hosts, model))
        draft = addresses(DRAFT_HOSTS, draft_replicas(fleet, DRAFT_HOSTS, model))
        coordinator = add_coordinator(
            fleet, "coordinator", COORDINATOR_HOSTS[0], model, verify, draft, PREFIX_LOAD
        ).address
        console.print(f"{POOL}: starting 1 verify, 2 draft replicas and 1 coordinator...")
        fleet.start()
        warm_up(coordinator, 2 * len(DRAFT_HOSTS), config.k)
        console.print(f"{POOL}: {len(questions)} requests at once, K=0 (the reference)...")
        reference = run_clients(burst([coordinator], questions, config.pool_max_new_tokens, 0), "K=0")
        console.print(
            f"{POOL}: {len(questions)} requests at once, K={config.k}, the busiest draft replica killed after "
            f"{config.kill_after_s:g} s..."
        )
        speculative = run_clients(
            burst([coordinator], questions, config.pool_max_new_tokens, config.k),
            f"K={config.k}",
            lambda: kill_busiest(fleet, draft, config.kill_after_s, kill),
        )
    return pool_section(reference, speculative, kill, config)


def speculating_again_ms(sent: Sent, killed_at: float) -> float | None:
    """ms from the kill to the request's first message of more than one token after it (a round
    that accepted drafts); None when none came."""
    return next(((t - killed_at) * 1000 for t, n in sent.arrivals if t > killed_at and n > 1), None)


def pool_section(reference: list[Sent], speculative: list[Sent], kill: Kill, config: ReplicasConfig) -> dict:
    """The draft-pool scenario's figures and targets: identity against K = 0 by question, and
    the requests whose draft session was on the killed replica."""
    plain = {r.question_id: r.token_ids for r in completed(reference)}
    for r in speculative:
        r.identical = r.error is None and plain.get(r.question_id) == r.token_ids
    done = completed(speculative)
    on_killed = [r for r in done if r.draft_replicas and host_of(r.draft_replicas[0]) == kill.replica]
    running = [r for r in on_killed if r.arrivals and r.arrivals[-1][0] > kill.at]  # not finished before the kill
    for r in running:
        r.speculating_again_ms = speculating_again_ms(r, kill.at)
    resumed = [r.speculating_again_ms for r in running if r.speculating_again_ms is not None]
    figures: dict[str, Any] = {
        "num_requests": len(speculative),
        "num_completed": len(done),
        "num_reference_completed": len(plain),
        "num_identical": sum(bool(r.identical) for r in speculative),
        "killed_replica": kill.replica,
        "sessions_at_kill": kill.sessions,
        "draft_sessions": shares(
            [host_of(r.draft_replicas[0]) if r.draft_replicas else "none" for r in done], DRAFT_HOSTS
        ),
        "num_on_killed": len(on_killed),
        "num_running_at_kill": len(running),
        "num_moved": sum(len(r.draft_replicas) > 1 for r in running),
        "num_speculating_again": len(resumed),
        "speculating_again_ms": {
            "max": max(resumed) if len(resumed) == len(running) and resumed else None,
            "median": percentile(resumed, 50),
        },
    }
    targets = [
        check("requests completed", len(done), ">=", len(speculative)),
        check("outputs identical to K=0's", figures["num_identical"], ">=", len(speculative)),
        check(
            "from the kill to speculating again, max (ms)",
            figures["speculating_again_ms"]["max"],
            "<=",
            RESUME_MAX_MS,
            "ms",
        ),
    ]
    setup = (
        f"near-free model, self-drafted; 1 verify replica ({VERIFY_HOSTS[0]}), 2 draft replicas "
        f"({', '.join(DRAFT_HOSTS)}), 1 coordinator ({COORDINATOR_HOSTS[0]}, --placement prefix-load, default "
        f"--draft-retry-s); {len(speculative)} distinct Spec-Bench prompts sent at once, "
        f"{config.pool_max_new_tokens} new tokens (ignore_eos), first at K=0 "
        f"(the reference: plain decoding through the same pipeline), then at K={config.k} with the draft replica "
        f"holding the most sessions (its GetInfo) SIGKILLed {config.kill_after_s:g} s after the burst began"
    )
    return {
        "setup": setup,
        "figures": figures,
        "targets": targets,
        "records": [r.to_json() for r in [*reference, *speculative]],
    }


# ---- the run and its reports ----

RUNNERS: dict[str, Callable[[ReplicasConfig, list[Question], Console], dict]] = {
    SPREAD: spread,
    AFFINITY: affinity,
    LOAD: load,
    POOL: pool,
}
TITLES = {
    SPREAD: "1. Spread: sessions over the replicas",
    AFFINITY: "2. Prefix affinity: a shared system prompt stays where it is cached",
    LOAD: "3. Load: a slowed replica gets fewer sessions",
    POOL: "4. Draft pool: a killed draft replica's sessions move",
}


def scenario_questions(config: ReplicasConfig) -> dict[str, list[Question]]:
    """Each scenario's prompts: Spec-Bench's, categories interleaved, a slice of its own for the
    spread, load and draft-pool scenarios; the prefix-affinity scenario's from
    :data:`AFFINITY_CATEGORIES`. Raises ValueError when the file has too few."""
    sequence = interleave_categories(load_questions(config.questions))
    sizes = {
        SPREAD: config.spread_requests * config.spread_bursts,
        LOAD: config.load_clients * config.load_requests_per_client,
        POOL: config.pool_requests,
    }
    chosen, start = {}, 0
    for name, size in sizes.items():
        chosen[name], start = sequence[start : start + size], start + size
    if start > len(sequence):
        raise ValueError(f"{config.questions} has {len(sequence)} questions; --replicas needs {start}")
    per_category = -(-config.affinity_questions // len(AFFINITY_CATEGORIES))
    short = interleave_categories(load_questions(config.questions, list(AFFINITY_CATEGORIES), per_category))
    if len(short) < config.affinity_questions:
        raise ValueError(
            f"{config.questions} has {len(short)} questions in {', '.join(AFFINITY_CATEGORIES)}; --replicas needs "
            f"{config.affinity_questions}"
        )
    chosen[AFFINITY] = short[: config.affinity_questions]
    return chosen


def validate(config: ReplicasConfig) -> None:
    """Raises ValueError for an unknown scenario, a size below 1 or a negative time."""
    unknown = [s for s in config.scenarios if s not in SCENARIOS]
    if unknown or not config.scenarios:
        raise ValueError(f"scenarios {unknown or '(none)'}: choose among {', '.join(SCENARIOS)}")
    times = ("slow_delay_ms", "kill_after_s")
    numbers = {k: v for k, v in asdict(config).items() if isinstance(v, int | float) and not isinstance(v, bool)}
    wrong = [k for k, v in numbers.items() if v < (0 if k in times else 1)]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: sizes must be at least 1, times at least 0")


def run_replicas(config: ReplicasConfig, console: Console) -> dict:
    """Runs the scenarios, one fleet each, writing the reports (:data:`REPORT_FILES`) to
    ``config.out`` after each; returns the report. Raises ValueError for bad options or
    questions, RuntimeError when a service fails to start or a warm-up request fails."""
    validate(config)
    questions = scenario_questions(config)
    config.out.mkdir(parents=True, exist_ok=True)
    report = new_report(config)
    for name in config.scenarios:
        report["scenarios"][name] = RUNNERS[name](config, questions[name], console)
        write_reports(report, config.out)
    return report


def new_report(config: ReplicasConfig) -> dict:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
    return {"mode": "replicas", "config": settings, "machine": machine_info(), "scenarios": {}}


def write_reports(report: dict, out: Path) -> None:
    write_json(report, out / REPORT_FILES[0])
    (out / REPORT_FILES[1]).write_text(to_markdown(report))


def _value(value: float | None, unit: str) -> str:
    if unit == "%":
        return _cell(value, ".0%")
    if unit == "ms":
        return _cell(value, ".0f", " ms")
    if unit == "x":
        return _cell(value, ".2f", "x")
    return _cell(value, "d" if isinstance(value, int) else ".3f")


def targets_table(section: dict) -> list[str]:
    rows = [
        [
            t["name"],
            _value(t["value"], t["unit"]),
            f"{t['op']} {_value(t['bound'], t['unit'])}",
            "met" if t["met"] else "**missed**",
        ]
        for t in section["targets"]
    ]
    return _table(["target", "measured", "goal", ""], rows)


def _sessions(counts: dict[str, Any]) -> str:
    return ", ".join(f"{replica}: {n}" for replica, n in counts.items())


def spread_markdown(section: dict) -> list[str]:
    f = section["figures"]
    rows = [
        [
            str(i + 1),
            _sessions(b["verify_sessions"]),
            _shares(b["verify_cpu_shares"]),
            _cell(b["verify_cpu_deviation"], ".0%"),
            _sessions(b["draft_sessions"]),
            _shares(b["draft_cpu_shares"]),
            _cell(b["draft_cpu_deviation"], ".0%"),
        ]
        for i, b in enumerate(f["bursts"])
    ]
    header = ["burst", "verify sessions", "verify CPU share", "deviation", "draft sessions", "draft CPU share"]
    return [
        *_table([*header, "deviation"], rows),
        "",
        f"Worst burst: verify {_cell(f['verify_cpu_worst_deviation'], '.0%')}, draft "
        f"{_cell(f['draft_cpu_worst_deviation'], '.0%')} from an even share of the CPU. "
        f"{f['num_completed']}/{f['num_requests']} completed; request latency mean "
        f"{_cell(f['latency_ms']['mean'], '.0f')} ms, p90 {_cell(f['latency_ms']['p90'], '.0f')} ms.",
    ]


def _shares(shares: dict[str, float | None]) -> str:
    return ", ".join(f"{replica}: {_cell(share, '.2f')}" for replica, share in shares.items())


def affinity_markdown(section: dict) -> list[str]:
    rows = [
        [
            run,
            f"{s['num_completed']}/{s['num_requests']}",
            str(s["cached_prompt_tokens"]),
            str(s["prompt_tokens"]),
            str(s["num_short_hits"]),
            _cell(s["cached_vs_single"], ".3f"),
            _cell(s["ttft_ms"]["mean"], ".0f"),
            _cell(s["ttft_ms"]["p50"], ".0f"),
            _cell(s["ttft_ms"]["p90"], ".0f"),
            "; ".join(_sessions(h) for h in s["replicas_per_system_prompt"].values()),
        ]
        for run, s in section["figures"].items()
    ]
    header = ["run", "completed", "cached prompt tokens", "prompt tokens", "short hits", "cached / single's"]
    return _table([*header, "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms", "each system prompt's replicas"], rows)


def load_markdown(section: dict) -> list[str]:
    rows = [
        [
            run,
            f"{s['num_completed']}/{s['num_requests']}",
            _sessions(s["verify_sessions"]),
            _cell(s["slowed_share"], ".1%"),
            _cell(s["latency_ms"]["mean"], ".0f"),
            _cell(s["latency_ms"]["p50"], ".0f"),
            _cell(s["latency_ms"]["p90"], ".0f"),
            _cell(s["ms_per_token_others"], ".1f"),
            _cell(s["ms_per_token_slowed"], ".1f"),
        ]
        for run, s in section["figures"].items()
    ]
    header = ["run", "completed", "sessions per replica", f"{section['slowed_replica']}'s share", "latency mean ms"]
    return _table([*header, "p50 ms", "p90 ms", "ms/token, others", "ms/token, slowed"], rows)


def pool_markdown(section: dict) -> list[str]:
    f = section["figures"]
    again = f["speculating_again_ms"]
    return [
        f"- completed: {f['num_completed']}/{f['num_requests']} (the K=0 reference: {f['num_reference_completed']}); "
        f"identical to K=0's: {f['num_identical']}/{f['num_requests']}",
        f"- draft sessions per replica: {_sessions(f['draft_sessions'])}; killed: {f['killed_replica']} (sessions "
        f"at the kill: {_sessions({k: '-' if v is None else v for k, v in f['sessions_at_kill'].items()})})",
        f"- requests whose draft session was on it: {f['num_on_killed']}, {f['num_running_at_kill']} still running at "
        f"the kill, {f['num_moved']} moved to the other replica, {f['num_speculating_again']} speculating again",
        f"- from the kill to their first message of more than one token: max {_cell(again['max'], '.0f')} ms, "
        f"median {_cell(again['median'], '.0f')} ms",
    ]


MARKDOWN = {SPREAD: spread_markdown, AFFINITY: affinity_markdown, LOAD: load_markdown, POOL: pool_markdown}


def to_markdown(report: dict) -> str:
    """The report as Markdown: per scenario, its set-up, figures and targets."""
    machine, config = report["machine"], report["config"]
    lines = [
        "# specdec bench replicas",
        "",
        f"`{config['command']}`",
        "",
        f"{machine_line(machine)}, {machine['date']}. Every service a process of its own on a loopback "
        "address of its own; the coordinators are given the replicas' IP:port lists (the spread scenario's verify "
        "replicas: one DNS name); greedy decoding.",
    ]
    for name, section in report["scenarios"].items():
        lines += [
            "",
            f"## {TITLES[name]}",
            "",
            section["setup"] + ".",
            "",
            *MARKDOWN[name](section),
            "",
            *targets_table(section),
        ]
    return "\n".join(lines) + "\n"


def targets_summary(report: dict) -> list[str]:
    """Each scenario's title and targets table (what ``specdec bench replicas`` prints)."""
    lines: list[str] = []
    for name, section in report["scenarios"].items():
        lines += [TITLES[name], *targets_table(section), ""]
    return lines

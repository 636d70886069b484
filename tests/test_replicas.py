"""Past one node: three verify replicas (127.0.0.2-4) and two draft replicas (127.0.0.5-6) as
separate processes behind DNS names served by a real DNS server, and two coordinators that find
them by those names (:mod:`coordinator.speculation.discovery`), spread sessions over them by
load and prefix (:mod:`coordinator.speculation.placement`), follow the records as they change,
and move a killed draft replica's sessions to the other one. Every output is plain greedy
decoding."""

import random
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from coordinator.api.client import Completion
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec_app.launcher import ServiceProcess, free_port, start_all, stop_all
from tests.conftest import DnsServer, chat_ids, plain_greedy

# Processes for six services, a DNS server and two coordinators: a long check (scripts/long_checks.sh);
# placement and discovery are tested directly in tests/test_placement.py and tests/test_discovery.py.
pytestmark = pytest.mark.long

VERIFY_HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
DRAFT_HOSTS = ["127.0.0.5", "127.0.0.6"]
VERIFY_NAME, DRAFT_NAME = "verify.specdec.test", "draft.specdec.test"
REFRESH_S = 1.0
WORDS = [
    "river",
    "stone",
    "lamp",
    "orchard",
    "violin",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "falcon",
    "quiet",
    "amber",
]


class Fleet:
    """The replicas and coordinators (see the module docstring); ``dns`` serves their names."""

    def __init__(self, tiny_models, redis_url: str, logs: Path):
        self.dns = DnsServer()
        self.dns.records = {VERIFY_NAME: list(VERIFY_HOSTS), DRAFT_NAME: list(DRAFT_HOSTS)}
        target = str(tiny_models.target_dir)
        verify_port, draft_port = free_port(), free_port()
        self.verify = {
            host: self._service("verify", host, verify_port, logs, ["--model", target]) for host in VERIFY_HOSTS
        }
        self_draft = ["--drafters", "transformers", "--default-drafter", "transformers", "--transformers-model", target]
        self.draft = {host: self._service("draft", host, draft_port, logs, self_draft) for host in DRAFT_HOSTS}
        upstream = [
            "--tokenizer",
            target,
            "--verify-addresses",
            f"{VERIFY_NAME}:{verify_port}",
            "--draft-addresses",
            f"{DRAFT_NAME}:{draft_port}",
            "--dns-nameservers",
            self.dns.address,
            "--discovery-refresh-s",
            str(REFRESH_S),
            "--draft-retry-s",
            "0.5",
            "--max-streams-per-client",  # every request of the tests comes from one address
            "0",
        ]
        self.coordinators = [
            ServiceProcess(
                "coordinator",
                free_port(),
                args=upstream,
                log_file=logs / f"coordinator{i}.log",
                env={"SPECDEC_REDIS_URL": redis_url},
            )
            for i in range(2)
        ]
        self.processes = [*self.verify.values(), *self.draft.values(), *self.coordinators]

    @staticmethod
    def _service(kind: str, host: str, port: int, logs: Path, args: list[str]) -> ServiceProcess:
        return ServiceProcess(kind, port, host=host, args=args, log_file=logs / f"{kind}-{host}.log")

    def start(self) -> None:
        start_all(self.processes, 180)

    def stop(self) -> None:
        stop_all(self.processes)
        self.dns.stop()


@pytest.fixture(scope="module")
def fleet(tiny_models, redis_server, tmp_path_factory):
    fleet = Fleet(tiny_models, redis_server.url, tmp_path_factory.mktemp("replicas"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def request(i: int, max_new_tokens: int = 24, system: str = "") -> coordinator_pb2.GenerateRequest:
    words = random.Random(i).choices(WORDS, k=6)  # first: prompts share no more than the chat template
    messages = [coordinator_pb2.ChatMessage(role="user", content=f"{' '.join(words)} (request {i}).")]
    if system:
        messages.insert(0, coordinator_pb2.ChatMessage(role="system", content=system))
    return coordinator_pb2.GenerateRequest(
        chat=coordinator_pb2.ChatMessages(messages=messages),
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        num_speculative_tokens=4,
    )


class Burst:
    """``requests`` sent at once, alternating over the coordinators, each read by a thread: its
    completion and the time each message arrived."""

    def __init__(self, fleet: Fleet, requests: list[coordinator_pb2.GenerateRequest]):
        self.completions = [Completion() for _ in requests]
        self.arrivals: list[list[tuple[float, int]]] = [[] for _ in requests]
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._read, args=(fleet.coordinators[i % 2].address, r, i), daemon=True)
            for i, r in enumerate(requests)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, address: str, request, i: int) -> None:
        try:
            with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
                for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=180):
                    self.arrivals[i].append((time.monotonic(), len(response.token_ids)))
                    self.completions[i].add(response)
        except grpc.RpcError as err:
            self.errors.append(err)

    def join(self) -> list[Completion]:
        for thread in self.threads:
            thread.join(240)
        assert not self.errors, self.errors
        return self.completions


def assert_plain(plain_target_model, tokenizer, requests, completions) -> None:
    for r, completion in zip(requests, completions, strict=True):
        prompt = chat_ids(tokenizer, r.chat.messages[0].content)
        assert completion.token_ids == plain_greedy(plain_target_model, prompt, r.max_new_tokens)


def wait_for_records(seconds: float = 2 * REFRESH_S + 0.5) -> None:
    time.sleep(seconds)  # two discovery intervals: every coordinator has resolved the names again


def test_24_sessions_spread_over_every_replica(fleet, tiny_pipeline, plain_target_model):
    """24 sessions at once (each open while all the others arrive: they last seconds, the burst
    arrives within a fraction of one) over 3 verify and 2 draft replicas from 2 coordinators: each
    replica within 3 (verify) or 4 (draft) sessions of even, as two coordinators that each spread
    their own evenly, seeing the other's only in load reports, can leave them."""
    requests = [request(i, max_new_tokens=120) for i in range(24)]
    completions = Burst(fleet, requests).join()
    assert_plain(plain_target_model, tiny_pipeline.target.tokenizer, requests, completions)
    verify = Counter(c.metrics.verify_replicas[0].split(":")[0] for c in completions)
    draft = Counter(c.metrics.draft_replicas[0].split(":")[0] for c in completions if c.metrics.draft_replicas)
    assert set(verify) == set(VERIFY_HOSTS) and all(5 <= n <= 11 for n in verify.values()), verify  # 8 +- 3
    assert set(draft) == set(DRAFT_HOSTS) and all(8 <= n <= 16 for n in draft.values()), draft  # 12 +- 4


def test_a_shared_system_prompt_stays_where_its_prefix_is_cached(fleet):
    """4 system prompts x 12 requests, one after the other: each prompt's requests keep to one
    replica, so its prefix is computed once; round robin would compute it on every replica."""
    systems = [" ".join(random.Random(100 + s).choices(WORDS, k=120)) for s in range(4)]
    cached, homes = [], {s: set() for s in range(4)}
    for i in range(48):  # each system prompt through both coordinators, each with its own memory
        with grpc.insecure_channel(fleet.coordinators[i // 4 % 2].address, options=GRPC_OPTIONS) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            completion = Completion()
            for response in stub.Generate(request(i, 4, systems[i % 4]), timeout=120):
                completion.add(response)
        cached.append(completion.metrics.num_cached_prompt_tokens)
        homes[i % 4].add(completion.metrics.verify_replicas[0])
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert cached[:4] == [0, 0, 0, 0] and min(cached[4:]) >= 128, cached  # every later one found its system prompt


def test_replicas_found_and_lost_with_the_records(fleet, tiny_pipeline, plain_target_model):
    """A replica whose record goes gets no new session within two refresh intervals; one whose
    record comes back gets sessions again; one removed mid-burst loses no request, and every
    output is plain decoding."""
    fleet.dns.records[VERIFY_NAME] = VERIFY_HOSTS[:2]
    wait_for_records()
    requests = [request(100 + i) for i in range(12)]
    completions = Burst(fleet, requests).join()
    assert {c.metrics.verify_replicas[0].split(":")[0] for c in completions} == set(VERIFY_HOSTS[:2])
    fleet.dns.records[VERIFY_NAME] = list(VERIFY_HOSTS)
    wait_for_records()
    requests = [request(200 + i) for i in range(12)]
    completions = Burst(fleet, requests).join()
    assert VERIFY_HOSTS[2] in {c.metrics.verify_replicas[0].split(":")[0] for c in completions}
    requests = [request(300 + i, max_new_tokens=96) for i in range(16)]
    burst = Burst(fleet, requests)
    time.sleep(0.5)
    fleet.dns.records[VERIFY_NAME] = [VERIFY_HOSTS[0], VERIFY_HOSTS[2]]  # 127.0.0.3 goes mid-burst
    completions = burst.join()
    assert_plain(plain_target_model, tiny_pipeline.target.tokenizer, requests, completions)
    moved = [c for c in completions if c.metrics.verify_replicas[0].startswith(VERIFY_HOSTS[1])]
    assert all(len(c.metrics.verify_replicas) == 2 for c in moved if c.metrics.num_verify_rebuilds)
    fleet.dns.records[VERIFY_NAME] = list(VERIFY_HOSTS)
    wait_for_records()


def test_a_killed_draft_replicas_sessions_move_to_the_other(fleet, tiny_pipeline, plain_target_model):
    """One of the two draft replicas SIGKILLed mid-burst of 16: all 16 complete as plain decoding,
    and those whose draft it held speculate again on the other within a second."""
    requests = [request(400 + i, max_new_tokens=160) for i in range(16)]
    burst = Burst(fleet, requests)
    time.sleep(1.0)
    fleet.draft[DRAFT_HOSTS[0]].kill()
    killed_at = time.monotonic()
    completions = burst.join()
    assert_plain(plain_target_model, tiny_pipeline.target.tokenizer, requests, completions)
    on_killed = f"{DRAFT_HOSTS[0]}:"
    moved = [
        i
        for i, c in enumerate(completions)
        if c.metrics.draft_replicas[:1] and c.metrics.draft_replicas[0].startswith(on_killed)
    ]
    assert moved, "no session was on the killed replica"
    for i in moved:
        assert completions[i].metrics.draft_replicas[-1].startswith(DRAFT_HOSTS[1])
        again = next(t for t, n in burst.arrivals[i] if t > killed_at and n > 1)  # a round with accepted drafts
        assert again - killed_at < 1.0, again - killed_at

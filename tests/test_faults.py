"""No request lost to a fault in any phase: the services as separate processes on free ports (two
verify replicas, one draft service, two coordinators sharing a real Redis; the tiny models), each
fault a real signal to a real process.

The fault matrix: what fails x signal x when. Each cell sends a burst of concurrent requests
(greedy with a fixed K, greedy with adaptive K, seeded sampling; more sequences than the verify
engine's ``max_num_seqs``, so some calls wait in its queue), each request in a known phase when
the fault comes:

- ``early`` cells: the burst's Prefill calls are in flight (each service holds every Prefill for
  PREFILL_HOLD_MS with the ``--debug-rpc-delay-ms`` test hook, and the fault comes inside that:
  phase ``prefill``), and one more request arrives just after the fault (phase ``arrival``: its
  GetInfo and Prefill find the service down);
- ``late`` cells: the fault comes once every stream has tokens (phase ``decode``: Verify and
  Decode calls in flight or queued in the engine, the draft's Propose drafting ahead in flight)
  and the leading one still running is within its last two rounds (phase ``last``; one stream
  may have finished by then: adaptive K can commit the last tokens faster than the poll sees).

What fails: the draft service, one verify replica of two (its requests move to the other), every
verify replica (the requests wait for their restart, as with the only replica under ``specdec
up``), Redis. ``SIGKILL`` is followed by a restart begun at once, as ``specdec up``'s supervisor
does (Redis's after the burst: it would be back within milliseconds); ``SIGSTOP`` by ``SIGCONT``
after a hold longer than the
deadlines the coordinators run with here. The suite runs a pairwise-covering half of the matrix
(``SUITE_CELLS``); ``scripts/long_checks.sh`` runs the other half.

Every request must complete; greedy ones with the token ids of plain greedy decoding, the seeded
sampling one with those of its undisturbed run, except where rounds ran without the draft (a draft
fault, or a draft that missed its deadline on the loaded machine: the request's
``num_draft_failures``): the rejection-sampling rule draws the accepted and recovered tokens from
the proposals, so rounds without the draft give another, equally exact sample (docs/faults.md).
Afterwards no session is left on any service, released rather than evicted as idle. The client's
longest wait for a message after each fault is printed at the end of the run. A coordinator that
dies cannot keep its streams: its client resumes on another coordinator (the last tests)."""

import asyncio
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from coordinator.api.client import Completion, generate
from coordinator.request_store.store import FINISHED, RedisStore
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from specdec.rpc.server import GRPC_OPTIONS
from specdec.sampling.structured_output import StructuredOutput
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import SUMMARY, chat_ids, constrained_greedy, plain_greedy, process_fleet, scrape

pytestmark = pytest.mark.multiprocess
PROMPTS = [
    "Write a long story about a lighthouse keeper and the ships she guided home.",
    "Explain how a steam engine works, step by step.",
    "List the planets of the solar system and one fact about each.",
]
MAX_NEW, K = 48, 4
PREFILL_HOLD_MS = 1000  # every Prefill waits this long on both services (the test hook)
RPC_TIMEOUT_S, PREFILL_TIMEOUT_S = 2.0, 3.0  # the coordinators' deadlines here
STOP_HOLD_S = {"draft": 1.5, "verify": 3.0, "redis": 2.0}  # SIGSTOP to SIGCONT, seconds
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1234)
LETTERS = common_pb2.StructuredOutput(regex="[a-z ]{200}")  # longer than MAX_NEW tokens: ends with length
LONGEST_WAIT_S: dict[str, float] = {}


def requests() -> dict[str, coordinator_pb2.GenerateRequest]:
    """Every request a cell sends, by name."""
    fixed = dict(num_speculative_tokens=K, drafter="transformers")
    return {
        "greedy": coordinator_pb2.GenerateRequest(text=PROMPTS[0], max_new_tokens=MAX_NEW, **fixed),
        "adaptive": coordinator_pb2.GenerateRequest(text=PROMPTS[1], max_new_tokens=MAX_NEW, drafter="transformers"),
        "sampled": coordinator_pb2.GenerateRequest(text=PROMPTS[0], max_new_tokens=MAX_NEW, **fixed, **SAMPLED),
        "greedy-2": coordinator_pb2.GenerateRequest(text=PROMPTS[2], max_new_tokens=MAX_NEW, **fixed),
    }


@pytest.fixture(scope="module")
def fleet(tiny_models, redis_server, tmp_path_factory):
    """Two verify replicas (at most 2 sequences a step), the self-draft, two coordinators. Sessions
    idle for 60 s are evicted, longer than any cell, so a session left behind shows."""
    service_args = ["--num-threads", "1", "--session-idle-timeout-s", "60"]
    service_args += ["--debug-rpc-delay-ms", f"Prefill={PREFILL_HOLD_MS}"]
    coordinator_args = ["--max-new-tokens-limit", "512", "--draft-retry-s", "0.5", "--failover-timeout-s", "30"]
    # adaptive K up to the fixed K, so that every stream of a burst decodes at about the same pace
    coordinator_args += ["--adaptive-k-max", str(K)]
    coordinator_args += ["--rpc-timeout-s", str(RPC_TIMEOUT_S), "--prefill-timeout-s", str(PREFILL_TIMEOUT_S)]
    logs = tmp_path_factory.mktemp("fault-logs")
    with process_fleet(
        tiny_models, redis_server.url, logs, [*service_args, "--max-num-seqs", "2"], coordinator_args, num_verify=2
    ) as fleet:
        yield fleet
    if LONGEST_WAIT_S:
        SUMMARY.append("fault matrix, the client's longest wait for a message after the fault (phase-target-signal):")
        SUMMARY.extend(f"  {cell}: {seconds * 1000:.0f} ms" for cell, seconds in LONGEST_WAIT_S.items())


@pytest.fixture(scope="module")
def references(fleet, tiny_models, smollm2_tokenizer, plain_target_model) -> dict[str, list[int]]:
    """Each burst request's expected token ids: plain greedy decoding of the target for the greedy
    ones, the undisturbed run for the seeded sampling one."""
    expected = {}
    for name, request in requests().items():
        if request.temperature:
            undisturbed = generate(fleet.coordinators[0].address, request, timeout_s=120)
            assert not undisturbed.metrics.num_draft_failures, "the reference run went without its draft"
            expected[name] = undisturbed.token_ids
        else:
            prompt = chat_ids(smollm2_tokenizer, request.text)
            expected[name] = plain_greedy(plain_target_model, prompt, request.max_new_tokens)
    return expected


@dataclass
class Stream:
    """One request of a burst, read by a thread: its completion, when each message arrived
    (time.monotonic()), and the error that ended it, if any."""

    completion: Completion = field(default_factory=Completion)
    arrivals: list[float] = field(default_factory=list)
    error: grpc.RpcError | None = None


class Burst:
    """Requests sent to ``address``, each read on its own thread."""

    def __init__(self, address: str):
        self.address = address
        self.streams: dict[str, Stream] = {}
        self.threads: list[threading.Thread] = []

    def send(self, named: dict[str, coordinator_pb2.GenerateRequest]) -> None:
        for name, request in named.items():
            self.streams[name] = Stream()
            thread = threading.Thread(target=self._read, args=(request, self.streams[name]), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _read(self, request, stream: Stream) -> None:
        try:
            with grpc.insecure_channel(self.address, options=GRPC_OPTIONS) as channel:
                for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=120):
                    stream.arrivals.append(time.monotonic())
                    stream.completion.add(response)
        except grpc.RpcError as err:
            stream.error = err

    def tokens(self) -> dict[str, int]:
        """Tokens each stream still running has received so far, by name."""
        running = {name: s for name, s in self.streams.items() if not (s.completion.finish_reason or s.error)}
        return {name: len(stream.completion.token_ids) for name, stream in running.items()}

    def wait_until(self, condition: Callable[[dict[str, int]], bool], timeout_s: float = 60) -> None:
        """Waits until ``condition(self.tokens())``."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.tokens()):
            assert time.monotonic() < deadline, f"the burst never got there: tokens {self.tokens()}"
            time.sleep(0.002)

    def join(self) -> dict[str, Stream]:
        for thread in self.threads:
            thread.join(150)
        return self.streams


@dataclass
class Fault:
    """What fails in a cell: ``strike()`` sends the signal, ``recover()`` undoes it (restart or
    SIGCONT) and returns once the part serves again; ``recover_at_once``: recover right after the
    strike (the requests wait for it), else after the burst."""

    strike: Callable[[], None]
    recover: Callable[[], None]
    recover_at_once: bool


def make_fault(fleet, redis_server, target: str, signum: int) -> Fault:
    processes = {
        "draft": [fleet.draft],
        "verify-one": [fleet.verify[0]],
        "verify-all": fleet.verify,
    }.get(target, [])
    if signum == signal.SIGSTOP:
        hold_s = STOP_HOLD_S[target.split("-")[0]]
        pids = [p.started.pid for p in processes] or [redis_server.process.pid]

        def cont():
            time.sleep(hold_s)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

        return Fault(lambda: [os.kill(pid, signal.SIGSTOP) for pid in pids], cont, recover_at_once=True)
    if target == "redis":
        return Fault(redis_server.kill, redis_server.start, recover_at_once=False)

    def restart():
        threads = [threading.Thread(target=fleet.restart, args=(p,)) for p in processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return Fault(lambda: [p.kill() for p in processes], restart, recover_at_once=True)


TARGETS, SIGNALS, PHASES = ("draft", "verify-one", "verify-all", "redis"), ("SIGKILL", "SIGSTOP"), ("early", "late")
CELLS = [(target, sig, when) for target in TARGETS for sig in SIGNALS for when in PHASES]
# The suite's half of the matrix: every value of each dimension with every value of each other one
# (pairwise coverage: each target under both signals, each target and each signal early and
# late). The other half is a long check (scripts/long_checks.sh).
SUITE_CELLS = {
    ("draft", "SIGKILL", "early"),
    ("draft", "SIGSTOP", "late"),
    ("verify-one", "SIGKILL", "late"),
    ("verify-one", "SIGSTOP", "early"),
    ("verify-all", "SIGKILL", "early"),
    ("verify-all", "SIGSTOP", "late"),
    ("redis", "SIGKILL", "late"),
    ("redis", "SIGSTOP", "early"),
}


def test_the_suites_cells_cover_every_pair_of_values():
    for first, second in itertools.combinations(range(3), 2):
        pairs = {(cell[first], cell[second]) for cell in SUITE_CELLS}
        assert pairs == {(cell[first], cell[second]) for cell in CELLS}, (first, second)


@pytest.mark.parametrize(
    ("target", "sig", "when"),
    [pytest.param(*cell, id="-".join(cell), marks=() if cell in SUITE_CELLS else pytest.mark.long) for cell in CELLS],
)
def test_fault_matrix(fleet, references, redis_server, target, sig, when):
    fault = make_fault(fleet, redis_server, target, signal.Signals[sig])
    services = [fleet.draft, *fleet.verify]
    evicted_before = sum(scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services)
    named = requests()
    burst = Burst(fleet.coordinators[0].address)
    if when == "early":
        arrival = {"greedy-2": named.pop("greedy-2")}  # sent once the fault has come
        burst.send(named)
        time.sleep(PREFILL_HOLD_MS / 1000 * 0.4)  # GetInfo answered, the Prefills held by the hook
        assert not any(burst.tokens().values()), "a stream had tokens before its prefill ended"
    else:  # the leading stream within its last two rounds, every other one past its prefill
        burst.send(named)
        burst.wait_until(lambda tokens: max(tokens.values()) >= MAX_NEW - 2 * (K + 1) and min(tokens.values()) >= 1)
    at_fault, fault_at = burst.tokens(), time.monotonic()
    assert len(at_fault) >= len(named) - 1, f"streams ended before the fault: {at_fault} still ran"
    fault.strike()
    recovery = threading.Thread(target=fault.recover) if fault.recover_at_once else None
    if recovery is not None:
        recovery.start()
    if when == "early":
        burst.send(arrival)
        at_fault.update(dict.fromkeys(arrival, 0))
    streams = burst.join()
    if recovery is not None:
        recovery.join()
    else:
        fault.recover()

    for name, stream in streams.items():
        assert stream.error is None, f"{name}: {stream.error.code()} {stream.error.details()}"
        # another exact sample where rounds ran without the draft: see the docstring
        if name == "sampled" and (target == "draft" or stream.completion.metrics.num_draft_failures):
            assert len(stream.completion.token_ids) == MAX_NEW, name
        else:
            assert stream.completion.token_ids == references[name], f"{name} differs from its reference"
    after = {name: [fault_at, *(t for t in streams[name].arrivals if t > fault_at)] for name in at_fault}
    assert all(len(times) > 1 for times in after.values()), f"a stream ended at the fault: {at_fault}"
    waits = [b - a for times in after.values() for a, b in itertools.pairwise(times)]
    LONGEST_WAIT_S[f"{target}-{sig}-{when}"] = max(waits)
    assert_no_session_left(services, evicted_before)


def assert_no_session_left(services, evicted_before: float, timeout_s: float = 15) -> None:
    """Every session of the burst is released (in the background, after the requests end; a
    restarted service holds none), none evicted as idle."""
    deadline = time.monotonic() + timeout_s
    while (held := [scrape(s.metrics_url)["specdec_num_sessions"] for s in services]) != [0] * len(services):
        assert time.monotonic() < deadline, f"sessions left on draft, verify0, verify1: {held}"
        time.sleep(0.1)
    assert sum(scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services) <= evicted_before


@pytest.mark.long  # the fault matrix's cells show both kills
def test_constrained_output_survives_a_draft_and_a_verify_kill(
    fleet, smollm2_tokenizer, plain_target_model, tiny_grammar_vocab
):
    """Greedy under a grammar, the draft service and both verify replicas killed mid-stream (and
    restarted at once): each service's grammar matcher is rebuilt from the committed log with its
    session, and the output equals plain constrained decoding."""
    request = coordinator_pb2.GenerateRequest(
        text=PROMPTS[1], max_new_tokens=MAX_NEW, structured_output=LETTERS, num_speculative_tokens=K,
        drafter="transformers",
    )  # fmt: skip
    prompt = chat_ids(smollm2_tokenizer, request.text)
    expected = constrained_greedy(
        plain_target_model, prompt, StructuredOutput.from_proto(LETTERS), tiny_grammar_vocab, MAX_NEW
    )
    services = [fleet.draft, *fleet.verify]
    evicted_before = sum(scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services)
    burst = Burst(fleet.coordinators[0].address)
    burst.send({"constrained": request})
    burst.wait_until(lambda tokens: min(tokens.values(), default=MAX_NEW) >= 12)
    assert burst.tokens(), "the request ended before the fault"
    for process in services:
        process.kill()
    restarts = [threading.Thread(target=fleet.restart, args=(p,)) for p in services]
    for thread in restarts:
        thread.start()
    stream = burst.join()["constrained"]
    for thread in restarts:
        thread.join()
    assert stream.error is None, f"{stream.error.code()} {stream.error.details()}"
    assert stream.completion.token_ids == expected
    assert_no_session_left(services, evicted_before)


def test_a_request_stored_after_redis_returns(fleet, references, redis_server):
    """After Redis came back empty (the matrix's Redis cells), new requests are stored again."""
    request = requests()["greedy"]
    request.request_id = "after-redis-returned"
    assert generate(fleet.coordinators[0].address, request, timeout_s=120).token_ids == references["greedy"]
    deadline = time.monotonic() + 10
    while (
        stored := from_redis(redis_server.url, lambda store: store.load("after-redis-returned"))
    ) is None or stored.status != FINISHED:
        assert time.monotonic() < deadline, "the finished request was not stored after Redis returned"
        time.sleep(0.1)
    assert stored.generated == references["greedy"]


def test_coordinator_killed_mid_stream_resumes_on_another(fleet, references):
    """The coordinator serving a stream dies: the client gets UNAVAILABLE and, with the request id
    of the stream's first message, resumes on the second coordinator from the last position it
    received: the concatenation equals the undisturbed run (seeded sampling; where the resumed
    rounds ran without the draft, another exact sample of its length), without gaps or
    duplicates, and the sessions the dead coordinator left are released. (Greedy resumes: the
    soak test.) The first coordinator stays down: the tests after this one use the second."""
    first, second = fleet.coordinators
    request = requests()["sampled"]
    reference = generate(second.address, request, timeout_s=120)
    request.request_id = "resume-after-kill"
    services = [fleet.draft, *fleet.verify]
    evicted_before = sum(scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services)
    received = Completion()
    with pytest.raises(grpc.RpcError) as cut, grpc.insecure_channel(first.address, options=GRPC_OPTIONS) as channel:
        for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=120):
            received.add(response)
            if len(received.token_ids) >= 12 and first.process.poll() is None:
                first.kill()
                killed_at = time.monotonic()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    resume = coordinator_pb2.GenerateRequest(request_id=request.request_id, resume_from=len(received.token_ids))
    rest, recovery_s = Completion(), None
    with grpc.insecure_channel(second.address, options=GRPC_OPTIONS) as channel:
        for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(resume, timeout=120):
            recovery_s = recovery_s or time.monotonic() - killed_at
            rest.add(response)
    LONGEST_WAIT_S["coordinator killed, resumed on another: to the first resumed message"] = recovery_s
    assert reference.token_ids == references["sampled"]
    assert rest.token_ids and received.token_ids == reference.token_ids[: len(received.token_ids)]
    if rest.metrics.num_draft_failures:
        # the resumed draft's held Prefill outlasted the first round's wait for it (a loaded host):
        # rounds without the draft draw another exact sample, as in the fault matrix
        assert len(received.token_ids + rest.token_ids) == MAX_NEW
    else:
        assert received.token_ids + rest.token_ids == reference.token_ids
        assert received.text + rest.text == reference.text
        assert rest.finish_reason == reference.finish_reason
    assert rest.metrics.num_resumed_tokens >= len(received.token_ids)
    assert_no_session_left(services, evicted_before)


def from_redis(url: str, read):
    """``await read(store)`` on a RedisStore of the coordinators' Redis."""

    async def run():
        store = RedisStore(url, 60, Counter("errors", "", ["operation"], registry=CollectorRegistry()))
        try:
            return await read(store)
        finally:
            await store.close()

    return asyncio.run(run())


def test_acceptance_estimates_are_shared_through_redis(fleet, redis_server, tiny_models):
    """An adaptive request's acceptance estimates reach Redis, where every coordinator replica
    warm-starts its sessions from: those its rounds observed alone, never a default it only started
    from (that would overwrite what another replica's requests measured). The n-gram lookup's,
    which its rounds measure whichever proposer they use: its 1-token matches' at least (the text
    repeats tokens; a longer match's only where it repeats a pair, which this greedy text may
    not). And the self-draft's where the request drafted with it (under a loaded suite, a round
    it was asked for may get no proposal in time: no draft). Whether it drafts is adaptive K's
    call, not this test's: here the self-draft, as slow as the target on the same core, pays only
    in probes, and the test hook's held Prefills price opening it at about a second, which can put
    every probe off (``AdaptiveK._opening_share``; seen once in a clean-clone suite run). A request
    with a probe or two leaves its later positions at about the prior (seen once: [0.9, 0.8]); its
    first position, which every drafted round tests, has risen."""
    request = requests()["adaptive"]
    request.request_id, request.max_new_tokens = "adaptive-estimates", 400
    completion = generate(fleet.coordinators[1].address, request, timeout_s=120)
    usage = {name: use.num_rounds for name, use in completion.metrics.drafter_usage.items()}
    assert completion.metrics.adaptive, f"rounds by drafter: {usage}"
    drafted = completion.metrics.drafter_usage["transformers"].num_draft_tokens if "transformers" in usage else 0
    expected = {"ngram/1"} | ({"transformers"} if drafted else set())
    target = str(tiny_models.target_dir)
    deadline = time.monotonic() + 10
    while not expected <= (priors := from_redis(redis_server.url, lambda store: store.load_priors(target))).keys():
        assert time.monotonic() < deadline, f"estimates missing from Redis ({usage} rounds by drafter): {priors}"
        time.sleep(0.1)
    if drafted:  # a self-draft's first position always passes: above its prior once it drafted
        assert priors["transformers"][0] > AdaptiveState.prior_rate

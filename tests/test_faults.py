"""Sessions that survive faults: the services as separate processes on free ports (two verify
replicas, one draft service, two coordinators sharing a real Redis; the tiny models), each killed
by pid with SIGKILL while a request streams. Every disturbed request must give exactly the token
ids and text of an undisturbed one. The time from each kill to the client's next message (its
recovery time) is printed at the end of the module."""

import asyncio
import signal
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from coordinator.client import Completion, generate
from coordinator.store import FINISHED, RedisStore
from specdec.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import SUMMARY, process_fleet, scrape, speculates_again, stream_with_fault

pytestmark = pytest.mark.multiprocess
PROMPT = "Write a long story about a lighthouse keeper and the ships she guided home."
MAX_NEW, K, FAULT_AFTER = 300, 4, 12  # the fault comes once the client has FAULT_AFTER tokens
RECOVERY_S: dict[str, float] = {}


@pytest.fixture(scope="module")
def fleet(tiny_models, redis_server, tmp_path_factory):
    """Two verify replicas, the self-draft, two coordinators; idle sessions (those of the killed
    coordinator) are evicted after 3 s, and a failed draft is retried after 0.5 s."""
    service_args = ["--num-threads", "1", "--session-idle-timeout-s", "3"]
    coordinator_args = ["--max-new-tokens-limit", "512", "--draft-retry-s", "0.5"]
    logs = tmp_path_factory.mktemp("fault-logs")
    with process_fleet(tiny_models, redis_server.url, logs, service_args, coordinator_args, num_verify=2) as fleet:
        yield fleet
    for fault, seconds in RECOVERY_S.items():
        SUMMARY.append(f"{fault}: {seconds * 1000:.0f} ms")


def make_request(**fields) -> coordinator_pb2.GenerateRequest:
    defaults = dict(text=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=K, drafter="transformers")
    return coordinator_pb2.GenerateRequest(**{**defaults, **fields})


SAMPLING = {"greedy": {}, "seeded sampling": dict(temperature=0.8, top_p=0.95, seed=1234)}


@pytest.fixture(scope="module")
def references(fleet) -> dict[str, Completion]:
    """The undisturbed runs, greedy and sampled with a seed."""
    runs = {
        name: generate(fleet.coordinators[0].address, make_request(**fields), timeout_s=120)
        for name, fields in SAMPLING.items()
    }
    assert all(len(run.token_ids) > 4 * FAULT_AFTER for run in runs.values()), (
        "the references must be long enough to cut"
    )
    return runs


@pytest.fixture
def reference(references) -> Completion:
    return references["greedy"]


def assert_same_completion(got: Completion, expected: Completion) -> None:
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason


def test_draft_killed_mid_stream(fleet, reference):
    """The request goes on in plain decode without the draft and completes with identical ids;
    once the draft service is back, requests speculate again."""
    stream = stream_with_fault(fleet.coordinators[0].address, make_request(), fleet.draft.kill, FAULT_AFTER)
    RECOVERY_S["the draft service was killed: from the kill to the client's next message"] = stream.recovery_s
    completion = stream.completion
    assert_same_completion(completion, reference)
    assert completion.metrics.num_draft_failures >= 1
    assert completion.metrics.rounds_per_k[0] > 0, "no plain decode round after the draft was lost"
    fleet.restart(fleet.draft)
    assert speculates_again(fleet.coordinators[0].address, make_request(), reference.token_ids)


def test_draft_stopped_mid_stream(fleet, reference):
    """A draft service that stops answering (SIGSTOP) costs the request one Propose deadline (the
    draft's measured cost, floored), not the 30 s RPC deadline: the request completes with
    identical ids, and the longest wait for a message after the stop is reported."""
    try:
        stream = stream_with_fault(
            fleet.coordinators[0].address, make_request(), lambda: fleet.draft.signal(signal.SIGSTOP), FAULT_AFTER
        )
    finally:
        fleet.draft.signal(signal.SIGCONT)
    assert_same_completion(stream.completion, reference)
    assert stream.completion.metrics.num_draft_failures >= 1
    longest_s = stream.longest_wait_s
    RECOVERY_S["the draft service stopped (SIGSTOP): the client's longest wait for a message after it"] = longest_s
    assert longest_s < 10, "the stopped draft held the request for an RPC deadline"
    assert speculates_again(fleet.coordinators[0].address, make_request(), reference.token_ids)  # resumed


@pytest.mark.parametrize("sampling", SAMPLING)
def test_verify_replica_killed_mid_stream(fleet, references, sampling):
    """The session is rebuilt on the other replica from the committed log: identical ids, greedy
    or sampled with a seed."""
    killed = []

    def kill_the_replica_holding_the_session():
        (holder,) = [v for v in fleet.verify if scrape(v.metrics_url)["specdec_num_sessions"] > 0]
        holder.kill()
        killed.append(holder)

    stream = stream_with_fault(
        fleet.coordinators[1].address,
        make_request(**SAMPLING[sampling]),
        kill_the_replica_holding_the_session,
        FAULT_AFTER,
    )
    RECOVERY_S[f"the verify replica was killed ({sampling}): from the kill to the client's next message"] = (
        stream.recovery_s
    )
    assert_same_completion(stream.completion, references[sampling])
    assert stream.completion.metrics.num_verify_rebuilds >= 1
    fleet.restart(killed[0])


@pytest.mark.parametrize("sampling", SAMPLING)
def test_coordinator_killed_mid_stream_resumes_on_another(fleet, references, sampling):
    """The client resumes the request on the second coordinator from the last position it
    received: the concatenation equals the undisturbed run, without gaps or duplicates."""
    first, second, reference = *fleet.coordinators, references[sampling]
    request_id = f"resume-after-kill-{sampling.replace(' ', '-')}"
    services = [fleet.draft, *fleet.verify]
    evicted_before = [scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services]
    received = Completion()
    with pytest.raises(grpc.RpcError) as cut, grpc.insecure_channel(first.address, options=GRPC_OPTIONS) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        for response in stub.Generate(make_request(request_id=request_id, **SAMPLING[sampling]), timeout=120):
            received.add(response)
            if len(received.token_ids) >= FAULT_AFTER and first.process.poll() is None:
                first.kill()
                killed_at = time.monotonic()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    resume = coordinator_pb2.GenerateRequest(request_id=request_id, resume_from=len(received.token_ids))
    rest, recovery_s = Completion(), None
    with grpc.insecure_channel(second.address, options=GRPC_OPTIONS) as channel:
        for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(resume, timeout=120):
            recovery_s = recovery_s or time.monotonic() - killed_at
            rest.add(response)
    RECOVERY_S[
        f"the coordinator was killed, resumed on another ({sampling}): from the kill to the client's next message"
    ] = recovery_s
    assert rest.token_ids and received.token_ids + rest.token_ids == reference.token_ids
    assert received.text + rest.text == reference.text
    assert rest.finish_reason == reference.finish_reason
    assert rest.metrics.num_resumed_tokens >= len(received.token_ids)
    # the resume released the sessions the killed coordinator left (their ids are in the store):
    # none is left for the services' idle eviction (3 s, checked every second)
    time.sleep(max(0.0, killed_at + 5 - time.monotonic()))
    assert [scrape(s.metrics_url)["specdec_sessions_evicted_total"] for s in services] == evicted_before
    assert sum(scrape(s.metrics_url)["specdec_num_sessions"] for s in services) == 0
    fleet.restart(first)


def test_redis_killed_mid_stream(fleet, reference, redis_server):
    """The request finishes from memory; the failures are counted, and once Redis is back new
    requests are stored again."""
    coordinator = fleet.coordinators[0]
    errors_before = scrape(coordinator.metrics_url).get("specdec_session_store_errors_total", 0.0)
    stream = stream_with_fault(
        coordinator.address, make_request(request_id="redis-lost"), redis_server.kill, FAULT_AFTER
    )
    RECOVERY_S["Redis was killed: from the kill to the client's next message"] = stream.recovery_s
    assert_same_completion(stream.completion, reference)
    assert scrape(coordinator.metrics_url)["specdec_session_store_errors_total"] > errors_before
    redis_server.start()  # empty: nothing was persisted
    time.sleep(1.5)  # past the store's back-off after a failure
    later = generate(coordinator.address, make_request(request_id="after-redis-returned"), timeout_s=120)
    assert_same_completion(later, reference)
    deadline = time.monotonic() + 10
    while (
        stored := from_redis(redis_server.url, lambda store: store.load("after-redis-returned"))
    ) is None or stored.status != FINISHED:
        assert time.monotonic() < deadline, "the finished request was not stored after Redis returned"
        time.sleep(0.1)
    assert stored.generated == reference.token_ids


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
    warm-starts its sessions from."""
    request = make_request(request_id="adaptive-estimates")
    request.ClearField("num_speculative_tokens")
    completion = generate(fleet.coordinators[1].address, request, timeout_s=120)
    assert completion.metrics.adaptive and completion.metrics.num_accepted_draft_tokens > 0
    deadline = time.monotonic() + 10
    while "transformers" not in (
        priors := from_redis(redis_server.url, lambda store: store.load_priors(str(tiny_models.target_dir)))
    ):
        assert time.monotonic() < deadline, f"no estimates for the transformers drafter in Redis: {priors}"
        time.sleep(0.1)
    assert {"ngram/1", "ngram/2", "ngram/3"} <= priors.keys()
    assert min(priors["transformers"][:2]) > 0.8  # a self-draft: its first positions always pass

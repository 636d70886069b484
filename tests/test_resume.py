"""Request ids and resuming (GenerateRequest.request_id, resume_from) on the in-process pipeline
(its coordinator keeps requests in its in-process store): a finished request replays from any
position; a running one left in Redis continues with its stored log-probabilities; bad resumes
get their status and a message that says what to change."""

import asyncio
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from coordinator.api.client import Completion, generate, stream
from coordinator.request_store.resume import check_resume
from coordinator.request_store.store import RUNNING, RedisStore, StoredRequest
from coordinator.settings import CoordinatorSettings
from specdec.rpc.errors import FailedPrecondition
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import CoordinatorThread, chat_ids, plain_greedy


def on_pipeline(tiny_pipeline, tiny_models, **fields) -> CoordinatorSettings:
    """A coordinator of its own on the shared in-process services, with ``fields`` (its store)."""
    return CoordinatorSettings(
        port=0,
        draft_address=tiny_pipeline.draft_address,
        verify_addresses=[tiny_pipeline.verify_address],
        tokenizer=str(tiny_models.target_dir),
        **fields,
    )


def request(**fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text="Tell me about tides.", max_new_tokens=24, **fields)


def test_first_message_carries_the_request_id(tiny_pipeline):
    responses = list(stream(tiny_pipeline.address, request(), timeout_s=60))
    assert len(responses[0].request_id) == 32 and not any(r.request_id for r in responses[1:])
    named = list(stream(tiny_pipeline.address, request(request_id="named.1:a-b_c"), timeout_s=60))
    assert named[0].request_id == "named.1:a-b_c"


def test_a_finished_request_resumes_from_any_position(tiny_pipeline):
    whole = generate(tiny_pipeline.address, request(request_id="finished", stop=["."]), timeout_s=60)
    for position in (0, 1, len(whole.token_ids) // 2, len(whole.token_ids)):
        rest = Completion()
        for response in stream(
            tiny_pipeline.address,
            coordinator_pb2.GenerateRequest(request_id="finished", resume_from=position),
            timeout_s=60,
        ):
            rest.add(response)
        assert rest.token_ids == whole.token_ids[position:]
        assert rest.finish_reason == whole.finish_reason and rest.metrics == whole.metrics
        # resending the original fields is allowed, and gives the same
        again = generate(
            tiny_pipeline.address, request(request_id="finished", stop=["."], resume_from=position), timeout_s=60
        )
        assert again.token_ids == rest.token_ids and again.text == rest.text
    replayed = generate(
        tiny_pipeline.address, coordinator_pb2.GenerateRequest(request_id="finished", resume_from=0), timeout_s=60
    )
    assert replayed.text == whole.text


@pytest.fixture(scope="module")
def taken(tiny_pipeline) -> str:
    """The id of a finished request (24 tokens)."""
    generate(tiny_pipeline.address, request(request_id="taken"), timeout_s=60)
    return "taken"


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        (
            dict(text="hi", request_id="bad id!"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id must be 1 to 128 characters",
        ),
        (dict(resume_from=3), grpc.StatusCode.INVALID_ARGUMENT, "resume_from needs the request_id"),
        (
            dict(request_id="taken", resume_from=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "resume_from is -1, below its bound of 0: send the number of tokens already received",
        ),
        (
            dict(request_id="never-started", resume_from=0),
            grpc.StatusCode.NOT_FOUND,
            "send it again without resume_from",
        ),
        (dict(text="hi", request_id="taken"), grpc.StatusCode.ALREADY_EXISTS, "choose another, or set resume_from"),
        (
            dict(text="Tell me about tides.", max_new_tokens=5, request_id="taken", resume_from=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "resend them unchanged",
        ),
        (
            dict(request_id="taken", resume_from=999),
            grpc.StatusCode.INVALID_ARGUMENT,
            "resume_from is 999, beyond its bound: request 'taken' finished after 24 tokens; send the number of "
            "tokens already received, 0 to 24",
        ),
    ],
)
def test_bad_resumes(tiny_pipeline, taken, fields, code, message):
    with pytest.raises(grpc.RpcError) as caught:
        generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(**fields), timeout_s=60)
    assert caught.value.code() == code
    assert message in caught.value.details()


def test_a_running_request_resumes_with_its_stored_logprobs(tiny_pipeline, tiny_models, shared_redis):
    """The record a coordinator that died after 12 tokens left in Redis (one Redis, or a Redis
    Cluster: --redis-cluster): a resume from 5 sends the 7 stored tokens with their stored
    log-probabilities, then the rest with new ones, as the uncut request had them."""
    url, cluster = shared_redis
    settings = on_pipeline(tiny_pipeline, tiny_models, redis_url=url, redis_cluster=cluster)
    coordinator = CoordinatorThread(settings)
    address = f"127.0.0.1:{coordinator.port}"
    try:
        fields = dict(logprobs=True, top_logprobs=2, num_speculative_tokens=2)
        whole = generate(address, request(request_id="uncut", **fields), timeout_s=60)

        async def cut_after(num_tokens: int) -> None:
            errors = Counter("errors", "", ["operation"], registry=CollectorRegistry())
            redis_store = RedisStore(url, 60, errors, cluster=cluster)
            record = await redis_store.load("uncut")
            record.request_id, record.status = "cut", RUNNING
            record.generated, record.logprobs = record.generated[:num_tokens], record.logprobs[:num_tokens]
            await redis_store.put(record)
            await redis_store.close()

        asyncio.run(cut_after(12))
        rest = generate(address, coordinator_pb2.GenerateRequest(request_id="cut", resume_from=5), timeout_s=60)
    finally:
        coordinator.stop()
    assert rest.token_ids == whole.token_ids[5:] and rest.metrics.num_resumed_tokens == 12
    assert rest.logprobs[:7] == whole.logprobs[5:12]  # the stored ones, as they were
    assert [e.logprob for e in rest.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[5:]], abs=1e-4)
    assert [e.top_token_ids for e in rest.logprobs] == [e.top_token_ids for e in whole.logprobs[5:]]


def test_a_record_without_every_tokens_logprobs_is_not_resumed():
    """Part of a record lost (in Redis, under memory pressure): the resumed stream would carry
    tokens without log-probabilities, so the resume fails and says what to do."""
    original = coordinator_pb2.GenerateRequest(text="hi", logprobs=True)
    stored = StoredRequest("x", original, "t", "f", generated=[1, 2], logprobs=[common_pb2.TokenLogprobs()])
    with pytest.raises(FailedPrecondition, match="the log-probabilities of 1: send it again without resume_from"):
        check_resume(coordinator_pb2.GenerateRequest(request_id="x", resume_from=0), stored)


def test_a_request_belongs_to_the_key_that_started_it(tiny_pipeline, tiny_models, redis_server):
    """Key B resuming key A's running request id gets NOT_FOUND worded as for an id never used, and
    A's stream goes on untouched (identical tokens, no session rebuilt); B may use the same id for
    a request of its own; with Redis, so over every coordinator."""
    settings = on_pipeline(tiny_pipeline, tiny_models, redis_url=redis_server.url, api_keys=["ka", "kb"])
    one, two = CoordinatorThread(settings), CoordinatorThread(settings)
    first, second = f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"
    secret = coordinator_pb2.GenerateRequest(
        text="My bank PIN is 4821. Repeat my PIN back to me.", max_new_tokens=256, ignore_eos=True, temperature=0
    )
    # A reads its first message, then nothing while B tries: a 1 KiB window keeps A's request running
    window = [*GRPC_OPTIONS, ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(first, options=window)
    try:
        expected = generate(first, secret, timeout_s=60, api_key="ka")
        owner = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            request_of(secret, request_id="secret-42"), timeout=60, metadata=[("authorization", "Bearer ka")]
        )
        received = Completion()
        received.add(next(owner))
        for where in (first, second):
            for request_id in ("secret-42", "never-used"):
                with pytest.raises(grpc.RpcError) as caught:
                    resume = coordinator_pb2.GenerateRequest(request_id=request_id, resume_from=0)
                    generate(where, resume, timeout_s=60, api_key="kb")
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
                assert caught.value.details() == (
                    f"request {request_id!r} is not in the request store (never started, or its last write was more "
                    "than 3600 s ago): send it again without resume_from"
                )
        for response in owner:
            received.add(response)
        assert received.token_ids == expected.token_ids and received.metrics.num_verify_rebuilds == 0
        theirs = generate(second, request_of(secret, text="Hello.", request_id="secret-42"), timeout_s=60, api_key="kb")
        assert theirs.token_ids != expected.token_ids  # a fresh request of B's, under the same id
        replayed = generate(
            second, coordinator_pb2.GenerateRequest(request_id="secret-42", resume_from=0), timeout_s=60, api_key="ka"
        )
        assert replayed.token_ids == expected.token_ids  # A's own, still
    finally:
        channel.close()
        one.stop()
        two.stop()


def request_of(base: coordinator_pb2.GenerateRequest, **fields) -> coordinator_pb2.GenerateRequest:
    copy = coordinator_pb2.GenerateRequest()
    copy.CopyFrom(base)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def resume_after_outage(address: str, request_id: str, within_s: float = 20.0) -> list[int]:
    """The tokens of ``request_id`` resumed from 0, retried on UNAVAILABLE as a client would (the
    coordinator's store answers UNAVAILABLE for a second after it failed)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            resume = coordinator_pb2.GenerateRequest(request_id=request_id, resume_from=0)
            return list(generate(address, resume, timeout_s=120).token_ids)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.long
def test_a_burst_outlives_a_cluster_masters_death_and_resumes_after_the_failover(
    tiny_pipeline, tiny_models, redis_cluster
):
    """16 requests at once through a coordinator on the Redis Cluster (--redis-cluster), the master
    of one request's slot SIGKILLed once its first tokens have come: all 16 complete with plain
    decoding's output (their journals go on from memory while the slot has no master, and write
    the whole record again once its replica took over), and each resumed from 0 after the
    failover returns its tokens."""
    settings = on_pipeline(tiny_pipeline, tiny_models, redis_url=redis_cluster.url, redis_cluster=True)
    coordinator = CoordinatorThread(settings)
    address = f"127.0.0.1:{coordinator.port}"
    topics = ["tides", "bread", "comets", "glass", "bees", "maps", "rain", "salt"]
    requests = [
        coordinator_pb2.GenerateRequest(
            request_id=f"burst-{i}",
            text=f"Tell me about {topics[i % 8]}, part {i}.",
            max_new_tokens=160,
            ignore_eos=True,
        )
        for i in range(16)
    ]
    first_tokens, results, killed = threading.Event(), {}, None

    def read(message: coordinator_pb2.GenerateRequest) -> None:
        completion = Completion()
        for response in stream(address, message, timeout_s=120):
            completion.add(response)
            first_tokens.set()
        results[message.request_id] = completion

    readers = [threading.Thread(target=read, args=(message,)) for message in requests]
    try:
        for reader in readers:
            reader.start()
        assert first_tokens.wait(60)
        killed = redis_cluster.kill_master("specdec:request:{burst-0}")
        assert len(results) < len(requests)  # mid-burst: requests still running
        for reader in readers:
            reader.join(120)
        redis_cluster.wait_for_failover(killed)
        resumed = {m.request_id: resume_after_outage(address, m.request_id) for m in requests}
    finally:
        coordinator.stop()
        if killed is not None:
            redis_cluster.rejoin(killed)
    assert sorted(results) == sorted(m.request_id for m in requests)
    for message in requests:
        plain = plain_greedy(tiny_pipeline.plain_model, chat_ids(tiny_pipeline.target.tokenizer, message.text), 160)
        assert list(results[message.request_id].token_ids) == plain, message.request_id
        assert list(resumed[message.request_id]) == plain, message.request_id

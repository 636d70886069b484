"""The request store, in Redis and in the process, behind one interface; the request journal that
keeps a request's record there and writes it whole again after Redis comes back empty; and the
text a resumed stream sends."""

import asyncio
import time

import grpc
import pytest
import redis
from google.protobuf.internal import encoder, wire_format
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    MovedError,
    OutOfMemoryError,
    RedisClusterUnreachableError,
    SlotNotCoveredError,
    TryAgainError,
)

from coordinator.api.client import generate
from coordinator.api.output import StreamOutput
from coordinator.request_store.journal import RequestJournal
from coordinator.request_store.store import (
    FINISHED,
    RUNNING,
    RedisStore,
    StoreFull,
    StoreUnavailable,
)
from coordinator.settings import CoordinatorSettings
from specdec.v1 import coordinator_pb2
from tests.conftest import CoordinatorThread, RedisServer, error_counter, record


def test_put_append_load_and_expire(with_store):
    async def scenario(store):
        assert await store.load("missing") is None
        assert await store.append("missing", [1, 2], stored=0) == 0  # nothing to append to: put it again
        original = record("r1", [5, 6])
        await store.put(original)
        assert await store.append("r1", [7, 2**31 - 1], stored=2) == 4
        loaded = await store.load("r1")
        assert loaded.generated == [5, 6, 7, 2**31 - 1]
        assert (loaded.request, loaded.target, loaded.vocab_fingerprint, loaded.status) == (
            original.request,
            "tiny-target",
            "fingerprint",
            RUNNING,
        )
        loaded.status, loaded.finish_reason = FINISHED, coordinator_pb2.FINISH_REASON_STOP
        loaded.metrics = coordinator_pb2.RequestMetrics(num_generated_tokens=4)
        await store.put(loaded)
        finished = await store.load("r1")
        assert finished.status == FINISHED and finished.metrics.num_generated_tokens == 4
        assert finished.finish_reason == coordinator_pb2.FINISH_REASON_STOP
        await asyncio.sleep(2.1)  # Redis expires in whole seconds
        assert await store.load("r1") is None

    with_store(scenario, ttl_s=1)


def test_create_is_atomic(with_store):
    async def scenario(store):
        created = await asyncio.gather(*(store.create(record("contested", [i])) for i in range(5)))
        assert sorted(created) == [False] * 4 + [True]
        winner = await store.load("contested")
        assert winner.generated == [created.index(True)]
        assert not await store.create(record("contested"))

    with_store(scenario)


def test_acceptance_priors_are_shared(with_store):
    async def scenario(store):
        target = f"target-{time.monotonic_ns()}"
        assert await store.load_priors(target) == {}
        await store.save_priors(target, {"llama-cpp": [0.9, 0.8], "ngram/3": [0.5]})
        await store.save_priors(target, {"llama-cpp": [0.7, 0.6]})
        assert await store.load_priors(target) == {"llama-cpp": [0.7, 0.6], "ngram/3": [0.5]}

    with_store(scenario)


def test_acceptance_priors_are_kept_per_owner(with_store):
    async def scenario(store):
        target = f"target-{time.monotonic_ns()}"
        await store.save_priors(target, {"llama-cpp": [0.1]}, owner="ka")
        await store.save_priors(target, {"llama-cpp": [0.9]}, owner="kb")
        assert await store.load_priors(target, "ka") == {"llama-cpp": [0.1]}
        assert await store.load_priors(target, "kb") == {"llama-cpp": [0.9]}
        assert await store.load_priors(target) == {}  # the requests of no owner: none yet

    with_store(scenario)


def test_a_clients_ended_requests_beyond_its_bound_are_dropped_oldest_first(with_store):
    """One client keeps at most max_finished_per_client ended requests: the oldest one's record is
    dropped when another ends; another client's and the running ones are not touched."""

    async def scenario(store):
        store.max_finished_per_client = 3
        for i in range(6):
            journal = RequestJournal(store, record(f"a-{i}", [i]), client="key a")
            assert await journal.create()
            await journal.end(FINISHED)
        other = RequestJournal(store, record("b-0", [1]), client="key b")
        assert await other.create()
        await other.end(FINISHED)
        running = RequestJournal(store, record("a-running"), client="key a")
        assert await running.create()
        await running.commit([7])
        kept = [i for i in range(6) if await store.load(f"a-{i}") is not None]
        assert kept == [3, 4, 5]
        assert (await store.load("b-0")).generated == [1]
        assert (await store.load("a-running")).generated == [7]

    with_store(scenario)


def fill(client: redis.Redis, prefix: str = "") -> list[str]:
    """Makes Redis full: 1 MB more in small values (keys starting with ``prefix``: on a cluster's
    node, a hash tag of its slots), then its maxmemory 256 KiB below what it uses (with the policy
    noeviction it refuses writes that add memory from then on). Returns the keys it added."""
    filler = {f"{prefix}filler:{i}": b"x" * 1000 for i in range(1000)}
    client.mset(filler)
    client.config_set("maxmemory", client.info("memory")["used_memory"] - 262144)
    return list(filler)


@pytest.fixture(params=["redis", "cluster"])
def fillable_redis(request):
    """(url, cluster, fill) of a Redis a test fills with ``fill()``: one of its own, killed
    afterwards, or the session's Redis Cluster, every master filled, then emptied of the filler
    and unbounded again afterwards."""
    if request.param == "redis":
        server = RedisServer()
        server.start()
        yield server.url, False, lambda: fill(server.client())
        server.kill()
        return
    nodes = request.getfixturevalue("redis_cluster")
    filled: dict[RedisServer, list[str]] = {}
    masters = {master: nodes.hash_tag_on(master) for master in nodes.masters()}
    yield nodes.url, True, lambda: filled.update({m: fill(m.client(), tag) for m, tag in masters.items()})
    for master, keys in filled.items():
        master.client().config_set("maxmemory", 0)
        master.client().delete(*keys)


def test_a_full_redis_refuses_new_records_but_not_the_leases(fillable_redis):
    """Redis full (maxmemory, noeviction; on a cluster, every master): a new record gets StoreFull
    (RESOURCE_EXHAUSTED naming the settings), while a running request's record still grows and
    loads, the leases are still taken, renewed and given back, and the store is not taken for
    down after the refusal."""
    url, cluster, fill_it = fillable_redis
    errors = error_counter()

    async def scenario():
        store = RedisStore(url, 60, errors, retry_after_s=30, cluster=cluster)
        try:
            await store.put(record("kept", [1, 2]))
            fill_it()
            with pytest.raises(StoreFull) as full:
                await store.create(record("new"))
            assert await store.acquire_leases("key a", ["l1", "l2"], 2, 30) is None
            assert await store.acquire_leases("key a", ["l3"], 2, 30) == 2  # the limit holds
            await store.renew_leases({"key a": ["l1", "l2"]}, 30)
            await store.release_leases("key a", ["l1"])
            assert await store.acquire_leases("key a", ["l3"], 2, 30) is None
            assert await store.append("kept", [3], {"verify": "s1"}, stored=2) == 3
            loaded = await store.load("kept")
            assert (loaded.generated, loaded.sessions) == ([1, 2, 3], {"verify": "s1"})
            return full.value
        finally:
            await store.close()

    full = asyncio.run(scenario())
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for setting in ("--max-finished-requests-per-client", "--max-stored-request-bytes", "--request-ttl-s"):
        assert setting in str(full)
    assert errors.labels("create")._value.get() == 1
    assert sum(errors.labels(operation)._value.get() for operation in ("append", "load", "acquire_leases")) == 0


@pytest.mark.parametrize(
    "error",
    [
        ClusterDownError("CLUSTERDOWN The cluster is down"),
        MasterDownError("MASTERDOWN Link with MASTER is down"),
        MovedError("3999 127.0.0.1:6381"),
        TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        redis.ConnectionError("Error 111 connecting to 127.0.0.1:6381"),
        redis.TimeoutError("Timeout reading from 127.0.0.1:6381"),
        RedisClusterUnreachableError("Redis Cluster cannot be connected"),
        SlotNotCoveredError("Slot 3999 is not covered by the cluster"),
        OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_clusters_failures_make_the_store_unavailable_and_a_full_node_full(error, monkeypatch):
    """What a Redis Cluster answers while it fails over or reshards, and the cluster client's own
    errors, are StoreUnavailable (UNAVAILABLE: the caller goes on without the store); a full
    node's refusal is StoreFull (RESOURCE_EXHAUSTED)."""

    async def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(RedisCluster, "hgetall", fail)

    async def scenario():
        store = RedisStore("redis://127.0.0.1:6381/0", 60, error_counter(), cluster=True)
        try:
            await store.load_priors("target")
        finally:
            await store.close()

    with pytest.raises(StoreUnavailable) as raised:
        asyncio.run(scenario())
    assert isinstance(raised.value, StoreFull) == isinstance(error, OutOfMemoryError)


def test_resumed_text_continues_exactly(smollm2_tokenizer):
    """For every max_new_tokens and every resume position p, the text a first stream sent with
    its first p tokens (in messages of 3 tokens) plus what a resumed stream sends from p equals
    the whole text: with stop strings (one held back as a possible stop string when the length
    runs out), and characters split over tokens."""
    tokenizer = smollm2_tokenizer
    prompt = tokenizer("Say something.").input_ids
    ids = tokenizer("Zürich — “quotes”, 🚀 and a word; then more text STOP end", add_special_tokens=False).input_ids
    stop = ["STOP", "; thenX"]

    def stream(max_new: int, emit_from: int, upto: int, every: int) -> tuple[list[int], str, int]:
        """What a stream sends for ``ids[:upto]`` in messages of ``every`` tokens."""
        output = StreamOutput(tokenizer, prompt, stop, (), max_new, emit_from)
        sent_ids, text = [], ""
        for start in range(0, upto, every):
            response = output.response(output.add(ids[start : min(start + every, upto)]))
            if response:
                sent_ids += response.token_ids
                text += response.text
            if output.finish:
                break
        return sent_ids, text, output.finish

    finishes = set()
    for max_new in range(1, len(ids) + 1):
        whole_ids, whole_text, finish = stream(max_new, 0, len(ids), 1)
        finishes.add(finish)
        for p in range(len(whole_ids) + 1):
            first_ids, first_text, _ = stream(max_new, 0, p, 3)
            rest_ids, rest_text, _ = stream(max_new, p, len(ids), 5)
            assert first_ids + rest_ids == whole_ids, (max_new, p)
            assert first_text + rest_text == whole_text, (max_new, p)
    assert finishes == {coordinator_pb2.FINISH_REASON_STOP, coordinator_pb2.FINISH_REASON_LENGTH}
    assert "STOP" not in whole_text and "🚀" in whole_text


# --- through a real coordinator ------------------------------------------------------------------


def unknown_field(number: int, size: int) -> bytes:
    """A length-delimited protobuf field that GenerateRequest does not define, ``size`` bytes of payload."""
    return encoder.TagBytes(number, wire_format.WIRETYPE_LENGTH_DELIMITED) + encoder._VarintBytes(size) + b"x" * size


def generate_raw(address: str, message: bytes) -> list[coordinator_pb2.GenerateResponse]:
    """A Generate call whose request is ``message`` as given (any bytes a client may send)."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
        call = channel.unary_stream(
            "/specdec.v1.CoordinatorService/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=coordinator_pb2.GenerateResponse.FromString,
        )
        return list(call(message, timeout=60))


def test_unknown_fields_are_not_stored_and_the_stored_size_is_bounded(tiny_pipeline, tiny_models, redis_server):
    """A GenerateRequest carrying 4 MB of fields it does not define is served and stored without
    them (it was stored whole, 4 MB, written at its start and again at its end); a request whose
    known fields pass max_stored_request_bytes gets INVALID_ARGUMENT naming the setting, before
    any work."""
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=tiny_pipeline.draft_address,
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            redis_url=redis_server.url,
            max_stored_request_bytes=4096,
        )
    )
    address = f"127.0.0.1:{coordinator.port}"
    request = coordinator_pb2.GenerateRequest(
        request_id="padded", text="hi", max_new_tokens=8, ignore_eos=True, num_speculative_tokens=0
    )
    try:
        responses = generate_raw(address, request.SerializeToString() + unknown_field(999, 4_000_000))
        assert sum(len(response.token_ids) for response in responses) == 8
        stored = redis_server.client().hget("specdec:request:{padded}", "request")
        assert len(stored) < 100, len(stored)
        with pytest.raises(grpc.RpcError) as refused:
            generate(address, coordinator_pb2.GenerateRequest(text="hi " * 2000, max_new_tokens=8), timeout_s=60)
    finally:
        coordinator.stop()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_stored_request_bytes" in refused.value.details()
    assert "--max-stored-request-bytes" in refused.value.details()


def test_a_records_own_claim_is_not_another_requests(with_store):
    """A create whose answer was lost (the store went away after writing it) is tried again by the
    journal: the record's own claim lets it through; another request's with the same id does not."""

    async def scenario(store):
        first = record("claimed")
        assert await store.create(first)
        assert await store.create(first)  # its own claim, tried again
        assert not await store.create(record("claimed"))  # another request of the same id
        assert (await store.load("claimed")).claim == first.claim

    with_store(scenario)

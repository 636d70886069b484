"""Admission (:mod:`coordinator.api.admission`): the per-client limit over every coordinator sharing
a request store, the fair queue of requests waiting for room on a full verify service, and
streams whose clients stop reading; the algorithms alone first (the limit's store in the process, in
Redis and in a Redis Cluster), then through real coordinators, services and Redis."""

import asyncio
import json
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from coordinator.api.admission import ClientLimit, FairQueue, Overloaded
from coordinator.api.auth import owner_hash
from coordinator.api.client import generate
from coordinator.request_store.store import MemoryStore, RedisStore
from coordinator.settings import CoordinatorSettings
from specdec.engine.models import load_causal_lm
from specdec.rpc.errors import ResourceExhausted
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.conftest import CoordinatorThread, RedisServer, chat_ids, plain_greedy
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings
from verify_service.target import Target

KEYS = ["key-a", "key-b"]


def fair_queue(max_queued: int = 16, timeout_s: float = 5.0, retry_s: float = 0.02) -> FairQueue:
    registry = CollectorRegistry()
    return FairQueue(
        max_queued,
        timeout_s,
        Gauge("waiting", "", registry=registry),
        Histogram("wait", "", registry=registry),
        retry_s=retry_s,
    )


class Room:
    """A verify service with ``free`` sessions: an attempt takes one or is refused at once."""

    def __init__(self, free: int):
        self.free, self.order = free, []

    def attempt(self, name: str):
        async def run():
            if self.free <= 0:
                raise ResourceExhausted("every replica is full")
            self.free -= 1
            self.order.append(name)
            return name

        return run


async def settle() -> None:
    """Lets the event loop run every callback that is ready, however loaded the host: the queue's
    tries after :meth:`FairQueue.room` chain through ready callbacks, with no timer between them."""
    for _ in range(200):
        await asyncio.sleep(0)


def test_waiting_requests_get_in_round_robin_by_client():
    async def scenario():
        # no tick within the test: room appears only where the test says, never mid-way through a
        # round of tries (a tick and the test's room at once could let the second client in first)
        queue, room = fair_queue(retry_s=60.0), Room(free=0)
        requests = [("a", f"a{i}") for i in range(4)] + [("b", f"b{i}") for i in range(2)]
        tasks = []
        for client, name in requests:
            tasks.append(asyncio.ensure_future(queue.run(client, room.attempt(name))))
            await settle()  # they arrive in this order
        assert len(queue) == 6
        for _ in range(6):  # room for one more at a time
            room.free += 1
            queue.room()
            await settle()
        await asyncio.gather(*tasks)
        return room.order, len(queue)

    order, left = asyncio.run(scenario())
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"] and left == 0


def test_nobody_takes_room_ahead_of_those_waiting():
    async def scenario():
        queue, room = fair_queue(), Room(free=0)
        waiting = asyncio.ensure_future(queue.run("a", room.attempt("waiting")))
        await asyncio.sleep(0.01)
        room.free = 1  # room appears, and a new request arrives before the retry
        newcomer = asyncio.ensure_future(queue.run("b", room.attempt("newcomer")))
        await asyncio.sleep(0.1)
        room.free += 1
        await asyncio.gather(waiting, newcomer)
        return room.order

    assert asyncio.run(scenario()) == ["waiting", "newcomer"]


def test_queue_bounds_refuse_with_the_setting():
    async def scenario():
        queue, room = fair_queue(max_queued=1, timeout_s=0.2), Room(free=0)
        first = asyncio.ensure_future(queue.run("a", room.attempt("first")))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="max_queued_requests") as full:
            await queue.run("b", room.attempt("second"))
        with pytest.raises(Overloaded, match="queue_timeout_s") as late:
            await first
        return full.value, late.value, len(queue)

    full, late, left = asyncio.run(scenario())
    assert full.retry_after == "1" and late.retry_after >= "1" and left == 0


def test_a_cancelled_waiter_leaves_the_queue():
    async def scenario():
        queue, room = fair_queue(), Room(free=0)
        task = asyncio.ensure_future(queue.run("a", room.attempt("gone")))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return len(queue)

    assert asyncio.run(scenario()) == 0


def redis_of(request, backend: str) -> tuple[str, bool] | None:
    """(url, cluster) of the Redis of ``backend``, started before the test's event loop runs: the
    module's Redis ("redis") or the session's Redis Cluster ("cluster"); None for "memory"."""
    if backend == "memory":
        return None
    cluster = backend == "cluster"
    return request.getfixturevalue("redis_cluster" if cluster else "redis_server").url, cluster


async def stores(redis: tuple[str, bool] | None):
    """Two coordinators' stores: one MemoryStore without ``redis`` (one coordinator's: both limits
    share it), else two RedisStores on it (:func:`redis_of`), each connected already: a cluster
    client's first call learns the cluster's topology and commands, which holds the event loop for
    tens of milliseconds (hundreds on a loaded machine), longer than the leases' renewal can wait
    in these tests."""
    if redis is None:
        store = MemoryStore(60)
        return store, store
    url, cluster = redis
    errors = Counter("errors", "", ["operation"], registry=CollectorRegistry())
    both = RedisStore(url, 60, errors, cluster=cluster), RedisStore(url, 60, errors, cluster=cluster)
    for store in both:
        await store.load_priors("warm-up")
    return both


async def drain(limit: ClientLimit, client: str, n: int = 1, hold: asyncio.Event | None = None) -> None:
    async def responses():
        yield "token"
        if hold is not None:
            await hold.wait()

    async for _ in limit.run(client, responses(), n):
        pass


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.mark.parametrize("backend", ["memory", "redis", "cluster"])
def test_client_limit_counts_over_every_coordinator_of_a_store(backend, request):
    redis = redis_of(request, backend)

    async def scenario():
        first_store, second_store = await stores(redis)
        one, two = ClientLimit(first_store, 3), ClientLimit(second_store, 3)
        client = f"key {backend}-a"
        hold = asyncio.Event()
        running = [
            asyncio.ensure_future(drain(one, client, 2, hold)),
            asyncio.ensure_future(drain(two, client, hold=hold)),
        ]
        await asyncio.sleep(0.1)
        with pytest.raises(Overloaded, match="already runs 3 requests and asks for 1 more") as refused:
            await drain(two, client)
        await drain(two, f"key {backend}-b")  # another client
        hold.set()
        await asyncio.gather(*running)
        await drain(one, client, 3)  # the leases came back
        one.close(), two.close()
        return refused.value

    assert "max_streams_per_client" in str(asyncio.run(scenario()))


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_a_dead_coordinators_leases_expire(backend, request):
    redis = redis_of(request, backend)

    async def scenario():
        first_store, second_store = await stores(redis)
        dead = ClientLimit(first_store, 1, lease_ttl_s=0.3)
        await first_store.acquire_leases("key gone", ["lease"], 1, 0.3)  # held by a coordinator that died
        alive = ClientLimit(second_store, 1)
        with pytest.raises(Overloaded):
            await drain(alive, "key gone")
        await asyncio.sleep(0.4)
        await drain(alive, "key gone")
        dead.close(), alive.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "cluster"])
def test_while_the_store_is_down_each_coordinator_admits_its_share(cluster):
    """Redis unreachable (one Redis, or every node of a Redis Cluster): each of two coordinators
    (max_coordinator_replicas = 2) admits 2 // 2 = 1 of a client's requests, so the client runs 2,
    its limit, not 2 on each; the refusal names both settings."""
    errors = Counter("errors", "", ["operation"], registry=CollectorRegistry())
    dead = RedisServer()  # never started: nothing listens on its port

    async def scenario():
        stores = [RedisStore(dead.url, 60, errors, timeout_s=0.2, cluster=cluster) for _ in range(2)]
        limits = [ClientLimit(store, 2, replicas=2) for store in stores]
        hold = asyncio.Event()
        running = [asyncio.ensure_future(drain(limit, "key a", hold=hold)) for limit in limits]
        await asyncio.sleep(0.3)
        refusals = []
        for limit in limits:
            with pytest.raises(Overloaded) as refused:
                await drain(limit, "key a")
            refusals.append(str(refused.value))
        await drain(limits[0], "key b")  # another client has its own share
        hold.set()
        await asyncio.gather(*running)
        for limit, store in zip(limits, stores, strict=True):
            limit.close()
            await store.close()
        return refusals

    for refusal in asyncio.run(scenario()):
        assert "cannot be reached" in refusal and "max_coordinator_replicas" in refusal, refusal


@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_leases_are_renewed_while_a_request_runs(backend, request):
    redis = redis_of(request, backend)

    async def scenario():
        first_store, second_store = await stores(redis)
        one, two = ClientLimit(first_store, 1, lease_ttl_s=0.3), ClientLimit(second_store, 1, lease_ttl_s=0.3)
        hold = asyncio.Event()
        running = asyncio.ensure_future(drain(one, "key long", 1, hold))
        await asyncio.sleep(0.8)  # past the lease's life: renewed meanwhile
        with pytest.raises(Overloaded):
            await drain(two, "key long")
        hold.set()
        await running
        one.close(), two.close()

    asyncio.run(scenario())


# --- through real coordinators and services ------------------------------------------------------


def coordinator(tiny_models, verify_address: str, draft_address: str, **fields) -> CoordinatorThread:
    return CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=draft_address,
            verify_addresses=[verify_address],
            tokenizer=str(tiny_models.target_dir),
            api_keys=KEYS,
            max_new_tokens_limit=256,
            **fields,
        )
    )


def stalled_stream(address: str, request, api_key: str):
    """A Generate stream whose client reads its first message and then nothing: a channel that
    lets the server send little ahead (a 1 KiB window, no growth)."""
    options = [*GRPC_OPTIONS, ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(address, options=options)
    call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
        request, timeout=60, metadata=[("authorization", f"Bearer {api_key}")]
    )
    assert next(call).token_ids
    return channel, call


def test_a_client_over_its_share_on_two_coordinators_leaves_room_for_others(tiny_pipeline, tiny_models, redis_server):
    """Key A opens more streams than its share across two coordinators and stops reading: its
    extra request gets RESOURCE_EXHAUSTED naming the setting, key B still gets its tokens, and A's
    stalled streams are cut and their sessions released after the stall bound."""
    fields = dict(redis_url=redis_server.url, max_streams_per_client=3, stream_stall_timeout_s=2.0)
    pipeline = tiny_pipeline
    one = coordinator(tiny_models, pipeline.verify_address, pipeline.draft_address, **fields)
    two = coordinator(tiny_models, pipeline.verify_address, pipeline.draft_address, **fields)
    long = coordinator_pb2.GenerateRequest(
        text="Tell me everything.", max_new_tokens=256, ignore_eos=True, num_speculative_tokens=0
    )
    held = []
    try:
        for port in (one.port, one.port, two.port):
            held.append(stalled_stream(f"127.0.0.1:{port}", long, KEYS[0]))
        assert len(pipeline.verify.servicer.sessions) == 3
        with pytest.raises(grpc.RpcError) as caught:
            generate(f"127.0.0.1:{two.port}", long, timeout_s=60, api_key=KEYS[0])
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_client" in caught.value.details()
        short = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=8, ignore_eos=True)
        for port in (one.port, two.port):
            assert len(generate(f"127.0.0.1:{port}", short, timeout_s=60, api_key=KEYS[1]).token_ids) == 8
        deadline = time.monotonic() + 15
        while len(pipeline.verify.servicer.sessions):  # cut after 2 s of no reading
            assert time.monotonic() < deadline, "the stalled streams kept their sessions"
            time.sleep(0.1)
        assert len(generate(f"127.0.0.1:{one.port}", short, timeout_s=60, api_key=KEYS[0]).token_ids) == 8
        for _, call in held:  # each was cut short, not finished
            with pytest.raises(grpc.RpcError) as cut:
                received = sum(len(response.token_ids) for response in call)
                pytest.fail(f"the stream ended normally after {received} more tokens")
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "stream_stall_timeout_s" in cut.value.details()
    finally:
        for channel, call in held:
            call.cancel()
            channel.close()
        one.stop()
        two.stop()


@pytest.fixture(scope="module")
def small_verify(tiny_models):
    """A verify service of the tiny target with room for two sessions."""
    model, tokenizer = load_causal_lm(str(tiny_models.target_dir), dtype="float32")
    target = Target(model, tokenizer, str(tiny_models.target_dir), max_num_speculative_tokens=16)
    target.measure_costs()
    service = build_verify(VerifySettings(port=0, max_sessions=2), target=target)
    yield f"127.0.0.1:{service.port}"
    service.stop(0)


def test_a_full_verify_service_queues_requests_fairly(tiny_pipeline, tiny_models, small_verify, plain_target_model):
    """Two sessions of room, key A sends six requests and key B two just after: nobody gets
    RESOURCE_EXHAUSTED, every output equals plain decoding, and B's requests get in between A's
    rather than after all of them."""
    thread = coordinator(tiny_models, small_verify, tiny_pipeline.draft_address)
    address = f"127.0.0.1:{thread.port}"
    finished: list[str] = []
    outputs: dict[str, list[int]] = {}
    errors: list[Exception] = []

    def run(name: str, key: str, prompt: str) -> None:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=48, ignore_eos=True, temperature=0)
        try:
            outputs[name] = generate(address, request, timeout_s=120, api_key=key).token_ids
            finished.append(name)
        except grpc.RpcError as err:
            errors.append(err)

    prompts = {f"a{i}": f"Story number {i}." for i in range(6)} | {f"b{i}": f"Poem number {i}." for i in range(2)}
    threads = []
    try:
        for name, prompt in prompts.items():
            threads.append(threading.Thread(target=run, args=(name, KEYS[name[0] == "b"], prompt)))
            threads[-1].start()
            time.sleep(0.05)
        for worker in threads:
            worker.join(180)
    finally:
        thread.stop()
    assert not errors, errors
    assert max(finished.index("b0"), finished.index("b1")) < finished.index("a5"), finished
    tokenizer = tiny_pipeline.target.tokenizer
    for name, prompt in prompts.items():
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert outputs[name] == plain_greedy(plain_target_model, list(ids), 48), name


def test_one_key_filling_the_store_leaves_another_key_its_resume_and_its_limit(tiny_pipeline, tiny_models):
    """Key A sends request after request with the largest records it may (a long prompt, every
    token's 20 most likely alternatives) to two coordinators sharing a Redis that has room for
    about 1 MB more (maxmemory, noeviction: nothing evicted), more than that in all: A keeps at
    most its running and max_finished_requests_per_client ended records, Redis never fills, and
    key B still resumes its request, starts new ones on both coordinators and is held to its own
    limit over both."""
    store = RedisServer()
    store.start()
    fields = dict(
        redis_url=store.url,
        max_streams_per_client=2,
        max_coordinator_replicas=2,
        max_finished_requests_per_client=4,
        stream_stall_timeout_s=30.0,
    )
    one = coordinator(tiny_models, tiny_pipeline.verify_address, tiny_pipeline.draft_address, **fields)
    two = coordinator(tiny_models, tiny_pipeline.verify_address, tiny_pipeline.draft_address, **fields)
    addresses = [f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"]
    short = coordinator_pb2.GenerateRequest(text="Hello there.", max_new_tokens=16, ignore_eos=True, temperature=0)
    held = []
    try:
        b_request = coordinator_pb2.GenerateRequest(request_id="b-kept")
        b_request.MergeFrom(short)
        b_tokens = generate(addresses[0], b_request, timeout_s=60, api_key=KEYS[1]).token_ids
        client = store.client()
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 1_000_000)
        largest = coordinator_pb2.GenerateRequest(
            text="word " * 350, max_new_tokens=128, ignore_eos=True, logprobs=True, top_logprobs=20
        )

        errors: list[grpc.RpcError] = []

        def flood(address: str) -> None:
            for _ in range(30):
                try:
                    generate(address, largest, timeout_s=60, api_key=KEYS[0])
                except grpc.RpcError as err:
                    errors.append(err)

        floods = [threading.Thread(target=flood, args=(address,)) for address in addresses]
        for thread in floods:
            thread.start()
        for thread in floods:
            thread.join(300)
        owner_a = owner_hash(KEYS[0])
        assert not errors, errors
        assert len(client.keys(f"specdec:request:{{{owner_a}/*}}")) <= 2 + 4
        resume = coordinator_pb2.GenerateRequest(request_id="b-kept", resume_from=3)
        assert generate(addresses[1], resume, timeout_s=60, api_key=KEYS[1]).token_ids == b_tokens[3:]
        for address in addresses:
            assert len(generate(address, short, timeout_s=60, api_key=KEYS[1]).token_ids) == 16
        long = coordinator_pb2.GenerateRequest(text="Go on.", max_new_tokens=256, ignore_eos=True)
        for address in addresses:
            held.append(stalled_stream(address, long, KEYS[1]))
        for address in addresses:
            with pytest.raises(grpc.RpcError) as refused:
                generate(address, short, timeout_s=60, api_key=KEYS[1])
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams_per_client" in refused.value.details()
    finally:
        for channel, call in held:
            call.cancel()
            channel.close()
        one.stop()
        two.stop()
        store.kill()


def test_a_client_reading_just_under_the_stall_bound_is_cut_by_its_total_wait(tiny_pipeline, tiny_models):
    """A client with a 1 KiB window that reads a message every 0.5 s: its messages (every token's
    20 likeliest alternatives) fill the window, so each write waits about 2 s for it, under the
    5 s stall bound of one message, and the request would hold its sessions for minutes (41
    tokens in 20 s without the bound). Past max_stream_wait_s (3 s) of waiting in all, the stream
    is cut (UNAVAILABLE naming the setting) and its sessions released."""
    thread = coordinator(
        tiny_models,
        tiny_pipeline.verify_address,
        tiny_pipeline.draft_address,
        stream_stall_timeout_s=5.0,
        max_stream_wait_s=3.0,
    )
    long = coordinator_pb2.GenerateRequest(
        text="Tell me everything.",
        max_new_tokens=256,
        ignore_eos=True,
        num_speculative_tokens=0,
        logprobs=True,
        top_logprobs=20,
    )
    channel, call = stalled_stream(f"127.0.0.1:{thread.port}", long, KEYS[0])
    start, received = time.monotonic(), 0
    try:
        with pytest.raises(grpc.RpcError) as cut:
            for response in call:
                received += len(response.token_ids)
                assert time.monotonic() - start < 20, f"the slow reader held its request for 20 s ({received} tokens)"
                time.sleep(0.5)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "max_stream_wait_s" in cut.value.details()
        deadline = time.monotonic() + 5
        while len(tiny_pipeline.verify.servicer.sessions):
            assert time.monotonic() < deadline, "the cut stream kept its session"
            time.sleep(0.1)
    finally:
        call.cancel()
        channel.close()
        thread.stop()


def test_a_key_on_two_coordinators_gets_no_more_than_a_key_on_one(tiny_pipeline, tiny_models, small_verify):
    """Two sessions of room on the verify service; key A sends from two clients to each of two
    coordinators, key B from two clients to one of them, short requests back to back for 10 s.
    The verify service keeps the room that appears for the key holding fewer sessions, so A is
    admitted about as often as B, not about twice as often (each coordinator's queue is its own).
    The bound sits between the two, at 1.6x: on a slow host each key completes 11-16 requests in
    the 10 s, and A read 1.45x B once from that noise alone."""
    one = coordinator(tiny_models, small_verify, tiny_pipeline.draft_address)
    two = coordinator(tiny_models, small_verify, tiny_pipeline.draft_address)
    request = coordinator_pb2.GenerateRequest(text="Hi.", max_new_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    done = {"a": 0, "b": 0}
    errors: list[grpc.RpcError] = []
    stop = time.monotonic() + 10

    def client(key: str, port: int) -> None:
        while time.monotonic() < stop:
            try:
                generate(f"127.0.0.1:{port}", request, timeout_s=60, api_key=KEYS[key == "b"])
                done[key] += 1
            except grpc.RpcError as err:
                errors.append(err)

    ports = [("a", one.port), ("a", one.port), ("a", two.port), ("a", two.port), ("b", one.port), ("b", one.port)]
    threads = [threading.Thread(target=client, args=target) for target in ports]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        one.stop()
        two.stop()
    assert not errors, errors
    assert done["b"] >= 10 and done["a"] <= 1.6 * done["b"], done


def test_a_rebuilt_session_waits_its_turn_behind_those_waiting(
    tiny_pipeline, tiny_models, small_verify, redis_server, plain_target_model
):
    """Two sessions of room, both taken (key A's stalled stream, key B's long request), and key A's
    short request waiting in the queue. B's session is lost (released on the verify service): its
    rebuild queues behind A's waiting request, which gets the room first, instead of taking the
    room at once; B then finishes with one rebuild and its plain output."""
    thread = coordinator(tiny_models, small_verify, tiny_pipeline.draft_address, redis_url=redis_server.url)
    address = f"127.0.0.1:{thread.port}"
    stalled = stalled_stream(address, coordinator_pb2.GenerateRequest(text="Go on.", max_new_tokens=256), KEYS[0])
    times: dict[str, list[float]] = {"b": [], "a": []}
    results: dict[str, coordinator_pb2.GenerateResponse] = {}
    b_request = coordinator_pb2.GenerateRequest(
        request_id="b-long", text="A long tale.", max_new_tokens=256, ignore_eos=True, num_speculative_tokens=0
    )

    def read(name: str, request, key: str) -> None:
        tokens = []
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
                request, timeout=120, metadata=[("authorization", f"Bearer {key}")]
            )
            for response in call:
                times[name].append(time.monotonic())
                tokens.extend(response.token_ids)
                if response.HasField("metrics"):
                    results[name] = coordinator_pb2.GenerateResponse(token_ids=tokens, metrics=response.metrics)

    short = coordinator_pb2.GenerateRequest(text="Hi.", max_new_tokens=16, ignore_eos=True, num_speculative_tokens=0)
    readers = [threading.Thread(target=read, args=("b", b_request, KEYS[1]))]
    try:
        readers[0].start()
        deadline = time.monotonic() + 60
        while len(times["b"]) < 5:
            assert time.monotonic() < deadline, "B's long request got no room beside A's stalled stream"
            time.sleep(0.01)
        readers.append(threading.Thread(target=read, args=("a", short, KEYS[0])))
        readers[1].start()
        time.sleep(0.3)  # A's short request waits in the queue
        assert not times["a"] and b_request.max_new_tokens > len(times["b"]) > 5
        record = redis_server.client().hget(f"specdec:request:{{{owner_hash(KEYS[1])}/b-long}}", "sessions")
        with grpc.insecure_channel(small_verify, options=GRPC_OPTIONS) as channel:
            verify_pb2_grpc.VerifyServiceStub(channel).Release(
                verify_pb2.VerifyServiceReleaseRequest(session_id=json.loads(record)["verify"]), timeout=10
            )
        for reader in readers:
            reader.join(120)
    finally:
        stalled[1].cancel()
        stalled[0].close()
        thread.stop()
    gaps = [later - earlier for earlier, later in zip(times["b"], times["b"][1:], strict=False)]
    b_resumed = times["b"][gaps.index(max(gaps)) + 1]  # B's first message from its rebuilt session
    assert times["a"][0] < b_resumed, "the rebuilt session took the room ahead of the waiting request"
    assert results["b"].metrics.num_verify_rebuilds == 1
    prompt = chat_ids(tiny_pipeline.target.tokenizer, "A long tale.")
    assert list(results["b"].token_ids) == plain_greedy(plain_target_model, prompt, 256)

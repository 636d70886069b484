"""The request store, in Redis and in the process, behind one interface; the request journal that
keeps a request's record there and writes it whole again after Redis comes back empty; and the
text a resumed stream sends."""

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from coordinator.api.output import StreamOutput
from coordinator.request_store.store import (
    FINISHED,
    RUNNING,
    MemoryStore,
    RedisStore,
    RequestJournal,
    StoredRequest,
    StoreUnavailable,
)
from specdec.v1 import common_pb2, coordinator_pb2


def error_counter() -> Counter:
    return Counter("store_errors", "", ["operation"], registry=CollectorRegistry())


def record(request_id: str, generated=()) -> StoredRequest:
    request = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=8, seed=7, stop=["\n"])
    return StoredRequest(request_id, request, "tiny-target", "fingerprint", generated=list(generated))


@pytest.fixture(params=["redis", "memory"])
def with_store(request, redis_server):
    """Runs ``scenario(store)`` with a store of the parameter's kind, closed afterwards."""

    def run(scenario, ttl_s: float = 60.0) -> None:
        async def main():
            store = (
                RedisStore(redis_server.url, ttl_s, error_counter()) if request.param == "redis" else MemoryStore(ttl_s)
            )
            try:
                await scenario(store)
            finally:
                await store.close()

        asyncio.run(main())

    return run


def test_put_append_load_and_expire(with_store):
    async def scenario(store):
        assert await store.load("missing") is None
        assert await store.append("missing", [1, 2]) == 0  # nothing to append to: put it again
        original = record("r1", [5, 6])
        await store.put(original)
        assert await store.append("r1", [7, 2**31 - 1]) == 4
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


def test_journal_keeps_the_ids_of_the_sessions_a_running_request_holds(with_store):
    """Written when they change (a resume on another coordinator releases them), cleared at the end."""

    async def scenario(store):
        journal = RequestJournal(store, record("r-sessions"))
        assert await journal.create()
        await journal.commit([1], {"verify": "s.v1", "draft": "s.d2"})
        assert (await store.load("r-sessions")).sessions == {"verify": "s.v1", "draft": "s.d2"}
        await journal.commit([2], {"verify": "s.v3", "draft": "s.d2"})  # the verify session was rebuilt
        await journal.commit([3], {"verify": "s.v3", "draft": "s.d2"})
        loaded = await store.load("r-sessions")
        assert loaded.sessions == {"verify": "s.v3", "draft": "s.d2"} and loaded.generated == [1, 2, 3]
        await journal.end(FINISHED)
        assert (await store.load("r-sessions")).sessions == {}

    with_store(scenario)


def test_journal_keeps_each_tokens_logprobs_and_the_choice(with_store):
    """Appended with their tokens (in Redis: protobuf bytes that append to a list) and written
    whole again at the end; a request without logprobs stores none."""
    entries = [common_pb2.TokenLogprobs(logprob=-i, top_token_ids=[i, 9], top_logprobs=[-i, -9]) for i in range(5)]

    async def scenario(store):
        journal = RequestJournal(store, StoredRequest("r-logprobs", record("").request, "t", "f", choice=2))
        assert await journal.create()
        await journal.commit([0, 1], {"verify": "s.v1"}, entries[:2])
        await journal.commit([2], {"verify": "s.v1"}, entries[2:3])
        loaded = await store.load("r-logprobs")
        assert (loaded.generated, loaded.logprobs, loaded.choice) == ([0, 1, 2], entries[:3], 2)
        await journal.commit([3, 4], None, entries[3:])
        await journal.end(FINISHED)
        assert (await store.load("r-logprobs")).logprobs == entries
        await store.put(record("r-none", [1, 2]))
        assert (await store.load("r-none")).logprobs == []

    with_store(scenario)


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


def test_journal_survives_redis_loss_and_rewrites_the_record(redis_server):
    """While Redis is down the journal's writes fail (counted, not raised); the first write after
    it returns, empty, puts the whole record back."""
    errors = error_counter()

    async def scenario():
        store = RedisStore(redis_server.url, 60, errors, retry_after_s=0.2)
        journal = RequestJournal(store, record("journal"))
        await journal.commit([1, 2, 3])
        redis_server.kill()
        await journal.commit([4])  # fails, counted
        with pytest.raises(StoreUnavailable):  # within the back-off: refused without a connection attempt
            await store.load("journal")
        redis_server.start()
        await asyncio.sleep(0.3)
        await journal.commit([5])
        loaded = await store.load("journal")
        await journal.end(FINISHED, coordinator_pb2.FINISH_REASON_LENGTH, coordinator_pb2.RequestMetrics())
        finished = await store.load("journal")
        await store.close()
        return loaded, finished

    loaded, finished = asyncio.run(scenario())
    assert loaded.generated == [1, 2, 3, 4, 5] and loaded.request.seed == 7
    assert finished.status == FINISHED and finished.generated == [1, 2, 3, 4, 5]
    assert errors.labels("append")._value.get() >= 1 and errors.labels("load")._value.get() == 1


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

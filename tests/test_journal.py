"""coordinator.request_store.journal: a running request's record kept in the store round by round,
written whole again after Redis comes back empty (or a cluster's replica takes over from its master), never
over another request's of the same id."""

import asyncio

import pytest

from coordinator.request_store.journal import RequestJournal
from coordinator.request_store.store import FINISHED, RUNNING, RedisStore, StoredRequest, StoreUnavailable
from specdec.v1 import common_pb2, coordinator_pb2
from tests.conftest import error_counter, record


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


def test_journal_survives_the_stores_loss_and_rewrites_the_record(store_outage):
    """While the store is down (one Redis killed; or the cluster master of the record's slot killed,
    until its replica is promoted) the journal's writes fail (counted, not raised); the first write
    after it answers again puts the whole record back (into a Redis started again empty; over what
    the promoted replica held)."""
    errors = error_counter()

    async def scenario():
        store = RedisStore(store_outage.url, 60, errors, retry_after_s=0.2, cluster=store_outage.cluster)
        journal = RequestJournal(store, record("journal"))
        await journal.commit([1, 2, 3])
        store_outage.begin("journal")
        await journal.commit([4])  # fails, counted
        with pytest.raises(StoreUnavailable):  # within the back-off: refused without a connection attempt
            await store.load("journal")
        store_outage.end()
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


def test_create_never_claims_an_id_it_could_not_check(store_outage):
    """Two requests of one id started while the store is down: create answers None (unchecked),
    not True; when the store is back the first to write claims the id and the other never writes
    over it."""

    async def scenario():
        store = RedisStore(store_outage.url, 60, error_counter(), retry_after_s=0.2, cluster=store_outage.cluster)
        first, second = RequestJournal(store, record("twice")), RequestJournal(store, record("twice"))
        store_outage.begin("twice")
        try:
            assert await first.create() is None and await second.create() is None
        finally:
            store_outage.end()
        await asyncio.sleep(0.3)
        await first.commit([1, 1])
        await second.commit([2, 2, 2])
        await second.end(FINISHED)
        await first.commit([1])
        loaded = await store.load("twice")
        await store.close()
        return loaded

    loaded = asyncio.run(scenario())
    assert loaded.generated == [1, 1, 1] and loaded.status == RUNNING


def test_an_end_while_the_store_is_down_is_written_once_it_is_back(redis_server):
    """The outcome is the last write that would put a lost record back: it is tried again until
    the store answers (a Redis restarting, a cluster promoting a replica), within END_RETRY_S."""

    async def scenario():
        store = RedisStore(redis_server.url, 60, error_counter(), retry_after_s=0.2)
        journal = RequestJournal(store, record("ended-in-outage"))
        assert await journal.create()
        await journal.commit([1, 2])
        redis_server.kill()
        ending = asyncio.ensure_future(journal.end(FINISHED))
        await asyncio.sleep(1.0)
        assert not ending.done()  # still trying
        redis_server.start()  # back, empty: the record was lost with it
        await asyncio.wait_for(ending, 10)
        loaded = await store.load("ended-in-outage")
        await store.close()
        return loaded

    loaded = asyncio.run(scenario())
    assert loaded.status == FINISHED and loaded.generated == [1, 2]

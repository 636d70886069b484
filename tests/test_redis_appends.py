"""coordinator.request_store.redis_appends: the appends of one turn of the event loop go to Redis
in one pipeline of plain commands; a record the store lost is told apart by the length Redis
returns; the TTL is set only when asked."""

import asyncio

from coordinator.request_store.store import RedisStore
from tests.conftest import error_counter, record


def commands(client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): entry["calls"] for name, entry in client.info("commandstats").items()}


def test_one_turns_appends_go_in_one_pipeline_of_plain_commands(redis_server):
    client = redis_server.client()

    async def scenario():
        store = RedisStore(redis_server.url, 60, error_counter())
        try:
            for i in range(16):
                await store.put(record(f"batched-{i}", [1]))
            client.config_resetstat()
            appended = [store.append(f"batched-{i}", [i, i], stored=1, keep_alive=False) for i in range(16)]
            assert await asyncio.gather(*appended) == [3] * 16
            used = commands(client)
            # one connection of the store's pool was used for all 16: one pipeline
            connections = [c for c in client.client_list() if c["cmd"] != "client|list"]
            return used, len(connections), [(await store.load(f"batched-{i}")).generated for i in range(16)]
        finally:
            await store.close()

    used, connections, generated = asyncio.run(scenario())
    assert used.get("append") == 16 and "evalsha" not in used and "expire" not in used, used
    assert connections == 1
    assert generated == [[1, i, i] for i in range(16)]


def test_a_lost_record_answers_0_whether_or_not_tokens_were_stored(redis_server):
    """The journal then writes the record whole (tests/test_journal.py)."""
    client = redis_server.client()

    async def scenario():
        store = RedisStore(redis_server.url, 60, error_counter())
        try:
            await store.put(record("lost-later", [1, 2]))
            await store.put(record("lost-at-once"))
            client.delete(*store._keys("lost-later"), *store._keys("lost-at-once"))  # as a Redis restart would
            return (
                await store.append("lost-later", [3], stored=2),  # a plain APPEND: its length tells
                await store.append("lost-at-once", [3], stored=0),  # nothing stored: the script checks the header
            )
        finally:
            await store.close()

    assert asyncio.run(scenario()) == (0, 0)


def test_the_ttl_is_set_again_only_when_asked(redis_server):
    client = redis_server.client()

    async def scenario():
        store = RedisStore(redis_server.url, 600, error_counter())
        try:
            await store.put(record("ttl", [1]))
            header, tokens, _ = store._keys("ttl")
            client.expire(header, 5), client.expire(tokens, 5)
            await store.append("ttl", [2], stored=1, keep_alive=False)
            kept = client.ttl(header), client.ttl(tokens)
            await store.append("ttl", [3], stored=2, keep_alive=True)
            return kept, (client.ttl(header), client.ttl(tokens))
        finally:
            await store.close()

    kept, renewed = asyncio.run(scenario())
    assert max(kept) <= 5 and min(renewed) > 590

"""coordinator.speculation.rounds without services: the lookups' indexing of the prompt while the
target prefills (the round loop itself runs against real services in test_greedy_equality.py)."""

import asyncio
import random

from coordinator.api.request import ResolvedRequest
from coordinator.speculation.draft_side import DraftService
from coordinator.speculation.failover import VerifyReplicas
from coordinator.speculation.rounds import INDEX_CHUNK, RequestRounds
from coordinator.speculation.upstream import ServiceClients
from specdec.ngram import DRAFTER_NAME as NGRAM
from specdec.ngram import NgramIndex
from specdec.sampling_params import SamplingParams
from specdec.suffix import DRAFTER_NAME as SUFFIX
from specdec.suffix import SuffixCache, SuffixIndex


def test_the_prompt_is_indexed_a_chunk_at_a_time_between_other_requests_work():
    """The lookups index the prompt ``INDEX_CHUNK`` tokens at a time, the event loop running other
    coroutines (other requests' rounds) in between, and then propose what lookups that indexed
    the prompt in one go propose."""
    rng = random.Random(3)
    phrases = [[rng.randrange(1000) for _ in range(6)] for _ in range(5)]
    prompt = [token for _ in range(60) for token in rng.choice(phrases)]  # 360 tokens, repeating
    request = ResolvedRequest(prompt, 16, SamplingParams(), [], 4, NGRAM, adaptive=True)

    def lookups():
        return {NGRAM: NgramIndex(1, 3), SUFFIX: SuffixIndex(SuffixCache(), len(prompt))}

    async def index_beside_other_work() -> tuple[dict, int]:
        clients = ServiceClients("127.0.0.1:9", ["127.0.0.1:9"], 1, 1)  # never called
        rounds = RequestRounds(
            DraftService(clients), VerifyReplicas(clients), "index", request, list(prompt), lookups()
        )
        turns, indexing = 0, asyncio.ensure_future(rounds._index_lookups(list(prompt)))
        while not indexing.done():
            turns += 1
            await asyncio.sleep(0)
        await clients.close()
        return rounds.lookups, turns

    chunked, turns = asyncio.run(index_beside_other_work())
    assert turns >= len(prompt) // INDEX_CHUNK
    at_once = lookups()
    context = [*prompt, *phrases[0][:2]]
    for name in (NGRAM, SUFFIX):
        at_once[name].lookup(prompt, 0)
        assert chunked[name].lookup(context, 4) == at_once[name].lookup(context, 4) is not None

"""coordinator.speculation.rounds: the lookups' indexing of the prompt while the target prefills,
and the draft's opening after the first token under a burst (the round loop's output against
plain decoding is test_greedy_equality.py's)."""

import asyncio
import random

from coordinator.speculation.draft_client import DraftClient
from coordinator.speculation.plan import DraftPlan, ResolvedRequest
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from coordinator.speculation.rounds import INDEX_CHUNK, RequestRounds
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramIndex
from specdec.lookups.suffix import DRAFTER_NAME as SUFFIX
from specdec.lookups.suffix import SuffixCache, SuffixIndex
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, verify_pb2


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
        clients = ServiceClients(["127.0.0.1:9"], ["127.0.0.1:9"], 1, 1)  # never called
        rounds = RequestRounds(DraftClient(clients), VerifyClient(clients), "index", request, list(prompt), lookups())
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


def test_the_first_tokens_decision_on_the_draft_counts_the_coordinators_running_requests(tiny_pipeline):
    """A prompt prefilled before the rest of a burst reached the verify service finds its step
    alone, but the coordinator already runs the burst: the policy takes that as the load, and an
    adaptive request whose draft pays alone leaves it closed."""
    prompt = random.Random(5).choices(range(1000), k=40)
    plan = DraftPlan(prefill_with_target=False)  # decided after the first token
    request = ResolvedRequest(prompt, 16, SamplingParams(), [], 4, "transformers", adaptive=True, draft=plan)
    drafter = draft_pb2.DrafterInfo(name="transformers", step_ms=2.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(
        model="t",
        verify_ms=[60.0, 65.0, 70.0, 75.0, 80.0],
        step_costs=[common_pb2.StepCost(num_tokens=16, num_seqs=16, ms=200.0)],
    )

    async def opened_at_once(running: int) -> bool:
        clients = ServiceClients([tiny_pipeline.draft_address], [tiny_pipeline.verify_address], 60, 60)
        policy = AdaptiveState().policy(drafter, target, k_max=4, lookups={})
        rounds = RequestRounds(
            DraftClient(clients),
            VerifyClient(clients),
            f"burst-{running}",
            request,
            list(prompt),
            running_requests=lambda: running,
        )
        try:
            await rounds.prefill(policy)
            return rounds.draft._prefill is not None or rounds.draft.session_id is not None
        finally:
            await rounds.release()
            await clients.close()

    assert asyncio.run(opened_at_once(1)) and not asyncio.run(opened_at_once(16))

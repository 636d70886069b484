"""Invariant 1: under greedy decoding the pipeline's token ids equal plain greedy decoding of the
target, for every drafter and every K, over real gRPC."""

import asyncio
import random

import pytest

from coordinator.api.client import generate
from coordinator.settings import CoordinatorSettings
from coordinator.speculation.draft_client import DraftClient
from coordinator.speculation.plan import DraftPlan, ResolvedRequest
from coordinator.speculation.policy.fixed import FixedK
from coordinator.speculation.rounds import RequestRounds
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramIndex
from specdec.lookups.suffix import DRAFTER_NAME as SUFFIX
from specdec.lookups.suffix import SuffixCache, SuffixIndex
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import coordinator_pb2, verify_pb2
from specdec_app.launcher import free_port
from tests.conftest import CoordinatorThread, chat_ids, plain_greedy

PROMPTS = ["Tell me a story about a cat.", "List three prime numbers and explain why."]
MAX_NEW = 40


@pytest.fixture(scope="module")
def references(tiny_pipeline, smollm2_tokenizer):
    refs = {}
    for prompt in PROMPTS:
        ids = chat_ids(smollm2_tokenizer, prompt)
        refs[prompt] = (ids, plain_greedy(tiny_pipeline.plain_model, ids, MAX_NEW))
    return refs


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter", ["transformers", "self", "ngram", "wrong"])
def test_pipeline_equals_plain_greedy(tiny_pipeline, references, drafter, k):
    for prompt, (_, expected) in references.items():
        request = coordinator_pb2.GenerateRequest(
            text=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, drafter=drafter
        )
        completion = generate(tiny_pipeline.address, request, timeout_s=120)
        assert completion.token_ids == expected, f"{drafter} K={k} diverged on {prompt!r}"
        m = completion.metrics
        assert m.num_generated_tokens == len(expected)
        assert m.num_accepted_draft_tokens <= m.num_draft_tokens
        if drafter == "self":  # the target drafting for itself: every draft passes
            assert m.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("drafter", ["transformers", "self", "ngram", "suffix", "wrong"])
def test_adaptive_k_equals_plain_greedy(tiny_pipeline, references, drafter):
    """No K in the request: the coordinator chooses K every round, plain-decode fallback included
    (ngram and suffix: the coordinator's own lookup alone; a model drafter: with both lookups)."""
    for prompt, (_, expected) in references.items():
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, drafter=drafter)
        completion = generate(tiny_pipeline.address, request, timeout_s=120)
        assert completion.token_ids == expected, f"adaptive {drafter} diverged on {prompt!r}"
        m = completion.metrics
        assert m.adaptive and sum(m.rounds_per_k) == m.num_target_forwards
        # every round is a plain decode step or was proposed by exactly one drafter
        assert m.rounds_per_k[0] + sum(u.num_rounds for u in m.drafter_usage.values()) == m.num_target_forwards
        assert set(m.drafter_usage) <= {drafter, "ngram", "suffix"}


def test_adaptive_without_a_reachable_draft_service_uses_the_lookups(tiny_pipeline, tiny_models, references):
    """A coordinator that never reached its draft service: adaptive requests run on its own
    lookups and plain decode, and still equal plain greedy decoding."""
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=f"127.0.0.1:{free_port()}",
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
        )
    )
    try:
        for prompt, (_, expected) in references.items():
            request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW)
            completion = generate(f"127.0.0.1:{coordinator.port}", request, timeout_s=120)
            assert completion.token_ids == expected
            assert set(completion.metrics.drafter_usage) <= {"ngram", "suffix"}
    finally:
        coordinator.stop()


def test_plain_decode_k0_equals_plain_greedy(tiny_pipeline, references):
    for prompt, (_, expected) in references.items():
        request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=0)
        completion = generate(tiny_pipeline.address, request, timeout_s=120)
        assert completion.token_ids == expected
        assert completion.metrics.num_spec_steps == 0
        assert completion.metrics.num_target_forwards == len(expected) - 1  # the first token: the prefill's


def test_plain_decode_sends_each_decode_ahead_and_survives_a_lost_session(tiny_pipeline, references):
    """K = 0: every round after the first takes the answer to a Decode sent with the round
    before; the verify session released under it mid-stretch (as a restart or an eviction loses
    it), a Decode sent ahead fails, the session is rebuilt from the committed log and decoded
    again; later a stray Decode commits a token the coordinator never sees (as a Decode sent ahead
    that it gave up on and the service ran late does), the next Decode fails its
    ``num_committed_tokens`` and the session is rebuilt again. The output still equals plain
    greedy decoding."""
    ids, expected = next(iter(references.values()))

    async def run() -> tuple[list[int], list, int]:
        clients = ServiceClients([tiny_pipeline.draft_address], [tiny_pipeline.verify_address], 60, 60)
        request = ResolvedRequest(ids, MAX_NEW, SamplingParams(), [], 0, "", adaptive=False)
        rounds = RequestRounds(DraftClient(clients), VerifyClient(clients), "ahead", request, list(ids))
        policy = FixedK(request.drafter, request.num_speculative_tokens)
        generated, _ = await rounds.prefill(policy)
        records = []
        try:
            while len(generated) < MAX_NEW:
                if len(records) == 8:
                    await clients.release_verify(rounds.verify.replica, rounds.verify.session_id)
                if len(records) == 20:
                    stray = verify_pb2.DecodeRequest(session_id=rounds.verify.session_id)
                    await clients.decode(rounds.verify.replica, stray)
                new, _, record = await rounds.step(policy, MAX_NEW - len(generated) - 1)
                generated.extend(new)
                records.append(record)
        finally:
            await rounds.release()
            await clients.close()
        return generated, records, rounds.verify.rebuilds

    generated, records, rebuilds = asyncio.run(run())
    assert generated[: until_eos(expected)] == expected
    assert rebuilds == 2
    assert not records[0].decoded_ahead and all(record.decoded_ahead for record in records[1:8])
    assert sum(record.decoded_ahead for record in records[8:]) >= len(records[8:]) - 6


def until_eos(expected: list[int]) -> int:
    """How many tokens of a generation to compare with the plain reference, which stops at EOS."""
    return expected.index(2) + 1 if 2 in expected else MAX_NEW


async def run_rounds(rounds: RequestRounds, policy=None) -> tuple[list[int], list]:
    """Runs a request's rounds (``policy`` None: its fixed K) to MAX_NEW tokens and releases its
    sessions; returns the generated tokens (at most MAX_NEW) and the rounds' records."""
    policy = policy or FixedK(rounds.request.drafter, rounds.request.num_speculative_tokens)
    generated, _ = await rounds.prefill(policy)  # the first token: the target's prefill
    records = []
    try:
        while len(generated) < MAX_NEW:
            new, _, record = await rounds.step(policy, MAX_NEW - len(generated))
            generated.extend(new)
            records.append(record)
    finally:
        await rounds.release()
    return generated[:MAX_NEW], records


def test_on_shared_cores_the_first_round_waits_for_the_draft(tiny_pipeline, references):
    """With the draft prefilled after the first token (``--draft-shares-target-cores``), the first
    round waits for that prefill and drafts, instead of a plain decode step beside it."""
    ids, expected = next(iter(references.values()))

    async def run() -> tuple[list[int], list]:
        clients = ServiceClients([tiny_pipeline.draft_address], [tiny_pipeline.verify_address], 60, 60)
        plan = DraftPlan(prefill_with_target=False)
        request = ResolvedRequest(ids, MAX_NEW, SamplingParams(), [], 4, "transformers", adaptive=False, draft=plan)
        try:
            return await run_rounds(
                RequestRounds(
                    DraftClient(clients),
                    VerifyClient(clients),
                    "shared-first",
                    request,
                    list(ids),
                )
            )
        finally:
            await clients.close()

    generated, records = asyncio.run(run())
    assert records[0].drafter == "transformers" and records[0].num_drafted == 4
    assert generated[: until_eos(expected)] == expected


@pytest.mark.parametrize(
    ("drafter", "draft_prefill_with_target"), [("transformers", True), ("ngram", True), ("transformers", False)]
)
def test_k_changing_every_round_equals_plain_greedy(tiny_pipeline, references, drafter, draft_prefill_with_target):
    """The round loop with a different K each round, plain-decode rounds (K = 0) included, half of
    them sending the next round's Decode with theirs (decode ahead, whatever the next round's K
    would have been), and half the proposals from the coordinator's own n-gram and suffix lookups
    (hybrid drafting); the draft prefilled beside the target, or after the first token
    (``--draft-shares-target-cores``)."""
    schedule = random.Random(7)

    class RandomPolicy:
        """Chooses K and the proposer at random each round (the adaptive policy's interface)."""

        k_max = k_limit = 8
        lookups_on = True

        def opens_draft_at_prefill(self, context_tokens: int, remaining: int) -> bool:
            return True

        def wants_drafter(self, matches, context_tokens: int = 0, remaining: int = 0) -> bool:
            return True

        def next_round(self, matches, draft_available: bool) -> tuple[str, int]:
            k = schedule.choice([0, 1, 2, 3, 5, 8])
            lookup = schedule.choice([NGRAM, SUFFIX]) if schedule.random() < 0.5 else None
            return (lookup if lookup in matches else drafter), k

        def decodes_ahead(self, matches, draft_available: bool) -> bool:
            return schedule.random() < 0.5

        def observe(self, record, matches, new) -> None:
            pass

        def observe_prefill(self, num_seqs, num_running_seqs) -> None:
            pass

        def observe_draft_prefill(self, num_tokens, ms) -> None:
            pass

        def end(self) -> None:
            pass

    async def run(clients: ServiceClients, prompt_ids: list[int]) -> tuple[list[int], list]:
        plan = DraftPlan(prefill_with_target=draft_prefill_with_target)
        request = ResolvedRequest(prompt_ids, MAX_NEW, SamplingParams(), [], 8, drafter, adaptive=False, draft=plan)
        lookups = {NGRAM: NgramIndex(1, 3), SUFFIX: SuffixIndex(SuffixCache(), len(prompt_ids))}
        rounds = RequestRounds(
            DraftClient(clients),
            VerifyClient(clients),
            f"k-schedule-{drafter}-{len(prompt_ids)}",
            request,
            list(prompt_ids),
            lookups,
        )
        return await run_rounds(rounds, RandomPolicy())

    async def run_all():
        clients = ServiceClients([tiny_pipeline.draft_address], [tiny_pipeline.verify_address], 60, 60)
        try:
            return [await run(clients, ids) for ids, _ in references.values()]
        finally:
            await clients.close()

    results = asyncio.run(run_all())
    for (got, _), (_, expected) in zip(results, references.values(), strict=True):
        assert got[: until_eos(expected)] == expected
    assert any(record.decoded_ahead for _, records in results for record in records)

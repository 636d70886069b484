"""Adaptive K: the choice from known costs and acceptance estimates, the fallback to plain decode
and its recovery, over real gRPC with a scripted drafter whose accuracy switches mid-request."""

import dataclasses
import math
import weakref

import pytest

from coordinator.api.client import generate
from coordinator.observability.metrics import HIT, MISS, PLAIN, RoundRecord
from coordinator.settings import CoordinatorSettings
from coordinator.speculation.policy.acceptance_model import AcceptanceModel, drafted_outcome
from coordinator.speculation.policy.adaptive import PRICE_EVERY, AdaptiveK
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from coordinator.speculation.policy.step_costs import Load, StepCosts
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramMatch
from specdec.lookups.suffix import DRAFTER_NAME as SUFFIX
from specdec.lookups.suffix import SuffixMatch
from specdec.sampling.grammar import FORCED, ForcedMatch
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, verify_pb2
from tests.conftest import CoordinatorThread, chat_ids, plain_greedy

FLAT = [60.0, 70.0, 75.0, 80.0, 85.0]  # verify ms for K = 0..4, like SmolLM2 on 2 CPU cores


def record(k: int, drafted: int, accepted: int) -> RoundRecord:
    return RoundRecord(
        drafter="llama-cpp" if k else PLAIN,
        k=k,
        num_drafted=drafted,
        num_accepted=accepted,
        draft_ms=1.0 * drafted,
        verify_ms=FLAT[drafted],
        wall_ms=FLAT[drafted] + drafted + 2.0,
        wire_bytes=0,
    )


def test_verify_rounds_are_costed_on_a_line_not_one_noisy_measurement_per_k():
    """A start-up measurement that came out 40 ms high for K = 3 does not keep rounds off K = 3:
    verify rounds cost the least-squares line through every K's measurement (the plain step
    aside), and the plain step its own measurement."""
    noisy = StepCosts(draft_ms_per_token=1.0, verify_ms=[60.0, 70.0, 75.0, 120.0, 85.0], overhead_ms=2.0)
    assert noisy.round_ms(0) == pytest.approx(60.0 + 2.0)
    assert noisy.round_ms(3) < noisy.round_ms(4)
    assert choose([0.9, 0.9, 0.9, 0.2], noisy) == ("llama-cpp", 3)


def choose(rates, costs, k_max=4, match=None, ngram_rates=()):
    """The (drafter, K) of a llama-cpp session with per-position ``rates``; ``ngram_rates[n - 1]``:
    the rates of n-gram proposals from an n-token suffix match."""
    ngram = [AcceptanceModel(list(r)) for r in ngram_rates]
    return AdaptiveK(k_max, "llama-cpp", AcceptanceModel(list(rates)), {NGRAM: ngram}, costs).next_round(
        {NGRAM: match} if match else {}
    )


def test_choose_k_from_costs_and_acceptance():
    costs = StepCosts(draft_ms_per_token=15.0, verify_ms=list(FLAT), overhead_ms=2.0)
    assert choose([0.0] * 4, costs) == (PLAIN, 0)  # drafts never pass: plain decode
    assert choose([0.95] * 4, costs) == ("llama-cpp", 4)
    # 0.5 per position: K=0 gives 1 token in 62 ms, K=1 1.5 in 87 ms, K=2 1.75 in 107 ms
    assert choose([0.5] * 4, costs) == ("llama-cpp", 1)
    assert choose([0.95] * 4, costs, k_max=2) == ("llama-cpp", 2)  # never above K_max
    # a plain-step measurement inflated by contention at start-up does not block the fallback
    inflated = StepCosts(draft_ms_per_token=15.0, verify_ms=[500.0, *FLAT[1:]], overhead_ms=2.0)
    assert choose([0.0] * 4, inflated) == (PLAIN, 0)


def test_a_draft_that_drafts_ahead_is_priced_by_what_outlasts_the_verify():
    """The split placement of the batch-1 bench: a llama.cpp draft on its own core, 13 ms a forward,
    a target whose 9-token verify takes 83 ms. Drafting ahead, a K = 8 round waits for the 9
    forwards' excess over the verify and, on a miss, for 8 more; K = 5's 6 forwards about match
    its verify. So K = 5 wins at the acceptance where, priced as K forwards a round, K = 8 did."""
    verify = [62.0 + 2.6 * k for k in range(9)]  # 1..9 tokens: 62..83 ms
    costs = StepCosts(draft_ms_per_token=13.0, verify_ms=verify, overhead_ms=2.0)
    assert costs.draft_wait_ms(8, verify[8]) == 8 * 13.0  # not drafted ahead: the whole proposal
    assert costs.draft_wait_ms(8, verify[8], hit_probability=0.8) == pytest.approx(
        9 * 13.0 - (verify[8] + 2.0) + 0.2 * 8 * 13.0
    )
    assert costs.draft_wait_ms(4, verify[4], hit_probability=1.0) == 0.0  # hidden behind the verify
    rates = AcceptanceModel([0.97] * 8)
    assert AdaptiveK(8, "llama-cpp", rates, {}, costs).next_round({}) == ("llama-cpp", 8)
    assert AdaptiveK(8, "llama-cpp", rates, {}, costs, hidden_behind_verify=True).next_round({}) == ("llama-cpp", 5)
    # it learns from the draft's time for the proposals asked for in a round, not from the wait:
    # a hit's wait is the excess alone and teaches nothing
    hit = RoundRecord(
        drafter="llama-cpp",
        k=8,
        num_drafted=8,
        num_accepted=8,
        draft_ms=0.0,
        verify_ms=83.0,
        wall_ms=85.0,
        wire_bytes=0,
        draft_ahead="hit",
    )
    costs.observe(hit, draft_call=True, hidden_behind_verify=True)
    assert costs.draft_ms_per_token == 13.0
    miss = dataclasses.replace(hit, num_accepted=2, draft_ms=150.0, draft_ahead="miss", draft_compute_ms=8 * 15.0)
    costs.observe(miss, draft_call=True, hidden_behind_verify=True)
    assert costs.draft_ms_per_token == pytest.approx(13.0 + 0.1 * (15.0 - 13.0))
    # a proposal that first fed the draft what was committed without it (a probe after plain
    # rounds) overstates a forward: it may lower the estimate, never raise it
    learnt = costs.draft_ms_per_token
    probe = dataclasses.replace(hit, k=2, num_drafted=2, draft_ahead="", draft_ms=300.0, draft_compute_ms=300.0)
    costs.observe(probe, draft_call=True, hidden_behind_verify=True)
    assert costs.draft_ms_per_token == learnt
    costs.observe(dataclasses.replace(probe, draft_compute_ms=2 * 3.0), draft_call=True, hidden_behind_verify=True)
    assert costs.draft_ms_per_token == pytest.approx(learnt + 0.1 * (3.0 - learnt))
    # a draft paused mid-proposal (seconds for 8 tokens) raises it by one weight's share at most
    learnt = costs.draft_ms_per_token
    costs.observe(dataclasses.replace(miss, draft_compute_ms=5000.0), draft_call=True, hidden_behind_verify=True)
    assert costs.draft_ms_per_token == pytest.approx(learnt * 1.1)


def test_hybrid_prefers_a_free_ngram_match_when_it_pays():
    costs = StepCosts(draft_ms_per_token=15.0, verify_ms=list(FLAT), overhead_ms=2.0)
    three_long = NgramMatch(3, [7, 8, 9, 10])
    # the same 0.5 per position, but free: K=3 gives 1.875 tokens in 81 ms
    assert choose([0.5] * 4, costs, match=three_long, ngram_rates=[[0.1] * 4, [0.1] * 4, [0.5] * 4]) == (NGRAM, 3)
    # a 1-token suffix match that rarely passes loses to the model drafter
    one_long = NgramMatch(1, [7, 8, 9, 10])
    assert choose([0.5] * 4, costs, match=one_long, ngram_rates=[[0.1] * 4, [0.1] * 4, [0.5] * 4]) == ("llama-cpp", 1)
    # K never exceeds what the match proposes
    assert choose([0.0] * 4, costs, match=NgramMatch(3, [7]), ngram_rates=[[0.9] * 4] * 3) == (NGRAM, 1)


def test_ngram_acceptance_is_observed_whether_or_not_it_was_used():
    policy = AdaptiveK(
        4,
        "llama-cpp",
        AcceptanceModel([0.5] * 4),
        {NGRAM: [AcceptanceModel([0.5] * 4, weight=0.5)]},
        StepCosts(15.0, list(FLAT)),
    )
    match = NgramMatch(1, [7, 8, 9, 10])
    policy.observe(record(4, 4, 2), {NGRAM: match}, [7, 8, 3])  # a llama-cpp round committed 7 8 3
    assert policy.lookups[NGRAM][0].rates == [0.75, 0.75, 0.25, 0.5]  # 7 and 8 would have passed, 9 not
    assert policy.acceptance.rates[:3] == [0.625, 0.625, 0.375]  # the model's own round, weight 0.25


def test_suffix_and_ngram_lookups_compete_with_estimates_of_their_own():
    """Each lookup keeps its estimates per match length (suffix matches of 4 tokens and more share
    one); both are observed every round against what it committed."""
    costs = StepCosts(draft_ms_per_token=15.0, verify_ms=list(FLAT), overhead_ms=2.0)
    lookups = {
        NGRAM: [AcceptanceModel([0.1] * 4, weight=0.5) for _ in range(3)],
        SUFFIX: [*(AcceptanceModel([0.2] * 4) for _ in range(3)), AcceptanceModel([0.9] * 4, weight=0.5)],
    }
    policy = AdaptiveK(4, None, None, lookups, costs)
    matches = {NGRAM: NgramMatch(3, [7, 8, 9, 10]), SUFFIX: SuffixMatch(9, [7, 8, 5, 6], [0.9, 0.8, 0.5, 0.4])}
    assert policy.next_round(matches) == (SUFFIX, 4)  # a 9-token suffix match: the 4+ estimate, 0.9
    assert policy.next_round({NGRAM: matches[NGRAM]}) == (PLAIN, 0)  # the n-gram alone rarely passes
    suffix_round = RoundRecord(
        drafter=SUFFIX,
        k=4,
        num_drafted=4,
        num_accepted=2,
        draft_ms=0.0,
        verify_ms=FLAT[4],
        wall_ms=FLAT[4] + 2.0,
        wire_bytes=0,
    )
    policy.observe(suffix_round, matches, [7, 8, 9])  # 7 8 passed, 5 rejected for 9
    assert policy.lookups[SUFFIX][3].rates == [0.95, 0.95, 0.45, 0.9]
    assert policy.lookups[NGRAM][2].rates == [0.55, 0.55, 0.55, 0.1]  # 7 8 9 would have passed, 10 unseen
    assert set(policy.acceptance_models()) == {"ngram/3", "suffix/4"}  # the estimates it observed: for the store


LONG = [60.0, *(70.0 + 2.0 * k for k in range(1, 9))]  # verify ms for K = 0..8: a verify service allowing K = 8


def forced_policy(drafter_rates, forced_rates, k_max=2, draft_ms=5.0) -> AdaptiveK:
    """A llama-cpp session allowed ``k_max`` drafted tokens, on a verify service allowing K = 8,
    with the forced-token lookup's per-position estimates ``forced_rates``."""
    return AdaptiveK(
        k_max,
        "llama-cpp",
        AcceptanceModel(list(drafter_rates)),
        {},
        StepCosts(draft_ms, list(LONG), overhead_ms=2.0),
        forced=AcceptanceModel(list(forced_rates)),
    )


def test_forced_tokens_are_free_proposals():
    """With 4 forced tokens next, the model drafter's options are those 4 (no draft cost) plus 1 to
    k_max drafted ones, past k_max up to the verify service's K; a round of the forced tokens alone
    costs no draft call; forced tokens count their own acceptance."""
    policy = forced_policy([0.9] * 2, [1.0] * 8)
    forced = {FORCED: ForcedMatch([5, 6, 7, 8])}
    options = {(drafter, k): goodput for drafter, k, goodput in policy.options(forced)}
    assert set(options) == {(PLAIN, 0), ("llama-cpp", 5), ("llama-cpp", 6), *((FORCED, k) for k in range(1, 5))}
    # K = 6: 4 forced and 2 drafted tokens, priced as 2 draft tokens: 1 + 4 + 0.9 + 0.81 in 10 + 82 + 2 ms
    assert options[("llama-cpp", 6)] == pytest.approx((1 + 4 + 0.9 + 0.81) / (2 * 5.0 + LONG[6] + 2.0))
    assert options[(FORCED, 4)] == pytest.approx(5 / (LONG[4] + 2.0))  # no draft call
    assert policy.next_round(forced) == ("llama-cpp", 6)
    # a slow draft loses to the forced tokens alone; forced tokens the target mostly rejects (another
    # tokenization of the text wins) open the drafter's proposals too: plain decode then pays best
    assert forced_policy([0.9] * 2, [1.0] * 8, draft_ms=50.0).next_round(forced) == (FORCED, 4)
    assert forced_policy([0.9] * 2, [0.1] * 8).next_round(forced) == (PLAIN, 0)
    # never past the verify service's K: 7 forced tokens leave one drafted
    seven = {FORCED: ForcedMatch([5] * 7)}
    assert max(k for drafter, k, _ in policy.options(seven) if drafter == "llama-cpp") == 8


def test_the_drafter_learns_from_its_drafted_tokens_alone():
    """A round of 2 forced, 1 drafted, 1 forced and 2 drafted tokens whose 4th token (forced) was
    rejected: the drafter observes its one drafted token passing and no rejection, its ms per
    token is the draft's time over its 3 drafted tokens, and the forced-token lookup observes its
    own match against the committed tokens."""
    policy = forced_policy([0.5] * 4, [0.5] * 8, k_max=4)
    policy.acceptance.weight = policy.forced.weight = policy.costs.weight = 0.5
    round_record = RoundRecord(
        drafter="llama-cpp",
        k=6,
        num_drafted=6,
        num_accepted=3,
        draft_ms=60.0,
        verify_ms=LONG[6],
        wall_ms=LONG[6] + 64.0,
        wire_bytes=0,
        forced=(True, True, False, True, False, False),
    )
    assert round_record.num_forced == 3 and drafted_outcome(round_record) == (1, 1)
    policy.observe(round_record, {FORCED: ForcedMatch([5, 6])}, [5, 6, 9, 4])
    assert policy.acceptance.rates == [0.75, 0.5, 0.5, 0.5]
    assert policy.forced.rates[:3] == [0.75, 0.75, 0.5]
    assert policy.costs.draft_ms_per_token == pytest.approx((5.0 + 60.0 / 3) / 2)
    assert drafted_outcome(dataclasses.replace(round_record, num_accepted=4)) == (2, 1)  # 5th, drafted, rejected
    assert "forced" in policy.acceptance_models()
    policy.acceptance.observe(drafted=8, accepted=8)  # a draft that reports no forced tokens: 4 positions modelled
    assert policy.acceptance.rates == [0.875, 0.75, 0.75, 0.75]


def test_fallback_then_probe_then_recovery():
    policy = AdaptiveK(
        4,
        "llama-cpp",
        AcceptanceModel([0.8] * 4),
        {},
        StepCosts(15.0, list(FLAT), 2.0),
        probe_interval=4,
        probe_k=2,
    )
    assert policy.next_round(None) == ("llama-cpp", 3)  # prior 0.8: K=3 gives 2.95 tokens in 128 ms, K=4 3.36 in 148
    for _ in range(6):  # the drafter turns wrong: every draft is rejected at the first position
        policy.observe(record(4, 4, 0), None, [1])
    # fallback, with a 2-token probe every 4th round stretched by what a probe costs over a plain
    # round (2 x 8.4 ms of drafts + 75 ms of verify + 2.5 ms against 61 ms: 6.2 rounds)
    ks = [policy.next_round(None)[1] for _ in range(14)]
    assert ks == [0, 0, 0, 0, 0, 0, 2] * 2
    for _ in range(3):  # the probes pass: the text became predictable again
        policy.observe(record(2, 2, 2), None, [1, 2, 3])
    assert policy.next_round(None)[1] > 0


def test_plain_rounds_decode_ahead_until_a_probe_is_due():
    """decodes_ahead: while plain decode is the best option the next round's Decode may go out
    with this one's, but not when the next round should probe the draft, nor while a lookup's
    match wins; the rounds decoded ahead count towards the probe, so a stretch of them ends in
    one, as a stretch of plain rounds chosen one by one does."""
    costs = StepCosts(0.0, list(FLAT), 2.0)
    ngram = [AcceptanceModel([0.9] * 4)]
    policy = AdaptiveK(4, "llama-cpp", AcceptanceModel([0.0] * 4), {NGRAM: ngram}, costs, probe_interval=4)
    assert not policy.decodes_ahead({NGRAM: NgramMatch(1, [7, 8])})
    assert policy.next_round(None) == (PLAIN, 0)
    ahead = []
    for _ in range(6):
        ahead.append(policy.decodes_ahead(None))
        if ahead[-1]:
            policy.observe(dataclasses.replace(record(0, 0, 0), decoded_ahead=True), None, [1])
    assert ahead[:3] == [True] * 3 and not ahead[-1]  # a free draft: a probe is due after 4 x 1.24 rounds
    assert policy.next_round(None)[0] == "llama-cpp"


def test_under_load_a_plain_stretch_is_priced_every_few_rounds():
    """Beside 15 others, a round that decodes ahead with its lookups off answers for the
    PRICE_EVERY - 1 rounds after it: when the load is gone (the drafter would win alone) the
    stretch goes on until its next priced round, which ends it; a forced token's match is priced
    at once."""
    costs = StepCosts(0.0, list(FLAT), 2.0, batched_ms={16: 400.0, 32: 800.0})
    policy = AdaptiveK(4, "llama-cpp", AcceptanceModel([0.9] * 4), {NGRAM: [AcceptanceModel([0.9] * 4)]}, costs)
    policy.load = Load(others_seqs=15, others_tokens=15)
    assert not policy.lookups_on and policy.decodes_ahead({})
    policy.observe(dataclasses.replace(record(0, 0, 0), decoded_ahead=True), {}, [1])
    policy.load = Load()  # alone: the drafter wins
    ahead = []
    for _ in range(PRICE_EVERY):
        ahead.append((policy.lookups_on, policy.decodes_ahead({})))
        policy.observe(dataclasses.replace(record(0, 0, 0), decoded_ahead=True), {}, [1])
    assert ahead == [(False, True)] * (PRICE_EVERY - 1) + [(True, False)]
    policy.load = Load(others_seqs=15, others_tokens=15)
    assert not policy.lookups_on and policy.decodes_ahead({})
    policy.observe(dataclasses.replace(record(0, 0, 0), decoded_ahead=True), {}, [1])
    policy.load = Load()
    assert not policy.decodes_ahead({FORCED: ForcedMatch([5, 6])})


def test_a_stretch_decoded_ahead_under_load_is_left_only_for_more_than_the_steps_it_misses():
    """15 others in steps of 100 ms: rounds that turned around waited 90 ms for the step in
    progress (the engine stepped without them, the others' next calls queued before), so a round
    that turns around misses 0.9 of a step, and leaving a stretch of plain rounds decoded ahead
    two such rounds. A lookup expected to commit 3.2 tokens wins where the engine waits for the
    rounds that turn around (no wait for the step), but not against the missed steps; one
    expected to commit 7.4 does. Alone, no step is missed."""

    def lookup_request(others: int, rate: float, queue_ms: float = 90.0) -> AdaptiveK:
        costs = StepCosts(0.0, [100.0] * 9, overhead_ms=8.0, batched_ms={16: 100.0, 32: 100.0}, weight=1.0)
        turned_around = dataclasses.replace(
            record(0, 0, 0), verify_ms=100.0, step_ms=100.0, wall_ms=108.0 + queue_ms, batch_size=16, queue_ms=queue_ms
        )
        costs.observe(turned_around, draft_call=False)
        costs.observe(dataclasses.replace(turned_around, wall_ms=100.0, queue_ms=0.0, decoded_ahead=True), False)
        policy = AdaptiveK(8, "", None, {NGRAM: [AcceptanceModel([rate] * 8)]}, costs)
        policy.load = Load(others_seqs=others, others_tokens=others, round_tokens=1.0)
        return policy

    match = {NGRAM: NgramMatch(1, list(range(8)))}
    assert lookup_request(15, 0.7).missed_steps() == pytest.approx(0.9)
    assert lookup_request(15, 0.7, queue_ms=0.0).missed_steps() == lookup_request(0, 0.7).missed_steps() == 0
    assert lookup_request(15, 0.7, queue_ms=0.0).next_round(match)[0] == NGRAM
    assert not lookup_request(15, 0.7, queue_ms=0.0).decodes_ahead(match)
    assert lookup_request(15, 0.7).decodes_ahead(match)
    assert lookup_request(15, 0.95).next_round(match)[0] == NGRAM
    assert not lookup_request(15, 0.95).decodes_ahead(match)


def test_plain_rounds_decoded_ahead_price_plain_decode_without_the_turnaround():
    """A plain round whose Decode went out with the round before starts its step before the
    round does: what it leaves after the step (here 0) prices plain decode from then on, while
    the speculative rounds keep the overhead they pay (a network round trip in it), so a round
    trip makes speculation dearer against plain decode, as it is."""
    costs = StepCosts(draft_ms_per_token=1.0, verify_ms=[50.0, 60.0], overhead_ms=20.0, weight=0.5)
    assert costs.round_ms(0) == 70.0
    ahead = dataclasses.replace(record(0, 0, 0), verify_ms=50.0, wall_ms=48.0, decoded_ahead=True)
    costs.observe(ahead, draft_call=False)
    assert costs.plain_overhead_ms == pytest.approx(10.0) and costs.overhead_ms == 20.0
    costs.observe(ahead, draft_call=False)
    assert costs.round_ms(0) == pytest.approx(55.0) and costs.round_ms(1, draft_call=False) == pytest.approx(80.0)


def test_probes_are_rarer_where_a_probe_costs_more():
    """Probing takes at most 1/probe_interval of the fallback's time: a slow draft (a loaded
    machine) is probed less often than a fast one."""

    def rounds_to_first_probe(draft_ms_per_token: float) -> int:
        costs = StepCosts(draft_ms_per_token, list(FLAT), 2.0)
        policy = AdaptiveK(4, "llama-cpp", AcceptanceModel([0.0] * 4), {}, costs, probe_interval=4, probe_k=2)
        return next(i for i in range(1, 100) if policy.next_round(None)[1])

    assert rounds_to_first_probe(0.0) == 5  # a free draft: 77 ms against 62, after 4 x 1.24 rounds
    assert rounds_to_first_probe(100.0) == 18  # 277 ms against 62: after 4 x 4.47 rounds


def test_rounds_a_lookup_wins_do_not_put_the_probe_off():
    """The rounds since the model drafter last proposed count towards a probe whoever won them:
    a request whose plain rounds are broken up by a lookup round now and then still probes its
    draft, in a plain round (the lookup's are kept)."""
    costs = StepCosts(0.0, list(FLAT), 2.0)
    ngram = [AcceptanceModel([0.9] * 4)]
    policy = AdaptiveK(4, "llama-cpp", AcceptanceModel([0.0] * 4), {NGRAM: ngram}, costs, probe_interval=4)
    every_third = [{NGRAM: NgramMatch(1, [7, 8])} if i % 3 == 2 else None for i in range(12)]
    chosen = [policy.next_round(matches)[0] for matches in every_third]
    # a free draft: a probe is due after 4 x 1.24 rounds; every third round is the lookup's
    assert chosen == [PLAIN, PLAIN, NGRAM, PLAIN, "llama-cpp", NGRAM, PLAIN, PLAIN, NGRAM, "llama-cpp", PLAIN, NGRAM]


def test_a_round_that_asks_for_a_proposal_pays_its_round_trip():
    """A drafter whose forwards cost nothing (model-free) beside a verify step that costs the same
    at every K: with its drafts rejected, plain decode wins, because a round that asks the draft
    service for a proposal pays the call's round trip beyond the service's time (1.5 ms here),
    learnt from such rounds and kept out of the overhead every round pays. Priced as part of that
    overhead, the rejected drafts looked free and kept winning."""
    costs = StepCosts(draft_ms_per_token=0.0, verify_ms=[3.0] * 5, overhead_ms=1.0, weight=0.5)
    asked = RoundRecord(
        drafter="switching",
        k=4,
        num_drafted=4,
        num_accepted=0,
        draft_ms=0.1,
        verify_ms=3.0,
        wall_ms=5.6,
        wire_bytes=0,
        draft_ahead=MISS,
        draft_compute_ms=0.1,
        propose_call_ms=1.5,
    )
    costs.observe(asked, draft_call=True, hidden_behind_verify=True)
    assert costs.propose_call_ms == 0.75 and costs.overhead_ms == pytest.approx(1.0)  # 5.6 - 0.1 - 1.5 - 3.0

    def choice(costs: StepCosts) -> str:
        return AdaptiveK(4, "switching", AcceptanceModel([0.01] * 4), {}, costs, hidden_behind_verify=True).next_round(
            None
        )[0]

    assert choice(costs) == PLAIN
    assert choice(dataclasses.replace(costs, propose_call_ms=0.0)) == "switching"
    # a round that took its proposal drafted ahead asked for none, but that Propose's round trip
    # teaches the link's all the same: a load that has gone is soon forgotten
    hit = dataclasses.replace(asked, draft_ahead=HIT, propose_call_ms=0.0, ahead_call_ms=0.25)
    costs.observe(hit, draft_call=True, hidden_behind_verify=True)
    assert costs.propose_call_ms == 0.5
    costs.observe(dataclasses.replace(hit, ahead_call_ms=0.0), draft_call=True, hidden_behind_verify=True)
    assert costs.propose_call_ms == 0.5  # nothing drafted ahead: nothing learnt


# a verify service measured alone and at a step of 16 sequences (GetInfo)
BATCHING_TARGET = verify_pb2.VerifyServiceGetInfoResponse(
    model="t",
    verify_ms=[60.0, 65.0, 70.0, 75.0, 80.0],
    step_costs=[common_pb2.StepCost(num_tokens=16, num_seqs=16, ms=200.0)],
)


def test_a_session_opens_its_draft_only_when_a_round_would_use_it():
    """Alone, the drafter pays from the first round, so the draft is prefilled at once; with 15
    other requests running it does not, so the draft stays closed (its prefill would take the
    shared hardware from the target's steps) until a probe is due: a draft of 2 ms a token would
    win there were its every token accepted, one of 30 ms not even then, and is never probed."""
    for draft_ms, probed in ((2.0, True), (30.0, False)):
        state = AdaptiveState(probe_interval=4)
        drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=draft_ms)
        assert state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2}).wants_drafter(None)
        loaded = state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2}, others=15)
        wanted = []
        for _ in range(100):
            wanted.append(loaded.wants_drafter(None))
            assert loaded.next_round(None, draft_available=False) == (PLAIN, 0)
        assert (True in wanted) == probed and wanted[0] is False  # a probe is due: the draft opens for it


def test_the_load_the_prefill_met_decides_the_opening():
    """A request started while the coordinator ran nothing else would open its draft; its prefill's
    step then reports 16 sequences running on the service (a burst arrived meanwhile, or another
    coordinator's requests): it does not. A smaller count does not lower the load it knows."""
    state = AdaptiveState(probe_interval=4)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=30.0)
    policy = state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2})
    assert policy.wants_drafter(None, 64, remaining=64)
    policy.observe_prefill(num_seqs=6, num_running_seqs=16)
    assert not policy.wants_drafter(None, 64, remaining=64)
    policy.observe_prefill(num_seqs=1, num_running_seqs=1)
    assert (policy.load.others_seqs, policy.load.others_tokens) == (15, 15)


def test_a_probe_that_must_open_the_draft_waits_as_long_as_its_prefill_costs():
    """Opening the draft for a probe prefills the whole committed log: the longer it is, and the
    slower the draft's last prefills were, the later the probe, so that a request on a loaded
    service does not prefill a long prompt on the draft for one probe round. A probe pays its share
    of the opening, one per ``probe_interval`` of the remaining tokens: the fewer remain, the later
    the probe, and none is due in the last ``probe_interval`` tokens, which no later round would
    use what it found for."""
    state = AdaptiveState(probe_interval=4)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=2.0)  # would win, were it always right
    state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2})
    state.costs[("llama-cpp", "t")].draft_prefill_ms_per_token = 2.0

    def rounds_to_open(context_tokens: int, remaining: int = 64) -> int:
        loaded = state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2}, others=15)
        for rounds in range(1000):
            if loaded.wants_drafter(None, context_tokens, remaining):
                return rounds
            loaded.next_round(None, draft_available=False)
        raise AssertionError("no probe in 1000 rounds")

    open_at = [rounds_to_open(tokens) for tokens in (0, 640, 6400)]
    assert open_at[0] < open_at[1] < open_at[2]
    # a probe round of 223 ms (2 drafts of 2 ms, the step, overhead) plus its share of prefilling
    # 6400 tokens at 2 ms, 4 of 64 remaining tokens, against a plain round of 199 ms: 4 x 5.1 rounds
    assert open_at[2] == math.ceil(4 * (223 + 6400 * 2 * 4 / 64) / 199) - 1
    assert rounds_to_open(6400, remaining=640) < open_at[2] < rounds_to_open(6400, remaining=16)
    state.costs[("llama-cpp", "t")].observe_draft_prefill(640, 640 * 8.0)  # prefills took 4x that
    assert rounds_to_open(6400) > open_at[2]
    late = state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={NGRAM: 2}, others=15)
    for _ in range(rounds_to_open(64)):
        late.next_round(None, draft_available=False)
    assert late.wants_drafter(None, 64, remaining=64) and not late.wants_drafter(None, 64, remaining=4)


def test_a_probe_comes_while_the_context_grows():
    """Each plain round adds a token to the context a probe's opening prefills: a draft whose
    forward is as slow as the target's plain round (prefill per token seeded at a forward / 16)
    still gets its probe within the request, where a probe priced with the whole opening was put
    off by more than a round every round and never came."""
    drafter = draft_pb2.DrafterInfo(name="transformers", step_ms=8.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[3.0, 4.0, 5.0, 6.0, 7.0])
    policy = AdaptiveState().policy(drafter, target, k_max=4, lookups={})
    prompt_tokens, max_new_tokens = 40, 400
    for generated in range(max_new_tokens):
        if policy.wants_drafter(None, prompt_tokens + generated, max_new_tokens - generated):
            break
        assert policy.next_round(None, draft_available=False) == (PLAIN, 0)
    else:
        raise AssertionError(f"no probe in {max_new_tokens} tokens")
    # a probe of 22 ms (2 forwards of 8 ms, the 3-token verify, overhead) against a plain round of 4:
    # 16 x 5.5 = 88 rounds, and its share of the growing opening puts it off some more
    assert 88 < generated < 120


def test_the_drafter_pays_for_opening_over_the_remaining_tokens():
    """Alone, the drafter pays from the first round; a long context to prefill for few remaining
    tokens does not, once the draft's prefills were seen to be slow."""
    state = AdaptiveState()
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=10.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[60.0, 65.0, 70.0, 75.0, 80.0])
    policy = state.policy(drafter, target, k_max=4, lookups={})
    assert policy.wants_drafter(None, 800, remaining=256) and policy.wants_drafter(None, 800, remaining=64)
    policy.costs.observe_draft_prefill(800, 4000.0)  # 5 ms per token, at once (weight 0.5): 2.8 ms
    assert policy.wants_drafter(None, 800, remaining=256) and not policy.wants_drafter(None, 800, remaining=64)


@pytest.fixture
def drafter_alone(tiny_pipeline, tiny_models):
    """A second coordinator on the same draft and verify services, without hybrid drafting: the
    request's drafter and plain decode are its only choices."""
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=tiny_pipeline.draft_address,
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            max_new_tokens_limit=256,
            hybrid=False,
        )
    )
    yield f"127.0.0.1:{coordinator.port}"
    coordinator.stop()


def test_switching_drafter_falls_back_and_recovers(drafter_alone, tiny_pipeline, tiny_drafters, smollm2_tokenizer):
    """Drafts right for the first 20 tokens, wrong until 60, right again after: the request falls
    back to plain decode in the middle, speculates again at the end, and stays lossless."""
    prompt, max_new = "Tell me a story about a cat.", 200
    ids = chat_ids(smollm2_tokenizer, prompt)
    expected = plain_greedy(tiny_pipeline.plain_model, ids, max_new)
    tiny_drafters["switching"].script = [*ids, *expected]
    completion = generate(
        drafter_alone,
        coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new, drafter="switching"),
        timeout_s=120,
    )
    assert completion.token_ids == expected
    m = completion.metrics
    assert m.adaptive and m.rounds_per_k[0] > 0, "no fallback to plain decode while every draft was wrong"
    assert list(m.drafter_usage) == ["switching"]  # no n-gram rounds without hybrid drafting
    # at most 20 drafts can pass before the switch: many more passed, so speculation resumed
    assert m.num_accepted_draft_tokens > 60, f"no recovery: {m}"


def test_k_shrinks_to_plain_decode_as_the_batch_grows():
    """Goodput under load: a step's cost grows with its batched tokens (here 80 ms alone, then
    about 5 ms per token: the fitted line is 68 ms + 5.0 ms per token), so a session's drafts slow
    every other session's round; with acceptance 0.7 the choice falls from a long proposal alone
    to plain decode in a batch of 16."""
    verify_ms = [80.0, 82.0, 84.0, 86.0, 88.0, 90.0]
    costs = StepCosts(draft_ms_per_token=2.0, verify_ms=verify_ms, batched_ms={8: 110.0, 16: 150.0, 64: 390.0})
    assert [costs.step_ms(n) for n in (16, 40, 128)] == pytest.approx([150.0, 270.0, 710.0], rel=0.02)
    chosen = {}
    for others in (0, 3, 15):
        policy = AdaptiveK(5, "llama-cpp", AcceptanceModel([0.7] * 5), {}, costs)
        policy.load = Load(others_seqs=others, others_tokens=others, round_tokens=1.0)
        chosen[others] = policy.next_round(None)[1]
    assert chosen[0] >= 3 and chosen[0] > chosen[3] >= chosen[15] and chosen[15] == 0


def test_the_others_prefill_is_work_a_lookup_token_must_beat():
    """15 other sequences bring 90 tokens to each step (mostly prefill chunks) and commit 1 token
    each: a 2-token n-gram match passing 35% of the time is worth its verify work next to their
    15 committed tokens (the step's 90 tokens priced as overhead), not next to the step's 90
    tokens of work. Plain decode wins; the same match still wins alone."""
    costs = StepCosts(draft_ms_per_token=2.0, verify_ms=[80.0] * 6, batched_ms={8: 110.0, 16: 150.0, 64: 390.0})
    match = {NGRAM: NgramMatch(2, [7, 8])}
    loaded = AdaptiveK(5, None, None, {NGRAM: [AcceptanceModel([0.35] * 5)] * 2}, costs)
    loaded.load = Load(others_seqs=15, others_tokens=90, round_tokens=1.0)
    assert loaded.next_round(match) == (PLAIN, 0)
    alone = AdaptiveK(5, None, None, {NGRAM: [AcceptanceModel([0.35] * 5)] * 2}, costs)
    assert alone.next_round(match)[0] == NGRAM


def test_the_wait_for_the_step_in_progress_does_not_make_a_round_look_dear():
    """Under a burst a round waits hundreds of ms behind other prompts' prefill chunks: that is
    their work, not this request's cost, and does not make speculation look worth a draft that,
    with 15 others in the step, does not pay."""
    state = AdaptiveState()
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=10.0)
    loaded = state.policy(drafter, BATCHING_TARGET, k_max=4, lookups={}, others=15)
    assert not loaded.wants_drafter(None, 64, remaining=64)
    waited = RoundRecord(
        drafter=PLAIN,
        k=0,
        num_drafted=0,
        num_accepted=0,
        draft_ms=0.0,
        verify_ms=705.0,
        wall_ms=707.0,
        wire_bytes=0,
        batch_size=16,
        batched_tokens=16,
        queue_ms=600.0,
        running_seqs=16,
        step_ms=100.0,
    )
    for _ in range(10):
        loaded.observe(waited, None, [1])
    assert not loaded.wants_drafter(None, 64, remaining=64)


# ---- the step budget ----

BATCHED = {8: 100.0, 16: 140.0, 24: 180.0}  # a step of 8, 16, 24 batched tokens: 60 ms + 5 ms a token


def budgeted(rate: float, others: int, bids) -> AdaptiveK:
    """A drafting-ahead llama-cpp request at ``rate`` per position with ``others`` running besides it."""
    costs = StepCosts(draft_ms_per_token=2.0, verify_ms=list(FLAT), overhead_ms=2.0, batched_ms=dict(BATCHED))
    load = Load(others_seqs=others, others_tokens=others)
    return AdaptiveK(
        4, "llama-cpp", AcceptanceModel([rate] * 4), {}, costs, load=load, bids=bids, hidden_behind_verify=True
    )


def rounds_of(requests: list[AdaptiveK]) -> list[tuple[str, int]]:
    """Each request's next round after one round in which every request bid."""
    for policy in requests:
        policy.next_round({})
    return [policy.next_round({}) for policy in requests]


def test_the_step_budget_gives_the_drafts_to_the_requests_they_pay_for():
    """7 requests drafting at 95% and one at 60% in one step: priced alone (others assumed to
    commit what it commits), the 60% one drafts a token; in the budget the 95% ones' drafts raise
    the step's goodput past what its token adds, and it decodes plainly. The 95% ones keep K = 4."""
    alone = rounds_of([*(budgeted(0.95, 7, None) for _ in range(7)), budgeted(0.6, 7, None)])
    assert alone[0] == ("llama-cpp", 4) and alone[-1] == ("llama-cpp", 1)
    state = AdaptiveState()
    bids = state.bids.setdefault("target", weakref.WeakKeyDictionary())
    shared = rounds_of([*(budgeted(0.95, 7, bids) for _ in range(7)), budgeted(0.6, 7, bids)])
    assert shared[0] == ("llama-cpp", 4) and shared[-1] == (PLAIN, 0)


def test_alone_the_budget_leaves_the_requests_own_choice():
    """Nobody else in the step: the request's own pricing (draft-ahead's overlap included) decides."""
    bids: dict = {}
    assert budgeted(0.6, 0, bids).next_round({}) == budgeted(0.6, 0, None).next_round({})
    assert len(bids) == 1

"""A fixed K as a policy: the same drafter and K every round, plain rounds decoded ahead only at
K = 0, no lookups and nothing learnt (its rounds against plain decoding are
test_greedy_equality.py's)."""

from coordinator.observability.metrics import RoundRecord
from coordinator.speculation.policy.fixed import FixedK
from specdec.lookups.ngram import NgramMatch


def test_every_round_asks_the_same_drafter_for_the_same_k():
    policy, match = FixedK("llama-cpp", 4), {"ngram": NgramMatch(2, [7, 8])}
    assert policy.next_round({}, draft_available=True) == ("llama-cpp", 4)
    assert policy.next_round(match, draft_available=False) == ("llama-cpp", 4)  # the round then decodes plainly
    assert (policy.k_max, policy.k_limit, dict(policy.lookups), policy.lookups_on) == (4, 4, {}, False)


def test_the_draft_opens_beside_the_prefill_and_not_for_a_round():
    policy = FixedK("llama-cpp", 4)
    assert policy.opens_draft_at_prefill(64, remaining=64)
    assert not policy.wants_drafter({}, 64, remaining=64)  # a round's Propose reopens it (DraftSession.proposal)


def test_only_plain_decode_decodes_ahead_and_nothing_is_learnt():
    assert FixedK("", 0).decodes_ahead({}, draft_available=False)
    assert not FixedK("llama-cpp", 4).decodes_ahead({}, draft_available=True)
    policy = FixedK("llama-cpp", 4)
    record = RoundRecord(
        drafter="llama-cpp",
        k=4,
        num_drafted=4,
        num_accepted=0,
        draft_ms=5.0,
        verify_ms=80.0,
        wall_ms=90.0,
        wire_bytes=0,
    )
    policy.observe(record, {}, [1])
    policy.observe_prefill(16, 16)
    policy.observe_draft_prefill(64, 100.0)
    assert policy == FixedK("llama-cpp", 4) and policy.end() is None

"""The lookup ledger: a request's lookups that do not pay are turned off; those that pay stay on.
The lookup memory: new requests under load skip lookups that recent requests never chose."""

from coordinator.observability.metrics import PLAIN, RoundRecord
from coordinator.speculation.policy.acceptance_model import AcceptanceModel
from coordinator.speculation.policy.adaptive import AdaptiveK
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from coordinator.speculation.policy.lookup_ledger import IDLE_REQUESTS, IDLE_SEARCHES, TRIAL_EVERY, LookupLedger
from coordinator.speculation.policy.step_costs import Load, StepCosts
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramMatch
from specdec.v1 import draft_pb2, verify_pb2

FLAT = [60.0, 70.0, 75.0, 80.0, 85.0]  # verify ms for K = 0..4, like SmolLM2 on 2 CPU cores


BATCHED = {8: 100.0, 16: 140.0, 24: 180.0}  # a step of 8, 16, 24 batched tokens: 60 ms + 5 ms a token


def lookup_request(others: int) -> AdaptiveK:
    """A request whose n-gram estimates read 95% (a run of passes) with ``others`` besides it."""
    costs = StepCosts(draft_ms_per_token=15.0, verify_ms=list(FLAT), overhead_ms=2.0, batched_ms=dict(BATCHED))
    load = Load(others_seqs=others, others_tokens=others)
    return AdaptiveK(4, None, None, {NGRAM: [AcceptanceModel([0.95] * 4)]}, costs, load=load)


def lookup_round(drafter: str, k: int, accepted: int) -> RoundRecord:
    """A round of ``k`` drafts by ``drafter``, ``accepted`` of them accepted, in 102 ms."""
    return RoundRecord(
        drafter=drafter,
        k=k,
        num_drafted=k,
        num_accepted=accepted,
        draft_ms=0.0,
        verify_ms=100.0,
        wall_ms=102.0,
        wire_bytes=0,
    )


def test_lookups_that_do_not_pay_are_turned_off_for_the_request():
    """Under load every lookup round is rejected at its first token: once the lookups drafted 8
    tokens and gained nothing of what they owed, the request stops looking up."""
    policy, match = lookup_request(7), NgramMatch(2, [7, 8, 9, 10])
    while policy.lookups_on:
        drafter, k = policy.next_round({NGRAM: match})
        assert drafter == NGRAM and k > 0
        policy.observe(lookup_round(NGRAM, k, 0), {NGRAM: match}, [3])
    ledger = policy.lookup_ledger
    assert ledger.drafted >= 8 and ledger.gained == 0 < ledger.owed


def test_lookups_that_pay_stay_on():
    policy, match = lookup_request(7), NgramMatch(2, [7, 8])
    for _ in range(20):
        drafter, k = policy.next_round({NGRAM: match})
        policy.observe(lookup_round(drafter, k, k), {NGRAM: match}, [7, 8, 3][: k + 1])
    assert policy.lookups_on and policy.lookup_ledger.drafted >= 8
    assert policy.lookup_ledger.gained >= policy.lookup_ledger.owed > 0


def test_lookups_are_not_searched_where_even_a_sure_proposal_would_lose():
    """A step that costs 5 ms a token beside 7 others (the lookups at 95%) leaves a sure lookup
    proposal worth its tokens: looked up. At 40 ms a token beside 31 others even 4 sure tokens
    lose to plain decode: not looked up (their ledger still open), until the load is gone."""
    assert lookup_request(7).lookups_on
    policy = lookup_request(31)
    policy.costs = StepCosts(15.0, verify_ms=list(FLAT), batched_ms={8: 380.0, 16: 700.0, 32: 1340.0})
    assert policy.lookup_ledger.paid and not policy.lookups_on
    policy.load = Load()
    assert policy.lookups_on


def unlikely_lookup_request(others: int) -> AdaptiveK:
    """A request whose n-gram estimates read 5%: its matches are searched but never chosen."""
    policy = lookup_request(others)
    policy.lookups = {NGRAM: [AcceptanceModel([0.05] * 4)]}
    return policy


def test_under_load_lookups_searched_and_never_chosen_are_turned_off():
    """Beside 7 others, a search whose match is never good enough to choose costs the coordinator's
    CPU for nothing: after IDLE_SEARCHES such rounds the request stops looking up."""
    policy, match = unlikely_lookup_request(7), NgramMatch(2, [7, 8, 9, 10])
    rounds = 0
    while policy.lookups_on:
        assert policy.next_round({NGRAM: match}) == (PLAIN, 0)
        policy.observe(lookup_round(PLAIN, 0, 0), {NGRAM: match}, [3])
        rounds += 1
    assert rounds == IDLE_SEARCHES and policy.lookup_ledger.drafted == 0


def test_alone_lookups_are_searched_whether_chosen_or_not():
    """Alone, a search costs a sliver of the round: plain rounds do not count against it."""
    policy, match = unlikely_lookup_request(0), NgramMatch(2, [7, 8, 9, 10])
    for _ in range(3 * IDLE_SEARCHES):
        policy.observe(lookup_round(PLAIN, 0, 0), {NGRAM: match}, [3])
    assert policy.lookups_on and policy.lookup_ledger.searched_idle == 0


def test_a_chosen_lookup_starts_the_idle_count_again():
    ledger = LookupLedger()
    for _ in range(IDLE_SEARCHES - 1):
        ledger.under_load(searched=True, chosen=False)
    ledger.under_load(searched=True, chosen=True)
    for _ in range(IDLE_SEARCHES - 1):
        ledger.under_load(searched=True, chosen=False)
    assert ledger.paid
    ledger.under_load(searched=True, chosen=False)
    assert not ledger.paid


def idle_ledger(searched: bool) -> LookupLedger:
    """The ledger of a request whose lookups were never chosen in IDLE_SEARCHES rounds under load,
    ``searched`` or not."""
    ledger = LookupLedger()
    for _ in range(IDLE_SEARCHES):
        ledger.under_load(searched=searched, chosen=False)
    return ledger


def hybrid_request(state: AdaptiveState, others: int, owner: str = "") -> AdaptiveK:
    """A new request with a model drafter and the n-gram lookup beside it."""
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=7.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=list(FLAT))
    return state.policy(drafter, target, k_max=4, lookups={NGRAM: 2}, others=others, owner=owner)


def test_requests_under_load_skip_lookups_that_recent_requests_never_chose():
    """After IDLE_REQUESTS requests in a row whose lookups were never chosen under load (searched
    or not), a request that starts under load has none (one in TRIAL_EVERY still tries them), one
    that starts alone has them, and so do another owner's and one whose drafter is the lookup; a
    request that chose its lookups gives them back to every request."""
    state = AdaptiveState()
    for i in range(IDLE_REQUESTS):
        request = hybrid_request(state, others=7)
        assert request.lookups
        request.lookup_ledger = idle_ledger(searched=i % 2 == 0)
        request.end()
    started = [hybrid_request(state, others=7) for _ in range(2 * TRIAL_EVERY)]
    assert [bool(request.lookups) for request in started].count(True) == 2
    assert hybrid_request(state, others=0).lookups and hybrid_request(state, others=7, owner="b").lookups
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=list(FLAT))
    assert state.policy(None, target, k_max=4, lookups={NGRAM: 2}, others=7).lookups  # its drafter: the lookup
    for request in started:
        request.end()  # no verdict: skipped, or ended before IDLE_SEARCHES rounds
    assert not all(hybrid_request(state, others=7).lookups for _ in range(TRIAL_EVERY))
    trial = next(request for request in iter(lambda: hybrid_request(state, others=7), None) if request.lookups)
    trial.lookup_ledger.charge(2, 0.5)  # a lookup chosen once
    trial.end()
    assert all(hybrid_request(state, others=7).lookups for _ in range(TRIAL_EVERY))

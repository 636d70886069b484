"""What adaptive requests share: the verify service's published step line, warm starts per owner
(and, through the request store, per coordinator replica), and the step budget's bids."""

import asyncio

import pytest

from coordinator.speculation.policy.acceptance_model import AcceptanceModel
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from coordinator.speculation.policy.k_policy import Learnt
from specdec.engine.step_line import fit_line
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.v1 import common_pb2, draft_pb2, verify_pb2

FLAT = [60.0, 70.0, 75.0, 80.0, 85.0]  # verify ms for K = 0..4, like SmolLM2 on 2 CPU cores


def measure(model: AcceptanceModel, rate: float) -> None:
    """As if a request's rounds had observed every position of ``model`` at ``rate``."""
    model.rates, model.counts = [rate] * len(model.rates), [1] * len(model.rates)


def test_rounds_are_priced_by_the_verify_services_published_step_line():
    """A fresh coordinator prices by the line the verify service published (its GetInfo's, then
    the newest Step message's), which sees every coordinator's steps; its own fit of its few
    rounds only where the service publishes none."""
    published: list[tuple[float, float]] = []
    state = AdaptiveState(service_line=lambda: published[-1] if published else None)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=7.0)
    load = common_pb2.ServiceLoad(step_intercept_ms=40.0, step_ms_per_token=2.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[50.0, 55.0, 60.0], load=load)
    costs = state.policy(drafter, target, k_max=4, lookups={}).costs
    assert costs.step_ms(10) == pytest.approx(40.0 + 2.0 * 10)  # GetInfo's line
    published.append((30.0, 1.0))  # a Step message's
    assert costs.step_ms(10) == pytest.approx(30.0 + 1.0 * 10)
    own = AdaptiveState().policy(
        drafter, verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[50.0, 55.0, 60.0]), 4, {}
    )
    # no service line: its own fit through K = 1..4 (K = 3 and 4 at K = 2's measurement)
    assert own.costs.line() == pytest.approx(fit_line({2: 55.0, 3: 60.0, 4: 60.0, 5: 60.0}))


def test_sessions_warm_start_from_the_previous_ones():
    state = AdaptiveState(prior_rate=0.8)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=7.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[50.0, 55.0, 60.0])
    first = state.policy(drafter, target, k_max=4, lookups={NGRAM: 2})
    assert first.acceptance.rates == [0.8] * 4 and first.costs.verify_ms == [50.0, 55.0, 60.0, 60.0, 60.0]
    assert [m.rates for m in first.lookups[NGRAM]] == [[0.5] * 4] * 2  # observed every round: no optimism needed
    measure(first.acceptance, 0.0)
    measure(first.lookups[NGRAM][1], 1.0)
    # what it observed alone: not the n-gram's 1-token matches nor the forced-token lookup's
    assert first.end() == Learnt("", {"llama-cpp": [0.4] * 4, "ngram/2": [0.75] * 4})
    second = state.policy(drafter, target, k_max=4, lookups={NGRAM: 2})
    assert second.acceptance.rates == [0.4] * 4 and second.costs is first.costs
    assert [m.rates for m in second.lookups[NGRAM]] == [[0.5] * 4, [0.75] * 4]
    lookup_only = state.policy(None, target, k_max=4, lookups={NGRAM: 2})  # drafter "ngram": no model
    assert lookup_only.drafter is None and lookup_only.lookups[NGRAM][1].rates == [0.75] * 4


def test_an_owner_warm_starts_from_its_own_requests_alone():
    """Warm starts are per owner: requests of ka whose drafts all failed lower ka's estimates, not
    kb's, whose requests start from the priors; kb's own requests still teach kb's."""
    state = AdaptiveState(prior_rate=0.8)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=7.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[50.0, 55.0, 60.0])
    for _ in range(5):  # an attacker's requests, every draft rejected
        steering = state.policy(drafter, target, k_max=4, lookups={NGRAM: 2}, owner="ka")
        measure(steering.acceptance, 0.0)
        measure(steering.lookups[NGRAM][0], 0.0)
        steering.end()
    victim = state.policy(drafter, target, k_max=4, lookups={NGRAM: 2}, owner="kb")
    assert victim.acceptance.rates == [0.8] * 4
    assert [m.rates for m in victim.lookups[NGRAM]] == [[0.5] * 4] * 2
    assert state.policy(drafter, target, k_max=4, lookups={}, owner="ka").acceptance.rates[0] < 0.1
    measure(victim.acceptance, 1.0)
    assert victim.end() == Learnt("kb", {"llama-cpp": [0.9] * 4})  # for kb's estimates in the store
    assert state.policy(drafter, target, k_max=4, lookups={}, owner="kb").acceptance.rates == [0.9] * 4


@pytest.mark.parametrize("with_store", ["memory", "redis"], indirect=True)
@pytest.mark.parametrize("learner_ends_first", [True, False])
def test_a_replica_stores_only_the_estimates_its_requests_observed(with_store, learner_ends_first):
    """Two coordinator replicas' requests on one target, each started from the store's estimates
    (none yet): one's request measures the self-draft, the other's never drafts with it (its
    lookup alone pays), so the self-draft's estimate there is the default prior it warm-started.
    Whichever ends last, the store keeps the measured estimate, and the n-gram's of both."""
    drafter = draft_pb2.DrafterInfo(name="transformers", step_ms=60.0)
    model = f"learner-ends-first-{learner_ends_first}"  # a Redis of the whole session: a hash of its own
    target = verify_pb2.VerifyServiceGetInfoResponse(model=model, verify_ms=FLAT)
    learner, bystander = AdaptiveState(prior_rate=0.8), AdaptiveState(prior_rate=0.8)

    async def start(state: AdaptiveState, store):  # as the coordinator admits an adaptive request
        state.set_priors(model, await store.load_priors(model))
        return state.policy(drafter, target, k_max=4, lookups={NGRAM: 1})

    async def end(policy, store):  # as the coordinator closes it
        learnt = policy.end()
        await store.save_priors(model, learnt.priors, learnt.owner)

    async def scenario(store):
        learning, bystanding = await asyncio.gather(start(learner, store), start(bystander, store))
        measure(learning.acceptance, 1.0)
        measure(learning.lookups[NGRAM][0], 0.6)
        measure(bystanding.lookups[NGRAM][0], 0.2)
        for policy in (learning, bystanding) if learner_ends_first else (bystanding, learning):
            await end(policy, store)
        stored = await store.load_priors(model)
        assert stored["transformers"] == pytest.approx([0.9] * 4)  # not the bystander's 0.8
        assert stored["ngram/1"] == pytest.approx([0.35 if learner_ends_first else 0.55] * 4)  # the last one's
        assert "forced" not in stored  # neither observed it

    with_store(scenario)


def test_a_requests_bid_leaves_with_it():
    state = AdaptiveState()
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=2.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=FLAT)
    policies = [state.policy(drafter, target, k_max=4, lookups={}) for _ in range(2)]
    for policy in policies:
        policy.next_round({})
    assert len(state.bids["t"]) == 2
    policies.pop().end()
    assert len(state.bids["t"]) == 1
    policies.clear()  # a request that failed: its policy goes, and its bid with it
    assert len(state.bids["t"]) == 0
    assert AdaptiveState(step_budget=False).policy(drafter, target, k_max=4, lookups={}).bids is None

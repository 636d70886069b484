"""The step budget on synthetic step costs: a step line, a load and acceptance rates in, K per
request out; greedy marginal goodput checked against every allocation of a small case."""

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinator.speculation.policy.step_budget import Bid, allocate


def goodput(bids: dict[str, Bid], ks: dict[str, int], intercept: float, slope: float, others: float) -> float:
    """Expected committed tokens per ms of a step where each bidder verifies ks[bidder] drafts."""
    tokens = len(bids) + others
    expected, cost = tokens, intercept + slope * tokens
    for key, bid in bids.items():
        running = 1.0
        for p in bid.passing[: ks[key]]:
            running = min(running, p)
            expected += running
            cost += slope + bid.draft_ms
    return expected / cost


def test_a_cheap_step_verifies_every_likely_draft():
    """A GPU-like step (its fixed cost dominates): every draft that passes often pays."""
    bids = {"a": Bid([0.9, 0.8, 0.7]), "b": Bid([0.95, 0.6])}
    assert allocate(bids, intercept_ms=50.0, slope_ms=0.5) == {"a": 3, "b": 2}


def test_a_step_priced_per_token_turns_speculation_off_for_all():
    """A CPU-like step (cost per token dominates), 32 requests at 60% acceptance: K = 0 for all."""
    bids = {i: Bid([0.6, 0.36, 0.22]) for i in range(32)}
    assert set(allocate(bids, intercept_ms=5.0, slope_ms=5.0).values()) == {0}


def test_the_likely_drafts_win_the_budget_and_the_unlikely_get_none():
    """Tokens 6 (2 bidders, 4 others), 44 ms: a's drafts (0.95 and 0.9 per 4 ms) beat the step's
    6 / 44 tokens a ms and keep beating it as it rises; b's (0.3 per 4 ms) does not."""
    bids = {"a": Bid([0.95, 0.9]), "b": Bid([0.3])}
    assert allocate(bids, intercept_ms=20.0, slope_ms=4.0, others_tokens=4.0) == {"a": 2, "b": 0}


def test_more_load_means_fewer_drafts():
    bids = {"a": Bid([0.9, 0.8, 0.7, 0.6])}
    ks = [allocate(bids, 20.0, 2.0, others_tokens=others)["a"] for others in (0.0, 8.0, 32.0, 128.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] == 4 and ks[-1] == 0


def test_a_draft_on_the_targets_hardware_pays_for_its_forwards():
    """The same acceptance: drafts from a lookup pay, from a draft whose forwards cost 10 ms each do not."""
    passing = [0.8, 0.64]
    assert allocate({"lookup": Bid(passing)}, 30.0, 2.0, others_tokens=7.0) == {"lookup": 2}
    assert allocate({"draft": Bid(passing, draft_ms=10.0)}, 30.0, 2.0, others_tokens=7.0) == {"draft": 0}


def test_pass_probabilities_are_taken_as_non_increasing():
    """A later draft never passes unless the earlier did: [0.1, 0.99] is priced as [0.1, 0.1]."""
    assert allocate({"a": Bid([0.1, 0.99])}, 10.0, 1.0, others_tokens=10.0) == {"a": 0}


def test_every_bidder_is_answered_and_a_bad_price_refused():
    assert allocate({}, 10.0, 1.0) == {}
    assert allocate({"plain": Bid([])}, 10.0, 1.0) == {"plain": 0}
    with pytest.raises(ValueError, match="slope_ms > 0"):
        allocate({"a": Bid([0.9])}, 10.0, 0.0)


def test_a_line_below_zero_at_no_tokens_still_prices_the_step():
    """A line fitted through steps dearer per token the larger they are starts below 0 (at the
    near-free ceiling, 64 streams, its intercept with the round's overhead read -6 to -7 ms, and the
    budget refused it, failing 2 requests). It prices a token added to the step above the step's
    mean, so no draft token raises the goodput, however sure."""
    bids = {i: Bid([0.99] * 4) for i in range(64)}
    assert set(allocate(bids, -6.3, 1.226).values()) == {0}
    assert allocate({"a": Bid([0.99])}, -5.0, 1.0) == {"a": 0}  # a step priced at nothing or less


rates = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=3)


@settings(max_examples=150, deadline=None)
@given(
    passing=st.lists(rates, min_size=1, max_size=3),
    draft_ms=st.lists(st.sampled_from([0.0, 3.0]), min_size=3, max_size=3),
    intercept=st.floats(-50.0, 100.0),
    slope=st.floats(0.1, 10.0),
    others=st.floats(0.0, 20.0),
)
def test_greedy_is_the_best_allocation(passing, draft_ms, intercept, slope, others):
    """No allocation of prefixes (each bidder any K up to its drafts) has a higher goodput, the
    intercept below 0 included wherever the step it prices costs more than nothing."""
    assume(intercept + slope * (len(passing) + others) > 0)
    bids = {i: Bid(p, draft_ms[i]) for i, p in enumerate(passing)}
    best = goodput(bids, allocate(bids, intercept, slope, others), intercept, slope, others)
    for choice in itertools.product(*(range(len(p) + 1) for p in passing)):
        ks = dict(enumerate(choice))
        assert goodput(bids, ks, intercept, slope, others) <= best * (1 + 1e-9)

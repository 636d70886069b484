"""The acceptance estimates per draft position: expected tokens, what a round observes, and the
optimism about positions never reached."""

import pytest

from coordinator.speculation.policy.acceptance_model import AcceptanceModel
from coordinator.speculation.policy.adaptive import AdaptiveK
from coordinator.speculation.policy.step_costs import StepCosts

FLAT = [60.0, 70.0, 75.0, 80.0, 85.0]  # verify ms for K = 0..4, like SmolLM2 on 2 CPU cores


def test_expected_tokens_follow_the_per_position_rates():
    model = AcceptanceModel([0.9, 0.5, 0.2, 0.0])
    assert model.expected_tokens(0) == 1.0
    assert model.expected_tokens(3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert AcceptanceModel([0.5] * 4).expected_tokens(4) == pytest.approx((1 - 0.5**5) / 0.5)  # the brief's formula


def test_observe_updates_only_the_observed_positions():
    model = AcceptanceModel([0.5] * 4, weight=0.5)
    model.observe(drafted=4, accepted=1)  # position 1 passed, position 2 rejected, 3 and 4 unseen
    assert model.rates == [0.75, 0.25, 0.5, 0.5]
    model.observe(drafted=2, accepted=2)  # both passed, nothing rejected
    assert model.rates == [0.875, 0.625, 0.5, 0.5]


def test_positions_rarely_reached_count_the_deepest_trusted_rate():
    """Optimism under uncertainty: rounds of K = 2 that always pass lift positions 3 and 4, which
    no round reached, to position 2's rate, so that K grows, and a position reached by fewer
    rounds than the EMA's memory still counts it; before any observation, and below the deepest
    trusted position's rate, the estimates count as they are."""
    model = AcceptanceModel([0.3] * 4, weight=0.5)
    assert model.expected_tokens(4) == pytest.approx(1 + 0.3 + 0.09 + 0.027 + 0.0081)
    for _ in range(4):
        model.observe(drafted=2, accepted=2)
    assert model.observed == 2 and model.rates[2:] == [0.3, 0.3]
    rate = model.rates[1]
    assert model.expected_tokens(4) == pytest.approx(sum(rate**i for i in range(5)))
    costs = StepCosts(draft_ms_per_token=5.0, verify_ms=list(FLAT), overhead_ms=2.0)
    policy = AdaptiveK(4, "llama-cpp", model, {}, costs)
    assert policy.next_round({}) == ("llama-cpp", 4)
    # position 3 rejected once: observed, but by fewer rounds than the EMA's memory (1 / weight =
    # 2), so it still counts position 2's rate; rejected again, its own
    model.observe(drafted=4, accepted=2)
    rate = model.rates[1]
    assert model.observed == 3 and model.expected_tokens(4) == pytest.approx(sum(rate**i for i in range(5)))
    model.observe(drafted=4, accepted=2)
    rate = model.rates[1]
    assert model.expected_tokens(4) < 1 + rate + rate**2 + rate**3

"""Step costs and load: what live rounds teach, the draft link's round trip, the step line, and
the others a round's load counts."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.observability.metrics import PLAIN, RoundRecord
from coordinator.speculation.policy.step_costs import Load, StepCosts
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM


def test_costs_follow_live_rounds():
    costs = StepCosts(draft_ms_per_token=10.0, verify_ms=[50.0, 60.0], overhead_ms=1.0, weight=0.5)
    costs.observe(
        RoundRecord(
            drafter="llama-cpp",
            k=1,
            num_drafted=1,
            num_accepted=1,
            draft_ms=20.0,
            verify_ms=80.0,
            wall_ms=106.0,
            wire_bytes=0,
        ),
        draft_call=True,
    )
    assert (costs.draft_ms_per_token, costs.verify_ms, costs.overhead_ms) == (15.0, [50.0, 70.0], 3.5)
    costs.observe(
        RoundRecord(
            drafter=NGRAM, k=1, num_drafted=1, num_accepted=1, draft_ms=0.0, verify_ms=70.0, wall_ms=73.0, wire_bytes=0
        ),
        draft_call=False,
    )
    assert (costs.draft_ms_per_token, costs.overhead_ms) == (15.0, 3.25)  # a lookup round: no draft time
    # in a batch: the step's forward time (120 ms) is the cost of its 8 tokens; the 180 ms the call
    # waited for it (counted in the service's 300 ms) was other sequences' work: priced nowhere
    costs.observe(
        RoundRecord(
            drafter=PLAIN,
            k=0,
            num_drafted=0,
            num_accepted=0,
            draft_ms=0.0,
            verify_ms=300.0,
            wall_ms=302.0,
            wire_bytes=0,
            batch_size=4,
            batched_tokens=8,
            queue_ms=180.0,
            step_ms=120.0,
        ),
        draft_call=False,
    )
    # (a new point starts from the line through the alone costs, 30 + 20 ms per token: 190 ms)
    assert costs.batched_ms[8] == pytest.approx(155.0) and costs.overhead_ms == pytest.approx(2.625)
    assert costs.round_ms(0, draft_call=False) == pytest.approx(min(50.0, costs.step_ms(2)) + 2.625)
    assert costs.round_ms(1) == pytest.approx(15.0 + costs.step_ms(2) + 2.625)


def test_a_round_trip_to_the_draft_alone_delays_a_proposal_drafted_ahead():
    """The coordinator beside the verify service, 20 ms to the draft: a proposal drafted ahead is
    ready 20 ms after its forwards, past a verify call that answers over loopback, so a round
    waits for it; where both links carry the same round trip (in the round's overhead), the
    verify hides it."""
    beside = StepCosts(draft_ms_per_token=10.0, verify_ms=[50.0] * 9, overhead_ms=2.0, propose_call_ms=20.0)
    # 4 + 1 forwards (50 ms) against a verify of 50 ms + 2 ms: the round trip outlasts it by 18 ms
    assert beside.draft_wait_ms(4, 50.0, hit_probability=1.0) == pytest.approx(18.0)
    apart = dataclasses.replace(beside, overhead_ms=22.0)
    assert apart.draft_wait_ms(4, 50.0, hit_probability=1.0) == 0.0
    # a miss also waits for a proposal of its own, round trip included
    assert beside.draft_wait_ms(4, 50.0, hit_probability=0.0) == pytest.approx(18.0 + 20.0 + 40.0)


def test_a_step_that_ran_prefill_chunks_stays_out_of_the_step_line():
    """The step line's slope is a draft token's cost: a step of 14 decodes and a 128-token
    prefill chunk (cheaper tokens) would bring it down to what a chunk's token costs."""
    costs = StepCosts(draft_ms_per_token=1.0, verify_ms=[50.0, 60.0], batched_ms={14: 150.0, 28: 210.0})
    line = [costs.step_ms(n) for n in (14, 28)]

    def observe_step(prefill: int) -> None:
        record = RoundRecord(
            drafter=PLAIN,
            k=0,
            num_drafted=0,
            num_accepted=0,
            draft_ms=0.0,
            verify_ms=330.0,
            wall_ms=331.0,
            wire_bytes=0,
            batch_size=15,
            batched_tokens=142,
            step_ms=320.0,
            prefill_tokens=prefill,
        )
        costs.observe(record, draft_call=False)

    observe_step(prefill=128)
    assert 142 not in costs.batched_ms and [costs.step_ms(n) for n in (14, 28)] == pytest.approx(line)
    observe_step(prefill=0)  # 142 tokens of decoding work
    assert 142 in costs.batched_ms


def test_load_counts_every_running_sequence_not_only_those_in_the_step():
    """16 sessions run, but the round's step held 4 (the rest were away drafting): the others are
    15, each bringing the step's mean tokens per other sequence."""
    load = Load(weight=1.0)
    record = RoundRecord(
        drafter="llama-cpp",
        k=3,
        num_drafted=3,
        num_accepted=1,
        draft_ms=20.0,
        verify_ms=120.0,
        wall_ms=150.0,
        wire_bytes=0,
        batch_size=4,
        batched_tokens=10,
        running_seqs=16,
    )
    load.observe(record, committed=2)
    assert (load.others_seqs, load.others_tokens, load.round_tokens) == (15, 15 * 2.0, 2)


@given(
    verify_ms=st.lists(st.floats(1.0, 500.0), min_size=1, max_size=9),
    batched=st.dictionaries(st.integers(2, 200), st.floats(1.0, 500.0), max_size=4),
    others_tokens=st.sampled_from([0.0, 0.5, 3.0, 40.0]),
)
def test_a_plain_rounds_verify_is_the_cheapest_of_every_k(verify_ms, batched, others_tokens):
    """round_ms(0) prices the verify at the cheapest of every K's (read at the line's ends, as
    the line is straight in K), whatever the line's slope."""
    costs = StepCosts(draft_ms_per_token=5.0, verify_ms=verify_ms, overhead_ms=1.0, batched_ms=batched)
    cheapest = min(costs._verify_ms(j, others_tokens) for j in range(len(verify_ms)))
    assert costs.round_ms(0, others_tokens=others_tokens) == pytest.approx(cheapest + costs._overhead_ms(0))

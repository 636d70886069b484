"""The Propose deadline the coordinator derives from the draft's measured round trips."""

import pytest

from coordinator.speculation.upstream import ProposeDeadline
from specdec.v1 import draft_pb2


def test_the_deadline_starts_at_ten_floors_and_is_capped():
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=30).seconds(9) == pytest.approx(2.5)
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=1).seconds(9) == 1


def test_the_deadline_follows_the_slowest_recent_call_scaled_to_the_forwards():
    deadline = ProposeDeadline(floor_s=0.05, factor=3, ceiling_s=30, window=3)
    deadline.observe(0.100, 9)  # a K = 8 round: 2 tokens appended (one forward), 8 drafted
    deadline.observe(0.150, 14)  # a catch-up: 92 tokens appended after rounds without the draft, 8 drafted
    assert deadline.seconds(9) == pytest.approx(0.3)  # the catch-up does not stretch a short call
    assert deadline.seconds(18) == pytest.approx(0.6)  # nor does a longer catch-up miss its deadline
    deadline.observe(0.010, 9)
    assert deadline.seconds(9) == pytest.approx(0.3)  # the slowest recent call counts
    deadline.observe(0.010, 9)
    deadline.observe(0.010, 9)  # the slow calls have left the window of 3
    assert deadline.seconds(9) == pytest.approx(0.05)  # the floor


@pytest.mark.parametrize(
    ("appended", "predicted", "k", "forwards"),
    [(0, 0, 8, 8), (2, 0, 8, 9), (9, 8, 8, 10), (92, 0, 8, 14), (1, 0, 0, 1)],
)
def test_a_propose_costs_its_drafted_tokens_and_its_catch_up_chunks(appended, predicted, k, forwards):
    request = draft_pb2.ProposeRequest(
        appended_token_ids=range(appended), predicted_token_ids=range(predicted), num_speculative_tokens=k
    )
    assert ProposeDeadline.forwards(request) == forwards

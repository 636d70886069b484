"""The Propose deadline the coordinator derives from the draft's measured round trips."""

import pytest

from coordinator.upstream import ProposeDeadline


def test_the_deadline_starts_at_ten_floors_and_is_capped():
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=30).seconds(9) == pytest.approx(2.5)
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=1).seconds(9) == 1


def test_the_deadline_follows_the_slowest_recent_call_scaled_to_the_tokens():
    deadline = ProposeDeadline(floor_s=0.05, factor=3, ceiling_s=30, window=3)
    deadline.observe(0.100, 10)  # a K = 8 round: 2 appended + 8 drafted
    deadline.observe(0.500, 100)  # a catch-up: 92 tokens appended after rounds without the draft
    assert deadline.seconds(10) == pytest.approx(0.3)  # the catch-up does not stretch a short call
    assert deadline.seconds(100) == pytest.approx(3.0)  # nor does a catch-up miss its deadline
    deadline.observe(0.010, 10)
    assert deadline.seconds(10) == pytest.approx(0.3)  # the slowest recent call counts
    deadline.observe(0.010, 10)
    deadline.observe(0.010, 10)  # the slow calls have left the window of 3
    assert deadline.seconds(10) == pytest.approx(0.05)  # the floor

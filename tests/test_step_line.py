"""specdec/engine/step_line.py: the decode step line an engine keeps and its service publishes."""

import pytest

from specdec.engine.step_line import StepLine, fit_line


def test_the_line_goes_through_the_points_without_the_one_token_step():
    # 2 ms + 0.5 ms per token, and a cheap 1-token step (a matrix-vector product) left out
    assert fit_line({1: 1.0, 4: 4.0, 8: 6.0, 16: 10.0}) == pytest.approx((2.0, 0.5))
    # two points: the 1-token step counts (nothing else to fit through)
    assert fit_line({1: 3.0, 5: 5.0}) == pytest.approx((2.5, 0.5))


def test_a_line_never_falls_and_one_point_is_flat():
    intercept, slope = fit_line({2: 9.0, 4: 5.0, 8: 1.0})
    assert slope == 0.0 and intercept > 0
    assert fit_line({6: 7.5}) == (7.5, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_line({})


def test_steps_move_the_profiled_points_by_their_weight():
    line = StepLine(weight=0.5)
    assert line.line() is None
    line.seed([(2, 4.0), (4, 6.0)])
    assert line.line() == pytest.approx((2.0, 1.0))
    line.observe(4, 10.0)  # 6 ms -> 8 ms
    assert line.line() == pytest.approx((0.0, 2.0))
    line.observe(6, 9.0)  # a new point enters as measured: (2, 4), (4, 8), (6, 9)
    assert line.line() == pytest.approx((2.0, 1.25))

"""Token-id helpers shared by the coordinator and the services."""

from specdec.token_ids import common_prefix_length, point_masses


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2  # one list a prefix of the other
    assert common_prefix_length([], [1]) == 0 and common_prefix_length([7], [8]) == 0
    assert common_prefix_length([9, 9, 3], [1, 1, 3, 4], start=2) == 3  # the first 2 taken as agreeing


def test_point_masses_put_probability_one_on_each_token():
    masses = point_masses([5, 0, 5])
    assert [(list(m.token_ids), list(m.probs)) for m in masses] == [([5], [1.0]), ([0], [1.0]), ([5], [1.0])]
    assert point_masses([]) == []

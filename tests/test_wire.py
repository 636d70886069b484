"""Draft distributions to and from their sparse wire form, and the errors a bad one gets."""

import pytest
import torch

from specdec.rpc.errors import InvalidArgument
from specdec.rpc.wire import decode_distributions, encode_distributions
from specdec.v1 import common_pb2


def test_round_trip_keeps_only_the_tokens_with_probability():
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0], [1.0, 0.0, 0.0, 0.0]])
    messages = encode_distributions(probs)
    assert [list(m.token_ids) for m in messages] == [[1, 2], [0]]
    assert torch.equal(decode_distributions(messages, vocab_size=4), probs)


@pytest.mark.parametrize(
    ("ids", "probs", "message"),
    [
        ([1, 2], [1.0], "must pair up"),
        ([4], [1.0], r"ids in \[0, 4\)"),
        ([1, 1], [0.5, 0.5], "list each id once"),
        ([1], [float("nan")], "no NaN"),
        ([1, 2], [0.5, 0.2], "sums to 0.7"),
    ],
)
def test_a_bad_distribution_is_invalid_argument_naming_the_fix(ids, probs, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_distributions([common_pb2.TokenDistribution(token_ids=ids, probs=probs)], vocab_size=4)

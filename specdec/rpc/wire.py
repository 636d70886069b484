"""Conversions between tensors and their wire form in the specdec.v1 messages (a model-free
drafter's point masses, which need no tensor, are :func:`specdec.token_ids.point_masses`)."""

from collections.abc import Sequence

import numpy as np
import torch

from specdec.rpc.errors import InvalidArgument
from specdec.v1 import common_pb2

# float32 softmax rows over a large vocabulary sum to 1 within about 1e-5
DISTRIBUTION_SUM_TOLERANCE = 1e-3


def encode_distributions(probs: torch.Tensor) -> list[common_pb2.TokenDistribution]:
    """``[K, V]`` float32 probabilities -> K sparse TokenDistribution messages (q > 0 only)."""
    out = []
    for row in probs.cpu():
        ids = torch.nonzero(row, as_tuple=True)[0]
        out.append(common_pb2.TokenDistribution(token_ids=ids.tolist(), probs=row[ids].tolist()))
    return out


def decode_distributions(messages: Sequence[common_pb2.TokenDistribution], vocab_size: int) -> torch.Tensor:
    """K TokenDistribution messages -> ``[K, V]`` float32 dense probabilities.

    Raises InvalidArgument when ids and probs differ in length, an id is out of range or listed
    twice, a probability is not in [0, 1] (NaN included), or a distribution does not sum to 1
    (within DISTRIBUTION_SUM_TOLERANCE).
    """
    dense = np.zeros((len(messages), vocab_size), dtype=np.float32)
    for i, msg in enumerate(messages):
        ids = np.asarray(msg.token_ids, dtype=np.int64)
        probs = np.asarray(msg.probs, dtype=np.float32)
        if len(ids) != len(probs) or (len(ids) and (ids.min() < 0 or ids.max() >= vocab_size)):
            raise InvalidArgument(f"draft distribution {i}: token_ids and probs must pair up, ids in [0, {vocab_size})")
        if len(np.unique(ids)) != len(ids) or not np.all((probs >= 0) & (probs <= 1)):
            raise InvalidArgument(f"draft distribution {i}: list each id once, with a probability in [0, 1] (no NaN)")
        total = float(probs.sum(dtype=np.float64))
        if abs(total - 1) > DISTRIBUTION_SUM_TOLERANCE:
            raise InvalidArgument(
                f"draft distribution {i} sums to {total:g}: send the probabilities after the sampling "
                "transform, summing to 1"
            )
        dense[i, ids] = probs
    return torch.from_numpy(dense)

"""Plain-Python helpers over lists of token ids, with no torch, so that the coordinator can share
them with the services: the common prefix of two token lists (the comparison of the rollback rule
in :mod:`specdec.engine.kv`) and the wire distributions of a model-free drafter's proposal (the other
conversions, between tensors and the wire, are :mod:`specdec.rpc.wire`)."""

from collections.abc import Sequence

from specdec.v1 import common_pb2


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` items agree."""
    n, end = start, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


def point_masses(tokens: Sequence[int]) -> list[common_pb2.TokenDistribution]:
    """q of a model-free drafter (n-gram lookup): probability 1 on each proposed token."""
    return [common_pb2.TokenDistribution(token_ids=[t], probs=[1.0]) for t in tokens]

"""Sampling parameters of a request: the dataclass, its validation and its proto form.

No torch here, so the coordinator (which only validates and forwards them) can use it; the
logits -> probabilities transform that both services apply is :mod:`specdec.sampling`.
"""

import math
from dataclasses import dataclass

from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. Raises
    InvalidArgument for a value out of range (NaN and infinities included)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise InvalidArgument(f"temperature is {self.temperature}: it must be finite and >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k is {self.top_k}: it must be >= 0 (0 = no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p is {self.top_p}: it must lie in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        return cls(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed)

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed
        )

"""Sampling parameters of a request: the dataclass, its validation and its proto form.

No torch here, so the coordinator (which only validates and forwards them) can use it; the
logits -> probabilities transform that both services apply is :mod:`specdec.sampling.probs`, and the
logits processors (penalties, logit bias, min_tokens) are :mod:`specdec.sampling.logits_processors`.
"""

import math
from dataclasses import dataclass

from specdec.rpc.errors import InvalidArgument
from specdec.sampling.structured_output import StructuredOutput
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. The processors'
    fields (OpenAI's and vLLM's names and ranges; 0, 1 or empty = off): ``frequency_penalty`` and
    ``presence_penalty`` in [-2, 2] count the generated tokens; ``repetition_penalty`` > 0 covers
    the prompt too; ``logit_bias`` (token id, bias) pairs, bias in [-100, 100]; ``min_tokens``
    holds back ``eos_token_ids``; ``num_prompt_tokens`` says where the generated tokens start.
    ``structured_output``: what the generated tokens must match (None: anything), compiled and
    checked where a tokenizer is at hand (:meth:`StructuredOutput.grammar`). ``logprobs``: the
    target returns each committed token's log-probability and its ``top_logprobs`` most likely
    alternatives' (:mod:`specdec.sampling.logprobs`; the bound on ``top_logprobs`` is the target's
    vocabulary, checked where it is known).
    Raises InvalidArgument for a value out of range (NaN and infinities included)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    structured_output: StructuredOutput | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise InvalidArgument(f"temperature is {self.temperature}: it must be finite and >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k is {self.top_k}: it must be >= 0 (0 = no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p is {self.top_p}: it must lie in (0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgument(f"{name} is {getattr(self, name)}: it must lie in [-2, 2] (0 = off)")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidArgument(
                f"repetition_penalty is {self.repetition_penalty}: it must be finite and > 0 (1 = off)"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:
                raise InvalidArgument(
                    f"logit_bias maps token {token_id} to {bias}: ids must be >= 0 and biases lie in [-100, 100]"
                )
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens is {self.min_tokens}: it must be >= 0 (0 = off)")
        if self.top_logprobs < 0:
            raise InvalidArgument(f"top_logprobs is {self.top_logprobs}: it must be >= 0")
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument(f"top_logprobs is {self.top_logprobs} without logprobs: set logprobs to true")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """True when a logits processor is on (see :mod:`specdec.sampling.logits_processors`)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        return cls(
            msg.temperature,
            msg.top_k,
            msg.top_p or 1.0,
            msg.seed,
            frequency_penalty=msg.frequency_penalty,
            presence_penalty=msg.presence_penalty,
            repetition_penalty=msg.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            min_tokens=msg.min_tokens,
            eos_token_ids=tuple(msg.eos_token_ids),
            num_prompt_tokens=msg.num_prompt_tokens,
            structured_output=StructuredOutput.from_proto(msg.structured_output),
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        structured = None if self.structured_output is None else self.structured_output.to_proto()
        return common_pb2.SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            min_tokens=self.min_tokens,
            eos_token_ids=self.eos_token_ids,
            num_prompt_tokens=self.num_prompt_tokens,
            structured_output=structured,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )

"""The drafter interface, and the proposal loop shared by model-based drafters."""

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry import trace

from specdec.kv import KVState
from specdec.sampling import SamplingParams, logits_to_probs, round_generator, sample
from specdec.timing import min_ms
from specdec.v1 import common_pb2
from specdec.wire import encode_distributions, point_masses

tracer = trace.get_tracer(__name__)


@dataclass
class Proposal:
    """Draft tokens and the draft distributions q they were drawn from.

    ``probs`` is ``[len(tokens), V]`` float32 for a model drafter under sampling; None means a
    point mass on each token (greedy decoding, or a model-free drafter).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def distributions(self) -> list[common_pb2.TokenDistribution]:
        if self.probs is not None:
            return encode_distributions(self.probs)
        return point_masses(self.tokens)


class DraftSession(abc.ABC):
    """One request's state on a drafter: the committed tokens and whatever cache serves them."""

    def __init__(self, sampling: SamplingParams):
        self.sampling = sampling
        self.committed: list[int] = []

    def prefill(self, committed: Sequence[int]) -> None:
        self.committed = list(committed)

    def sync(self, appended: Sequence[int]) -> None:
        """Appends committed tokens; caches roll back lazily at the next proposal."""
        self.committed.extend(appended)

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Proposes up to ``k`` tokens continuing ``committed``."""

    def close(self) -> None:
        """Frees the session's cache."""

    def kv_cache_bytes(self) -> int:
        """Bytes the session's KV cache holds (0 for a drafter without one)."""
        return 0


class Drafter(abc.ABC):
    """A kind of draft, shared by its sessions.

    ``vocab_fingerprint`` is empty for drafters that work with any vocabulary.
    """

    name: str
    model: str = ""
    vocab_fingerprint: str = ""
    step_ms: float = 0.0  # ms per proposed token, see measure_step_ms

    @abc.abstractmethod
    def new_session(self, sampling: SamplingParams) -> DraftSession: ...

    def measure_step_ms(self, k: int = 8, context_len: int = 64) -> float:
        """Measures the ms per proposed token of a K-token proposal after ``context_len`` tokens
        (the fastest of 3), for the coordinator's choice of K; stores and returns it. The context
        repeats ids 3..31 (valid in any vocabulary), so n-gram lookup finds a match too. It also
        warms the drafter up, so the first request does not pay for lazy initialisation."""
        with tracer.start_as_current_span("measure_step_ms", attributes={"specdec.drafter": self.name}):
            session = self.new_session(SamplingParams())
            session.prefill([3 + i % 29 for i in range(context_len)])
            self.step_ms = min_ms(lambda: session.propose(k)) / k
            session.close()
        return self.step_ms


class ModelDraftSession(DraftSession):
    """Autoregressive proposals from a causal LM whose KV lives in a :class:`KVState`.

    Greedy: the argmax at each step. Sampling: draw from q = the sampling transform of the draft
    logits, seeded by (request seed, committed length), and return q for the acceptance test.
    ``window`` is the draft's context length in tokens: a context that would outgrow it gets no
    proposal, and the round becomes a plain decode step on the verify service.
    """

    def __init__(self, sampling: SamplingParams, kv: KVState, window: int):
        super().__init__(sampling)
        self.kv = kv
        self.window = window

    def prefill(self, committed: Sequence[int]) -> None:
        super().prefill(committed)
        if len(self.committed) < self.window:
            self.kv.prefill(self.committed)

    def propose(self, k: int) -> Proposal:
        if len(self.committed) + k > self.window:
            return Proposal([])
        greedy = self.sampling.greedy
        generator = None if greedy else round_generator(self.sampling.seed, len(self.committed), "draft")
        logits = self.kv.extend(self.kv.reconcile(self.committed))[-1]
        tokens, probs = [], []
        for i in range(k):
            if greedy:
                tokens.append(int(logits.argmax()))
            else:
                q = logits_to_probs(logits, self.sampling)
                tokens.append(sample(q, generator))
                probs.append(q)
            if i + 1 < k:
                logits = self.kv.extend(tokens[-1:])[-1]
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def kv_cache_bytes(self) -> int:
        kv = self.kv  # None once closed
        return kv.cache_bytes() if kv is not None else 0

    def close(self) -> None:
        self.kv = None

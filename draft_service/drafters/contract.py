"""The drafter contract: what every drafter implements, the model-free ones (ngram, suffix) and the
model drafters (:mod:`draft_service.drafters.model_drafting`) alike, in the manner of
transformers' candidate generators.

A :class:`Drafter` makes one :class:`DraftSession` per request (:meth:`Drafter.new_session`: the one
method a drafter must implement). A session holds the request's committed tokens; the draft
service prefills it, tells it the tokens committed since (:meth:`DraftSession.sync`) and asks it
for a :class:`Proposal` of up to K tokens (:meth:`DraftSession.propose`: the one method a session
must implement). The other methods have defaults that fit a drafter without a model, whose
proposal costs no forward: :meth:`DraftSession.start_proposal` proposes at once and refuses to
draft ahead, :meth:`DraftSession.draft_next` drafts nothing proactively, and the session holds no
KV cache. A model drafter overrides them: its proposals run as work of its engine loop, batched
with every other session's.
"""

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from specdec.engine.engine import Engine
from specdec.engine.vocab import check_token_ids
from specdec.rpc.errors import FailedPrecondition
from specdec.rpc.wire import encode_distributions
from specdec.sampling.sampling_params import SamplingParams
from specdec.timing import min_ms
from specdec.token_ids import point_masses
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass
class Proposal:
    """Draft tokens and the draft distributions q they were drawn from.

    ``probs`` is ``[len(tokens), V]`` float32 for a model drafter under sampling; None means a
    point mass on each token (greedy decoding, or a model-free drafter). ``forced``: per token,
    whether the grammar forced it (jump-forward: no draft forward); empty when none was.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    bonus_token_id: int | None = None  # draft-ahead: the guessed bonus token the tokens continue
    forced: list[bool] = field(default_factory=list)
    # draft-ahead: the proposals of the other outcomes drafted (ProposeRequest.num_branches)
    branches: list["Branch"] = field(default_factory=list)
    proactive: bool = False  # drafted before the Propose asked for it (DraftSession.draft_next)

    def first(self, k: int) -> "Proposal":
        """The proposal cut to its first ``k`` tokens, without branches: the one a proposal of
        ``k`` tokens gives, since each draft token depends only on those before it (under sampling
        too: one generator draws them in order)."""
        probs = None if self.probs is None else self.probs[:k]
        return Proposal(self.tokens[:k], probs, self.bonus_token_id, self.forced[:k])

    def distributions(self) -> list[common_pb2.TokenDistribution]:
        if self.probs is not None:
            return encode_distributions(self.probs)
        return point_masses(self.tokens)


@dataclass
class Branch:
    """A proposal drafted ahead for the outcome "the first ``num_accepted`` predicted tokens
    accepted, then ``next_token``" (see :meth:`DraftSession.start_proposal`)."""

    num_accepted: int
    next_token: int
    proposal: Proposal


class DraftSession(abc.ABC):
    """One request's state on a drafter: the committed tokens and whatever cache serves them.
    Must implement :meth:`propose`; the other methods fit a drafter without a model as they are."""

    vocab_size: int | None = None  # a model drafter's: every token id lies below it

    def __init__(self, sampling: SamplingParams):
        self.sampling = sampling
        self.committed: list[int] = []

    def prefill(self, committed: Sequence[int]) -> None:
        """Starts from ``committed``. Raises InvalidArgument for an id outside the vocabulary."""
        check_token_ids(committed, self.vocab_size, "token_ids")
        self.committed = list(committed)

    def sync(self, appended: Sequence[int]) -> None:
        """Appends committed tokens; caches roll back lazily at the next proposal. Raises
        InvalidArgument for an id outside the vocabulary."""
        check_token_ids(appended, self.vocab_size, "appended_token_ids")
        self.committed.extend(appended)

    @abc.abstractmethod
    def propose(self, k: int) -> Proposal:
        """Proposes up to ``k`` tokens continuing ``committed``."""

    def start_proposal(
        self,
        k: int,
        predicted: Sequence[int],
        num_branches: int,
        budget_s: float | None,
        done: Callable[[Proposal | BaseException], None],
    ) -> None:
        """Starts a proposal of up to ``k`` tokens continuing ``committed`` and returns without
        waiting for it: ``done`` is called once with the proposal or the error it raised. With
        ``predicted``, a draft-ahead: the tokens continue ``committed`` + ``predicted`` + the
        draft's guess of the bonus token, with up to ``num_branches`` outcomes drafted within
        ``budget_s`` seconds (None: no limit; :meth:`ModelDraftSession.propose_ahead
        <draft_service.drafters.model_drafting.ModelDraftSession.propose_ahead>`).

        Here (a drafter without a model, whose proposal costs no forward) :meth:`propose` runs at
        once, on this thread, and a draft-ahead fails with FailedPrecondition: only a model drafter
        has a draft's time to hide. A model drafter's proposal runs as work of its engine loop and
        ``done`` comes from the engine's thread, so that the draft service waits for no proposal in
        a thread of its own."""
        try:
            if predicted:
                raise FailedPrecondition(
                    f"drafter {type(self).__name__} proposes without a model: send Propose without "
                    "predicted_token_ids (draft-ahead is for model drafters)"
                )
            proposal = self.propose(k)
        except Exception as err:  # the caller's error to answer with
            done(err)
            return
        done(proposal)

    def draft_next(self, k: int, predicted: Sequence[int], proposal: Proposal) -> bool:
        """Proactive drafting: after answering a Propose with ``proposal`` (of ``k`` tokens after
        ``predicted``), starts drafting the Propose expected next
        (:meth:`~draft_service.drafters.model_drafting.ModelDraftSession.draft_next`). Returns
        whether it started a draft; here never: a proposal without a model costs no forward to
        hide."""
        return False

    def close(self) -> None:  # noqa: B027 (a no-op unless there is a cache: model-free drafters have none)
        """Frees the session's cache."""

    def kv_cache_bytes(self) -> int:
        """Bytes the session's KV cache holds (0 for a drafter without one)."""
        return 0

    def num_cached_tokens(self) -> int:
        """Tokens of the prefilled context found in the drafter's prefix cache, not computed
        again (0 for a drafter without a model)."""
        return 0


class Drafter(abc.ABC):
    """A kind of draft, shared by its sessions.

    ``vocab_fingerprint`` is empty for drafters that work with any vocabulary; ``engine`` is None
    for drafters without a model (their sessions need no batched steps).
    """

    name: str
    model: str = ""
    vocab_fingerprint: str = ""
    step_ms: float = 0.0  # ms per proposed token, see measure_step_ms
    engine: Engine | None = None  # the engine loop of a model drafter's batched steps

    @abc.abstractmethod
    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> DraftSession:
        """A new session. ``cache_salt``: the partition of the drafter's caches shared across
        sessions (a model's prefix cache, the suffix drafter's outputs) that the session reads
        and adds to: the tenant's (docs/security.md#tenants-and-the-caches). ``owner``: whom it
        serves (an opaque tag): a model's KV store that must preempt takes from the owner holding
        the most (:meth:`specdec.engine.batching.BatchedLM.allocate`)."""

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

"""The drafter interface, and the proposal loop shared by model-based drafters."""

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from llguidance import LLTokenizer
from opentelemetry import trace

from specdec.engine.batching import SequenceStep
from specdec.engine.engine import Engine, Work
from specdec.engine.kv import SequenceKV, prefill
from specdec.engine.vocab import check_token_ids
from specdec.rpc.errors import FailedPrecondition
from specdec.rpc.step_server import wait_for_reply
from specdec.rpc.wire import encode_distributions
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.logits_processors import process
from specdec.sampling.probs import argmax, best_other, logits_to_probs, round_generator, sample
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import UNLIMITED, grammar_tokenizer
from specdec.timing import min_ms
from specdec.token_ids import point_masses
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
CANCEL_WAIT_S = 10.0  # closing a session waits this long at most for its proactive draft to stop


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
    proactive: bool = False  # drafted before the Propose asked for it (ModelDraftSession.draft_next)

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
    accepted, then ``next_token``" (see :meth:`ModelDraftSession.propose_ahead`)."""

    num_accepted: int
    next_token: int
    proposal: Proposal


@dataclass
class Alternative:
    """At one draft position, under the draft's distribution there (after the request's
    processors, grammar mask and sampling transform; softmax of the scores under greedy): the
    probability of the token drawn, and the most likely other token with its probability."""

    chosen_prob: float
    token: int
    prob: float

    @classmethod
    def of(cls, probs: torch.Tensor, chosen: int) -> "Alternative":
        """From ``probs`` ``[V]`` float32 and the token drawn."""
        other = best_other(probs, chosen)
        return cls(float(probs[chosen]), other, float(probs[other]))

    @classmethod
    def of_greedy(cls, scores: torch.Tensor, chosen: int) -> "Alternative":
        """From the scores ``[V]`` (float) whose argmax is ``chosen``, under their softmax, without
        writing it out: a vocabulary's softmax and top-2 cost three times the log-normaliser and
        two argmax passes over the same scores."""
        log_normaliser = torch.logsumexp(scores, -1)
        other = best_other(scores, chosen)
        chosen_prob, prob = (scores[[chosen, other]] - log_normaliser).exp().tolist()
        return cls(chosen_prob, other, prob)


class DraftSession(abc.ABC):
    """One request's state on a drafter: the committed tokens and whatever cache serves them."""

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
        """Starts :meth:`propose` (no ``predicted``) or :meth:`propose_ahead` and returns without
        waiting for it: ``done`` is called once with the proposal or the error it raised. Here (a
        drafter without a model, whose proposal costs no forward) it runs at once, on this thread;
        a model drafter's runs as work of its engine loop and ``done`` comes from the engine's
        thread, so that the draft service waits for no proposal in a thread of its own."""
        try:
            proposal = self.propose_ahead(predicted, k, num_branches, budget_s) if predicted else self.propose(k)
        except Exception as err:  # the caller's error to answer with
            done(err)
            return
        done(proposal)

    def keep_alternatives(self) -> None:  # noqa: B027 (a no-op unless drafting ahead: model-free drafters do not)
        """From now on, each proposal keeps its :class:`Alternative` per token, for the branches of
        the draft-ahead that follows it (``ProposeRequest.num_branches`` > 1)."""

    def draft_next(self, k: int, predicted: Sequence[int], proposal: Proposal) -> bool:
        """Proactive drafting (see :meth:`ModelDraftSession.draft_next`); here a no-op: a proposal
        without a model costs no forward to hide. Returns whether it started a draft."""
        return False

    def propose_ahead(
        self, predicted: Sequence[int], k: int, num_branches: int = 1, budget_s: float | None = None
    ) -> Proposal:
        """Drafts ahead: up to ``k`` tokens continuing ``committed`` + ``predicted`` + the draft's
        guess of the bonus token (``Proposal.bonus_token_id``), none of them committed; with
        ``num_branches`` > 1, the proposals of other outcomes too, within ``budget_s`` seconds
        (:meth:`ModelDraftSession.propose_ahead`). Raises FailedPrecondition here: only a model
        drafter has a draft's time to hide."""
        raise FailedPrecondition(
            f"drafter {type(self).__name__} proposes without a model: send Propose without "
            "predicted_token_ids (draft-ahead is for model drafters)"
        )

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


class _Propose(Work):
    """Engine work for one proposal of up to ``k`` tokens: the first step feeds the tokens of the
    context the sequence has not cached, each later one the token chosen at the previous step (one
    step per draft position, batched with every other session's proposal).

    The context is the session's committed tokens, plus, when drafting ahead, the ``predicted``
    ones and a guess of the bonus token: the first step's argmax, which is not a draft token.
    Under sampling the draft tokens are drawn with the generator of their first position, so a
    proposal drafted ahead is the one a plain proposal after the same committed tokens draws.

    With structured output the draft's logits are masked by the grammar as the target's are, so
    its tokens (and, under sampling, its q) stay within the grammar, and where the grammar forces
    text (:meth:`specdec.sampling.grammar.GrammarMatcher.forced_tokens`) those tokens join the proposal
    without a forward of their own (jump-forward; q a point mass on each) and are fed to the model
    with the next step."""

    result: Proposal  # once done

    def __init__(
        self, session: "ModelDraftSession", k: int, predicted: Sequence[int] = (), guess_bonus: bool | None = None
    ):
        self.session, self.seq_id, self.k = session, session.kv_cache.seq_id, k
        self.context = [*session.committed, *predicted]
        # read here, not at each step: a proactive draft runs while a Propose syncs the session
        self.num_committed, self.branching = len(session.committed), session.branching
        self.predicted = list(predicted)
        self.grammar = session.grammar
        self.cancelled = False  # set from another thread: the proposal ends at its next step
        self.started = False  # whether the first step (the uncached context) was fed
        self.num_fed = 0  # chosen tokens fed to the model
        self.bonus: int | None = None  # the guessed bonus token, drafting ahead
        self.bonus_alternative: Alternative | None = None
        self.guess_bonus = bool(predicted) if guess_bonus is None else guess_bonus
        # per draft token, with the session's branching on: its Alternative (None: forced)
        self.alternatives: list[Alternative | None] = []
        self.chosen: list[int] = []  # the bonus guess, then the draft tokens: what the next step feeds
        self.tokens: list[int] = []
        self.forced: list[bool] = []  # per token: the grammar forced it
        self.probs: list[torch.Tensor] = []
        sampling = session.sampling
        first = len(self.context) + self.guess_bonus  # the position of the first draft token
        self.generator = None if sampling.greedy else round_generator(sampling.seed, first, "draft")
        if not self.guess_bonus:
            self._jump_forward()

    def next_step(self, budget: int) -> SequenceStep:
        """The uncached context (first step) and the chosen tokens not fed yet; no state changes
        here: the engine may ask again when a step's budget leaves this work for the next one."""
        kv_cache = self.session.kv_cache
        fresh = [] if self.started else kv_cache.reconcile(self.context, self.num_committed)
        return kv_cache.step([*fresh, *self.chosen[self.num_fed :]])

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        self.session.kv_cache.appended(step)
        self.started, self.num_fed = True, len(self.chosen)
        if len(self.tokens) >= self.k or self.cancelled:  # filled by forced tokens before this step, or cancelled
            return self._done()
        sampling = self.session.sampling
        context = [*self.context, *self.chosen] if sampling.processes_logits else ()
        scores = process(logits[-1:], sampling, context)[0]  # as the target's
        if self.grammar is not None:
            allowed = self._in_grammar(lambda grammar: grammar.allowed())
            if allowed is None:  # predicted tokens off the grammar: nothing valid to draft after them
                return self._done()
            scores = scores.masked_fill(~torch.from_numpy(allowed).to(scores.device), float("-inf"))
        branching = self.branching
        if self.guess_bonus and self.bonus is None:
            self.bonus = argmax([scores])[0]
            self.chosen.append(self.bonus)
            if branching:
                self.bonus_alternative = Alternative.of_greedy(scores, self.bonus)
        elif self.generator is None:  # greedy
            token = argmax([scores])[0]
            self._choose(token, alternative=Alternative.of_greedy(scores, token) if branching else None)
        else:
            q = logits_to_probs(scores, sampling)
            token = sample(q, self.generator)
            self._choose(token, q, alternative=Alternative.of(q, token) if branching else None)
        self._jump_forward()
        return len(self.tokens) >= self.k and self._done()

    def _choose(
        self, token: int, q: torch.Tensor | None = None, forced: bool = False, alternative: Alternative | None = None
    ) -> None:
        self.tokens.append(token)
        self.forced.append(forced)
        self.chosen.append(token)
        self.alternatives.append(alternative)
        if q is not None:
            self.probs.append(q)

    def _jump_forward(self) -> None:
        """Appends the tokens the grammar forces after the context and the chosen tokens, up to K."""
        if self.grammar is None:
            return
        for token in (self._in_grammar(lambda grammar: grammar.forced_tokens()) or [])[: self.k - len(self.tokens)]:
            point_mass = None if self.generator is None else torch.zeros(self.session.vocab_size or 0)
            if point_mass is not None:
                point_mass[token] = 1.0
            self._choose(token, point_mass, forced=True)

    def _in_grammar(self, read: Callable[[GrammarMatcher], object]):
        """``read`` of the grammar state after the predicted and chosen tokens; None when the
        grammar rejects one of them."""
        assert self.grammar is not None
        with self.grammar.tentatively([*self.predicted, *self.chosen]) as valid:
            return read(self.grammar) if valid else None

    def _done(self) -> bool:
        forced = self.forced if any(self.forced) else []
        self.result = Proposal(self.tokens, torch.stack(self.probs) if self.probs else None, self.bonus, forced)
        if self.branching:
            self.session.alternatives[tuple(self.tokens)] = self.alternatives
        return True


def _likely_outcomes(
    predicted: Sequence[int], alternatives: list[Alternative | None], bonus: Alternative | None
) -> list[tuple[int, int]]:
    """The outcomes of verifying ``predicted`` other than "all accepted, the first bonus guess",
    as ``(num_accepted, next_token)``, most likely first: the probability that the first n tokens
    pass (the product of their ``chosen_prob``) times that of the alternative token at position n
    (a rejection there, then the second choice; at n = len(predicted), the second bonus guess).
    Forced tokens (None) always pass and have no alternative."""
    outcomes, passing = [], 1.0
    for n, alternative in enumerate(alternatives[: len(predicted)]):
        if alternative is None:
            continue
        outcomes.append((passing * alternative.prob, n, alternative.token))
        passing *= alternative.chosen_prob
    if bonus is not None:
        outcomes.append((passing * bonus.prob, len(predicted), bonus.token))
    return [(n, token) for _, n, token in sorted(outcomes, key=lambda o: -o[0])]


@dataclass(eq=False)
class _DraftedNext:
    """A proposal :meth:`ModelDraftSession.draft_next` started before a Propose asked for it: up to
    ``k`` tokens after the session's first ``start`` committed tokens and ``ahead``, a bonus token
    guessed first. ``outcome``: the proposal or the error, once its work ended (``ended`` is then
    set); ``waiting``: the answer of a Propose that asked for it while it ran."""

    start: int
    ahead: list[int]
    k: int
    work: _Propose
    began: float = field(default_factory=time.monotonic)
    took_s: float = 0.0  # from its start to its end, once ended
    outcome: Proposal | BaseException | None = None
    waiting: Callable[[Proposal | BaseException], None] | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Not started: the engine drops it; running: it ends at its next step."""
        self.work.cancelled = True


class ModelDraftSession(DraftSession):
    """Autoregressive proposals from a causal LM whose sequence lives in a shared KV store, run
    as work of the drafter's engine loop (a step per draft position for every session at once).

    Greedy: the argmax at each step. Sampling: draw from q = the sampling transform of the draft
    logits, seeded by (request seed, committed length), and return q for the acceptance test. Both
    after the request's logits processors (:mod:`specdec.sampling.logits_processors`), as the target's.
    ``window`` is the draft's context length in tokens: a context that would outgrow it gets no
    proposal, and the round becomes a plain decode step on the verify service.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        kv_cache: SequenceKV,
        window: int,
        engine: Engine,
        vocabulary: "GrammarVocabulary | None" = None,
    ):
        super().__init__(sampling)
        self.kv_cache = kv_cache
        self.window = window
        self.engine = engine
        self.vocab_size = kv_cache.lm.vocab_size
        self.vocabulary = vocabulary
        self.grammar: GrammarMatcher | None = None  # with structured output: the state after committed
        self.branching = False  # set by a draft-ahead for several branches: proposals keep their alternatives
        self.alternatives: dict[tuple[int, ...], list[Alternative | None]] = {}  # by proposal, the latest ones
        self._next: _DraftedNext | None = None  # drafted proactively (draft_next), running or done
        self._next_lock = threading.Lock()  # guards _next and its outcome: the engine's thread ends it

    def prefill(self, committed: Sequence[int]) -> None:
        super().prefill(committed)
        if self.vocabulary is not None:
            self.grammar = self.vocabulary.matcher(self.sampling, self.committed)
        if len(self.committed) < self.window:
            prefill(self.engine, self.kv_cache, self.committed)

    def sync(self, appended: Sequence[int]) -> None:
        super().sync(appended)
        if self.grammar is not None:
            self.grammar.advance(appended)

    def propose(self, k: int) -> Proposal:
        return wait_for_reply(lambda done: self.start_proposal(k, (), 1, None, done))

    def propose_ahead(
        self, predicted: Sequence[int], k: int, num_branches: int = 1, budget_s: float | None = None
    ) -> Proposal:
        """The branch "every predicted token accepted, then the draft's guess of the bonus token"
        first; with ``num_branches`` > 1 also, in order of probability, the next most likely
        outcomes (the other branches of SSD / Saguaro's speculation cache, with the draft's own
        probabilities standing in for the target's): every predicted token accepted and the
        draft's second choice as the bonus token, or the first n accepted and its second choice at
        position n as the recovered token, for ``num_branches`` in all. The others are drafted on
        the session's own sequence after the first (each rolls back the one before, as a rejection
        does), none begun that would end after ``budget_s`` seconds (None: no limit; a branch is
        expected to take as long as the one before it, since the Propose answers only once its
        branches are drafted), and come back in
        ``Proposal.branches``. A session that asks for branches keeps each proposal's alternatives
        (:class:`Alternative`) from then on; a proposal drafted before has only its bonus branch."""
        return wait_for_reply(lambda done: self.start_proposal(k, predicted, num_branches, budget_s, done))

    def start_proposal(
        self,
        k: int,
        predicted: Sequence[int],
        num_branches: int,
        budget_s: float | None,
        done: Callable[[Proposal | BaseException], None],
    ) -> None:
        """Queues the proposal (:meth:`propose`, or :meth:`propose_ahead` and its branches one after
        another) on the engine and returns; ``done`` is called from the engine's thread. The
        proposal drafted proactively (:meth:`draft_next`) answers instead when it is the one asked
        for. Raises InvalidArgument for a predicted id outside the vocabulary."""
        start = time.monotonic()
        if predicted:
            check_token_ids(predicted, self.vocab_size, "predicted_token_ids")
            if num_branches > 1:
                self.keep_alternatives()
        if len(self.committed) + (len(predicted) + 1 if predicted else 0) + k > self.window:
            done(Proposal([]))
            return
        taken = self._take_next(predicted, k)
        if taken is None:
            self._draft(k, predicted, num_branches, budget_s, start, done)
            return
        drafted, bonus = taken

        def answer(outcome: Proposal | BaseException) -> None:
            if isinstance(outcome, BaseException) or (bonus is not None and outcome.bonus_token_id != bonus):
                # preempted, the engine stopping, or it guessed another bonus token: drafted now instead
                self._draft(k, predicted, num_branches, budget_s, start, done)
                return
            proposal = outcome.first(k)
            proposal.proactive = True
            if bonus is not None:  # committed, not guessed: a plain Propose's proposal has none
                proposal.bonus_token_id = None
            self._drafted_main(
                drafted.work, proposal, k, predicted, num_branches, budget_s, start, drafted.took_s, done
            )

        with self._next_lock:
            if drafted.outcome is None:
                drafted.waiting = answer
                return
        answer(drafted.outcome)

    def _draft(
        self,
        k: int,
        predicted: Sequence[int],
        num_branches: int,
        budget_s: float | None,
        start: float,
        done: Callable[[Proposal | BaseException], None],
    ) -> None:
        """Queues the proposal and its branches (see :meth:`start_proposal`); ``start``: the
        Propose's time.monotonic(), from which ``budget_s`` counts."""
        work = _Propose(self, k, predicted)

        def drafted(_proposal, _stats, error: BaseException | None) -> None:
            if error is not None:
                done(error)
                return
            last_s = time.monotonic() - start
            self._drafted_main(work, work.result, k, predicted, num_branches, budget_s, start, last_s, done)

        self.engine.submit(work, drafted)

    def _drafted_main(
        self,
        work: _Propose,
        proposal: Proposal,
        k: int,
        predicted: Sequence[int],
        num_branches: int,
        budget_s: float | None,
        start: float,
        last_s: float,
        done: Callable[[Proposal | BaseException], None],
    ) -> None:
        """Once the main branch (``proposal`` of ``k`` tokens, drafted by ``work`` now or
        proactively, in ``last_s`` seconds) is drafted: drafting ahead, drafts the other
        ``num_branches - 1`` most likely outcomes within the budget (see :meth:`propose_ahead`),
        then ``done(proposal)``."""
        if not predicted:
            done(proposal)
            return
        alternatives = self.alternatives.get(tuple(predicted), [])
        self.alternatives = {tuple(proposal.tokens): self.alternatives.get(tuple(work.result.tokens), [])}
        outcomes = _likely_outcomes(predicted, alternatives, work.bonus_alternative)[: num_branches - 1]
        deadline = None if budget_s is None else start + budget_s
        self._draft_branches(proposal, predicted, k, outcomes, deadline, last_s, done)

    def draft_next(self, k: int, predicted: Sequence[int], proposal: Proposal) -> bool:
        """Proactive drafting (SpecEdge's proactive edge drafting: Park et al., "SpecEdge: Scalable
        Edge-Assisted Serving Framework for Interactive LLMs", 2025): after answering a Propose
        with ``proposal``, starts drafting the Propose the coordinator sends next if verification
        accepts every token of ``proposal``: after ``committed + predicted + [bonus] + tokens``
        (the bonus token the draft guessed; after ``committed + tokens`` without ``predicted``), a
        bonus token guessed, then up to ``k`` tokens, as work of the engine like any proposal. The
        Propose it serves is a draft-ahead after those tokens (a coordinator drafting ahead) or a
        plain Propose after those and the bonus token it guessed (a coordinator that does not, and
        a guess that was the target's token); it is answered at once when the draft is done, else
        when it is: the draft's forwards leave the Propose's round trip. A Propose for branches
        gets it as its main branch, its other branches drafted on arrival (within its budget, the
        first expected to take as long as this draft did). Any other Propose cancels it (it ends
        at its next step; the next proposal rolls the KV back as after a rejection), as does
        :meth:`close`.

        Only after a full proposal (``k`` tokens: a short one ended at the window or had nothing
        to draft), without structured output (its grammar state is advanced by the next Propose
        while this draft would read it), and within the window. Call it before the answered
        Propose releases the session. Returns whether it started a draft."""
        if self.grammar is not None or len(proposal.tokens) < k:
            return False
        bonus = proposal.bonus_token_id
        if not predicted:
            ahead = list(proposal.tokens)
        elif bonus is None:
            return False
        else:
            ahead = [*predicted, bonus, *proposal.tokens]
        if len(self.committed) + len(ahead) + 1 + k > self.window:
            return False
        work = _Propose(self, k, ahead)
        drafted = _DraftedNext(len(self.committed), ahead, k, work)
        with self._next_lock:
            replaced, self._next = self._next, drafted
        if replaced is not None:
            replaced.cancel()
        self.engine.submit(
            work,
            lambda _result, _stats, error: self._drafted_next(drafted, work.result if error is None else error),
            abandoned=lambda: work.cancelled,
        )
        return True

    def _drafted_next(self, drafted: _DraftedNext, outcome: Proposal | BaseException) -> None:
        """The end of a proactive draft (on the engine's thread): answers the Propose waiting for it."""
        with self._next_lock:
            drafted.outcome, drafted.took_s = outcome, time.monotonic() - drafted.began
            waiting, drafted.waiting = drafted.waiting, None
        drafted.ended.set()
        if waiting is not None:
            waiting(outcome)

    def _take_next(self, predicted: Sequence[int], k: int) -> tuple[_DraftedNext, int | None] | None:
        """The proactive draft if this Propose (``predicted``, ``k``) asks for its main branch: at
        least ``k`` tokens after the same tokens past the committed ones; or, for a plain Propose
        (no ``predicted``), after those and the bonus token the draft guesses first, returned with
        it (the proposal serves only if its guess is that token). Otherwise the draft is
        cancelled, and None. Compares the tokens past its ``start``: O(K)."""
        with self._next_lock:
            drafted, self._next = self._next, None
        if drafted is None:
            return None
        context, n = [*self.committed[drafted.start :], *predicted], len(drafted.ahead)
        if k <= drafted.k and predicted and context == drafted.ahead:
            return drafted, None
        after_bonus = not predicted and len(context) == n + 1 and context[:n] == drafted.ahead
        if k <= drafted.k and after_bonus and drafted.work.bonus in (None, context[n]):  # None: not guessed yet
            return drafted, context[n]
        drafted.cancel()
        return None

    def _draft_branches(
        self,
        proposal: Proposal,
        predicted: Sequence[int],
        k: int,
        outcomes: list[tuple[int, int]],
        deadline: float | None,
        last_s: float,
        done: Callable[[Proposal | BaseException], None],
    ) -> None:
        """Drafts the branch of ``outcomes[0]`` (``(num_accepted, next_token)``), then the rest, each
        on the engine after the one before, unless it would end after ``deadline``
        (time.monotonic(); ``last_s``: how long the branch before took); then ``done(proposal)``."""
        began = time.monotonic()
        if not outcomes or (deadline is not None and began + last_s > deadline):
            done(proposal)  # a branch past the deadline would still be drafting when verification ends
            return
        (num_accepted, token), rest = outcomes[0], outcomes[1:]

        def drafted(branch, _stats, error: BaseException | None) -> None:
            if error is not None:
                done(error)
                return
            if branch.tokens:
                proposal.branches.append(Branch(num_accepted, token, branch))
            self._draft_branches(proposal, predicted, k, rest, deadline, time.monotonic() - began, done)

        try:
            work = _Propose(self, k, [*predicted[:num_accepted], token], guess_bonus=False)
        except Exception as err:  # the grammar's, say: the Propose fails with it (called on the engine's thread)
            done(err)
            return
        self.engine.submit(work, drafted)

    def keep_alternatives(self) -> None:
        self.branching = True

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.cache_bytes()

    def num_cached_tokens(self) -> int:
        return self.kv_cache.num_cached_tokens

    def close(self) -> None:
        """Frees the session's KV, once a proactive draft still on the engine has stopped."""
        with self._next_lock:
            drafted, self._next = self._next, None
        if drafted is not None:
            drafted.cancel()
            if not drafted.ended.wait(CANCEL_WAIT_S):
                log.warning("a proactive draft did not stop within %g s; freeing its KV all the same", CANCEL_WAIT_S)
        self.engine.forget(self.kv_cache.seq_id)
        self.kv_cache.close()


class GrammarVocabulary:
    """A model drafter's tokenizer as the grammar library sees it, one per set of EOS ids (the
    target's, sent with each request), so the draft's masks are the target's. Built at start-up
    for the drafter's own EOS ids, the target's too when they share a vocabulary; another set is
    built at its first structured-output request (about 0.4 s for SmolLM2, the GIL held, so the
    draft's steps wait)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._built: dict[tuple[int, ...], LLTokenizer] = {}
        with contextlib.suppress(ValueError):  # a tokenizer llguidance cannot read: refused per request
            self._vocabulary(tuple(eos_token_ids))

    def matcher(self, sampling: SamplingParams, committed: Sequence[int]) -> GrammarMatcher | None:
        """The request's grammar state after ``committed`` (its generated part); None without
        structured output. Raises InvalidArgument for a spec that does not compile."""
        if sampling.structured_output is None:
            return None
        try:
            vocabulary = self._vocabulary(sampling.eos_token_ids)
        except ValueError as err:
            raise FailedPrecondition(f"the drafter's tokenizer cannot be read by the grammar library: {err}") from None
        generated = committed[sampling.num_prompt_tokens :]
        # no limits of its own: the coordinator checked the spec against its --grammar-* limits
        return GrammarMatcher.from_log(sampling.structured_output, vocabulary, UNLIMITED, generated)

    def _vocabulary(self, eos: tuple[int, ...]) -> LLTokenizer:
        """Raises ValueError for a tokenizer llguidance cannot read."""
        if eos not in self._built:
            self._built[eos] = grammar_tokenizer(self._tokenizer, self.vocab_size, list(eos))
        return self._built[eos]

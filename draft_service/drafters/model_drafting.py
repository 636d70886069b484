"""Model drafting: a causal LM's proposals as work of its drafter's engine loop
(:class:`ModelDraftSession`; one proposal's steps, a draft position a step batched with every other
session's proposal: :class:`ProposalWork`), drafted ahead for several outcomes of the verification
in flight (branches, :class:`_ProposeCall`, ranked by the :class:`Alternative` each step keeps)
and proactively, before the Propose that asks for them (:meth:`ModelDraftSession.draft_next`)."""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draft_service.drafters.contract import Branch, DraftSession, Proposal
from draft_service.drafters.grammar_vocabulary import GrammarVocabulary
from specdec.engine.batching import SequenceStep
from specdec.engine.engine import Engine, Work
from specdec.engine.kv import SequenceKV, prefill
from specdec.engine.vocab import check_token_ids
from specdec.rpc.step_server import wait_for_reply
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.logits_processors import process
from specdec.sampling.probs import argmax, best_other, logits_to_probs, round_generator, sample
from specdec.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)
CANCEL_WAIT_S = 10.0  # closing a session waits this long at most for its proactive draft to stop


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


class ProposalWork(Work):
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


def likely_outcomes(
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
    work: ProposalWork
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
        vocabulary: GrammarVocabulary | None = None,
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
        another: :class:`_ProposeCall`) on the engine and returns; ``done`` is called from the
        engine's thread. The proposal drafted proactively (:meth:`draft_next`) answers instead when
        it is the one asked for. With ``num_branches`` > 1 the session keeps each proposal's
        alternatives from now on (:meth:`keep_alternatives`), for the branches of the draft-ahead
        that follows. Raises InvalidArgument for a predicted id outside the vocabulary."""
        if num_branches > 1:
            self.keep_alternatives()
        if predicted:
            check_token_ids(predicted, self.vocab_size, "predicted_token_ids")
        if len(self.committed) + (len(predicted) + 1 if predicted else 0) + k > self.window:
            done(Proposal([]))
            return
        _ProposeCall(self, k, predicted, num_branches, budget_s, done).start()

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
        work = ProposalWork(self, k, ahead)
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

    def keep_alternatives(self) -> None:
        """From now on, each proposal keeps its :class:`Alternative` per token, for the branches of
        the draft-ahead that follows it (``ProposeRequest.num_branches`` > 1)."""
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


class _ProposeCall:
    """One Propose of a :class:`ModelDraftSession`, answered in steps on the drafter's engine: the
    main branch (:meth:`start`: the proactive draft where it is the one asked for, else
    :meth:`_draft_main`), then, drafting ahead, the other ``num_branches - 1`` most likely outcomes
    one after another (:meth:`_branch_out`, :meth:`_draft_next_branch`), none begun that would end
    after ``budget_s`` seconds from the call's start; then ``done(proposal)``, or ``done(error)``
    at the first error. Each step after the first runs on the engine's thread."""

    def __init__(
        self,
        session: "ModelDraftSession",
        k: int,
        predicted: Sequence[int],
        num_branches: int,
        budget_s: float | None,
        done: Callable[[Proposal | BaseException], None],
    ):
        self.session, self.k, self.predicted = session, k, list(predicted)
        self.num_branches, self.done = num_branches, done
        self.start_s = time.monotonic()  # the Propose's start, from which budget_s counts
        self.deadline = None if budget_s is None else self.start_s + budget_s
        self.main: ProposalWork | None = None  # the main branch's work, drafted now
        self.proactive: _DraftedNext | None = None  # the proactive draft that answers, when one does
        self.bonus: int | None = None  # the committed token a plain Propose's proactive draft guessed
        self.proposal = Proposal([])  # the main branch, once drafted
        self.outcomes: list[tuple[int, int]] = []  # the branches still to draft, (num_accepted, next_token)
        self.branch = (0, 0)  # the branch being drafted, by ``branch_work`` since ``branch_began``
        self.branch_work: ProposalWork | None = None
        self.branch_began = 0.0
        self.last_s = 0.0  # how long the branch before took: the next one is expected to take as long

    def start(self) -> None:
        """The main branch: the session's proactive draft where it is this one (waiting for it to
        end where it runs), else drafted now."""
        session = self.session
        taken = session._take_next(self.predicted, self.k)
        if taken is None:
            self._draft_main()
            return
        self.proactive, self.bonus = taken
        with session._next_lock:
            if self.proactive.outcome is None:
                self.proactive.waiting = self._proactive_ended
                return
        self._proactive_ended(self.proactive.outcome)

    def _proactive_ended(self, outcome: Proposal | BaseException) -> None:
        """The proactive draft ended with ``outcome``: its first ``k`` tokens are the main branch,
        unless it failed (preempted, the engine stopping) or guessed another bonus token than the
        one committed; then the main branch is drafted now."""
        assert self.proactive is not None
        if isinstance(outcome, BaseException) or (self.bonus is not None and outcome.bonus_token_id != self.bonus):
            self._draft_main()
            return
        proposal = outcome.first(self.k)
        proposal.proactive = True
        if self.bonus is not None:  # committed, not guessed: a plain Propose's proposal has none
            proposal.bonus_token_id = None
        self._branch_out(self.proactive.work, proposal, self.proactive.took_s)

    def _draft_main(self) -> None:
        self.main = ProposalWork(self.session, self.k, self.predicted)
        self.session.engine.submit(self.main, self._main_drafted)

    def _main_drafted(self, _proposal, _stats, error: BaseException | None) -> None:
        if error is not None:
            self.done(error)
            return
        assert self.main is not None
        self._branch_out(self.main, self.main.result, time.monotonic() - self.start_s)

    def _branch_out(self, work: ProposalWork, proposal: Proposal, took_s: float) -> None:
        """The main branch is ``proposal``, drafted by ``work`` in ``took_s`` seconds: a plain
        Propose is answered with it; a draft-ahead first drafts its other branches, the most likely
        outcomes of verifying ``predicted`` by the alternatives the draft kept
        (:func:`likely_outcomes`)."""
        if not self.predicted:
            self.done(proposal)
            return
        session = self.session
        alternatives = session.alternatives.get(tuple(self.predicted), [])
        session.alternatives = {tuple(proposal.tokens): session.alternatives.get(tuple(work.result.tokens), [])}
        self.outcomes = likely_outcomes(self.predicted, alternatives, work.bonus_alternative)[: self.num_branches - 1]
        self.proposal, self.last_s = proposal, took_s
        self._draft_next_branch()

    def _draft_next_branch(self) -> None:
        """Drafts the next branch on the engine, unless none is left or it would end after the
        deadline (expected to take as long as the branch before); then answers with the proposal
        and its branches."""
        began = time.monotonic()
        if not self.outcomes or (self.deadline is not None and began + self.last_s > self.deadline):
            self.done(self.proposal)  # a branch past the deadline would still be drafting when verification ends
            return
        self.branch, self.branch_began = self.outcomes.pop(0), began
        num_accepted, token = self.branch
        try:
            self.branch_work = ProposalWork(
                self.session, self.k, [*self.predicted[:num_accepted], token], guess_bonus=False
            )
        except Exception as err:  # the grammar's, say: the Propose fails with it (called on the engine's thread)
            self.done(err)
            return
        self.session.engine.submit(self.branch_work, self._branch_drafted)

    def _branch_drafted(self, _proposal, _stats, error: BaseException | None) -> None:
        if error is not None:
            self.done(error)
            return
        assert self.branch_work is not None
        branch = self.branch_work.result
        if branch.tokens:
            self.proposal.branches.append(Branch(*self.branch, branch))
        self.last_s = time.monotonic() - self.branch_began
        self._draft_next_branch()

"""One model proposal as work of the drafter's engine loop (:class:`ProposalWork`): the steps that
draft it, a draft position a step, batched with every other session's proposal; and the
:class:`Alternative` each step keeps for the branches of a draft-ahead."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draft_service.drafters.contract import Proposal
from specdec.engine.batching import SequenceStep
from specdec.engine.engine import Work
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.logits_processors import process
from specdec.sampling.probs import logits_to_probs, round_generator, sample

if TYPE_CHECKING:
    from draft_service.drafters.model_drafting import ModelDraftSession


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
        top = probs.topk(2)
        values, tokens = top.values.tolist(), top.indices.tolist()
        i = 1 if tokens[0] == chosen else 0
        return cls(float(probs[chosen]), tokens[i], values[i])


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
        scores = process(logits[-1:], sampling, [*self.context, *self.chosen])[0]  # as the target's
        if self.grammar is not None:
            allowed = self._in_grammar(lambda grammar: grammar.allowed())
            if allowed is None:  # predicted tokens off the grammar: nothing valid to draft after them
                return self._done()
            scores = scores.masked_fill(~torch.from_numpy(allowed).to(scores.device), float("-inf"))
        branching = self.branching
        if self.guess_bonus and self.bonus is None:
            self.bonus = int(scores.argmax())
            self.chosen.append(self.bonus)
            if branching:
                self.bonus_alternative = Alternative.of(torch.softmax(scores, -1), self.bonus)
        elif self.generator is None:  # greedy
            token = int(scores.argmax())
            self._choose(token, alternative=Alternative.of(torch.softmax(scores, -1), token) if branching else None)
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

"""Adaptive K: each round, the proposer and number of draft tokens that maximise expected
committed tokens per millisecond, from the request's acceptance estimates
(:mod:`coordinator.speculation.policy.acceptance_model`) and the measured step costs under the
current load (:mod:`coordinator.speculation.policy.step_costs`).

Scoring (goodput, as in SmartSpec, Liu et al. 2024): with B other sequences bringing T tokens to
the step (:class:`~coordinator.speculation.policy.step_costs.Load`), option K is scored by the
whole batch's expected tokens per ms, (E(K) + W) / (draft(K) + step(T + K + 1) + rest), where W,
the others' work in the step, is the larger of B x g (g: the tokens a round of this request
commits on average, the others assumed alike) and T. Alone (B = 0) this is E(K) over the round's
time. As load grows K shrinks, and reaches 0 (plain decode) where speculation no longer pays.
Each request prices its own round and sees the others as they were; the step budget
(:mod:`coordinator.speculation.policy.step_budget`) then caps its K at its share of one allocation
over every running request of the coordinator on the target, by the same measure (SmartSpec's
greedy marginal goodput over their bids), so that the requests sharing a step do not each take the
tokens that pay for one of them alone. W counts the others' prefill chunks as the step's work, not
as its overhead: the service must prefill them whatever this request does, and a draft token that
slows the step delays them as much as it delays the others' decode tokens. Why:
docs/profiles.md#the-engine-loop-and-adaptive-k-under-load. Plain rounds whose Decode went out
with the round before (decode ahead, :class:`coordinator.speculation.rounds.RequestRounds`) pay no
rest beyond their step (``StepCosts.plain_overhead_ms``); a round that turns around instead waits,
under load, for the step in progress where the engine steps without it, so the options but plain
decode also pay the steps they make the request miss (:meth:`AdaptiveK.missed_steps`).

Hybrid drafting: every round the coordinator also looks the committed text's suffix up in its own
model-free lookups (no network hop, no draft cost): the n-gram index (:mod:`specdec.lookups.ngram`,
what followed the latest match) and SuffixDecoding (:mod:`specdec.lookups.suffix`, the most
frequent continuation over the request and earlier outputs). Their proposals compete with the
model drafter's under the same formula, with acceptance tracked per lookup and matched suffix
length n (a 3-token match predicts better than a 1-token one; suffix matches from 4 tokens up
share one estimate) and a round cost of the verify call alone. A lookup's acceptance is observed
every round, whether or not its proposal was used, by comparing it with the tokens the round
committed: under greedy decoding that is exactly the acceptance test's outcome; under sampling the
committed tokens follow the target distribution p, so a match at a position has probability
p(token), the acceptance probability of a point-mass draft (Leviathan et al. 2023). So lookup
estimates need no probing and cost nothing to keep; the lookups that do not pay are turned off
for the request (:mod:`coordinator.speculation.policy.lookup_ledger`).

Structured output: where the request's grammar allows one continuation of the text only (the keys
and punctuation of a JSON schema), its tokens are free proposals, costing no draft forward. The
draft's model drafters open their proposals with them and jump over them again after each drafted
token (jump-forward), and say which tokens were forced (``ProposeResponse.forced``); the
coordinator follows the grammar too (:class:`specdec.sampling.grammar.ForcedTokenLookup`,
llguidance without torch), so it knows the f tokens forced next before a round. They count twice:
as a lookup of their own (a round of the forced tokens alone: no draft call at all; its
per-position estimates observed every round, like n-gram's), and as the free head of the model
drafter's options: option K = f + d costs d draft tokens, its expected tokens are the forced
tokens' rates then, once those passed, the drafter's; d ranges over 1..``k_max``, so forced tokens
take a round past ``k_max`` up to the verify service's largest K (more tokens per verify, at no
draft cost). The drafter's acceptance estimates and its ms per token learn from its drafted tokens
alone (:func:`~coordinator.speculation.policy.acceptance_model.drafted_outcome`), so they mean the
same with a grammar and without (both are shared with the requests without one). Forced tokens
that follow a drafted token are known only once drafted: they are priced as drafted tokens (their
cost overestimated, their acceptance the drafter's). Why both halves: the draft's report alone
cannot price a round before it runs and leaves a round of forced tokens paying the draft's hop;
the coordinator's lookup alone could not propose the text after them, which only a model drafts.
Lossless either way: forced tokens are verified like any draft token (point masses under
sampling), and the choice only decides who proposes and how many (``--grammar-aware-drafting``
off: neither half).
"""

import dataclasses
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.observability.metrics import PLAIN, RoundRecord
from coordinator.speculation.policy.acceptance_model import AcceptanceModel, drafted_outcome
from coordinator.speculation.policy.k_policy import Learnt, Match, Matches
from coordinator.speculation.policy.lookup_ledger import LookupLedger
from coordinator.speculation.policy.step_budget import Bid, allocate
from coordinator.speculation.policy.step_costs import Load, StepCosts
from specdec.sampling.grammar import FORCED

if TYPE_CHECKING:
    from coordinator.speculation.policy.adaptive_state import AdaptiveState


# Under load, a plain stretch decoded ahead whose lookups are off is priced every PRICE_EVERY-th
# round; the rounds between keep its answer (docs/profiles.md#adaptive-ks-coordinator-at-the-ceiling).
PRICE_EVERY = 4


@dataclass(eq=False)  # by identity: a request's policy keys its bid in the step budget
class AdaptiveK:
    """One request's choice of drafter and K. Each round's options: plain decode, the model
    ``drafter`` (None: none) with K in [1, k_max], and each lookup's match (``matches``, by
    lookup) with K up to its length; the one with the most expected tokens per ms wins (the
    cheaper on a tie). From the ``probe_interval``-th round since the model drafter last proposed
    (later where a probe costs more, see :meth:`_rounds_between_probes`), the first round that
    plain decode wins (the fallback) asks it for ``probe_k`` tokens anyway, so that a request whose
    text becomes predictable is noticed. The rounds a lookup wins count too (they teach nothing
    about the drafter), but are not replaced by a probe, so that lookup rounds now and then cannot
    put the probe off for good.
    ``lookups[name][i]`` is the acceptance of lookup ``name``'s proposals from a suffix match of
    i + 1 tokens (the last one: of that many or more)."""

    k_max: int
    drafter: str | None
    acceptance: AcceptanceModel | None  # the model drafter's
    lookups: dict[str, list[AcceptanceModel]]
    costs: StepCosts
    target: str = ""
    probe_interval: int = 16
    probe_k: int = 2
    load: Load = field(default_factory=Load)
    forced: AcceptanceModel | None = None  # the forced-token lookup's, per position of its run
    hidden_behind_verify: bool = False  # the model drafter drafts ahead on its own hardware (StepCosts.draft_wait_ms)
    bids: MutableMapping["AdaptiveK", Bid] | None = None  # the step budget's bids on this target (None: off)
    owner: str = ""  # whose warm starts it began from and blends into (AdaptiveState.remember)
    lookup_ledger: LookupLedger = field(default_factory=LookupLedger)
    shared: "AdaptiveState | None" = field(default=None, repr=False)  # the state that made it (None: alone)
    _rounds_without_drafter: int = 0
    _searched: bool = False  # the last answer of lookups_on: whether this round searched the lookups
    _priced_plain: int = 0  # rounds left that keep the last priced plain stretch's answers (PRICE_EVERY)

    @property
    def k_limit(self) -> int:
        """The largest K of any round: the verify service's; forced tokens may take a round past
        ``k_max`` drafted tokens up to it."""
        return len(self.costs.verify_ms) - 1

    def _lookup_models(self, matches: Matches | None) -> list[tuple[str, Match, AcceptanceModel]]:
        """This round's lookup matches with the acceptance model of each (the forced-token
        lookup's, or the n-gram and suffix lookups' by match length)."""
        found = []
        for name, match in (matches or {}).items():
            if not match.tokens:
                continue
            if name == FORCED and self.forced is not None:
                found.append((name, match, self.forced))
            elif name in self.lookups:
                models = self.lookups[name]
                found.append((name, match, models[min(match.n, len(models)) - 1]))
        return found

    def _num_forced(self, matches: Matches | None) -> int:
        """The tokens the grammar forces next (0 without a forced-token lookup): the model
        drafter's proposal opens with them at no draft cost (jump-forward)."""
        match = (matches or {}).get(FORCED)
        return len(match.tokens) if match is not None and self.forced is not None else 0

    def _drafter_expected_tokens(self, num_forced: int, k: int) -> float:
        """Expected tokens of a model drafter's round of ``num_forced`` forced then ``k`` drafted
        tokens: the forced ones pass at the forced-token lookup's rates, the drafted ones, once
        those passed, at the drafter's."""
        assert self.acceptance is not None
        if not num_forced:
            return self.acceptance.expected_tokens(k)
        assert self.forced is not None
        after_forced = self.forced.pass_probability(num_forced)
        return self.forced.expected_tokens(num_forced) + after_forced * (self.acceptance.expected_tokens(k) - 1.0)

    def _hit_probability(self, num_forced: int, k: int) -> float | None:
        """Drafting ahead: the probability that the proposal drafted ahead after a round of
        ``num_forced`` forced and ``k`` drafted tokens is the next round's, every token passing
        and the draft's guess of the bonus token right, taken as one more drafted position (None:
        no draft-ahead)."""
        if not self.hidden_behind_verify:
            return None
        assert self.acceptance is not None
        forced = self.forced.pass_probability(num_forced) if num_forced and self.forced is not None else 1.0
        return forced * self.acceptance.pass_probability(k + 1)

    def options(
        self,
        matches: Matches | None,
        draft_available: bool = True,
        open_ms_per_token: float = 0.0,
        missed_steps: float = 0.0,
    ) -> list[tuple[str, int, float]]:
        """(drafter, K, expected tokens per ms of the whole batch, see the module docstring) of
        every choice this round; the model drafter's only while ``draft_available``. With a
        forced-token match of f tokens, the model drafter's options are f forced tokens (free of
        draft cost) plus 1..``k_max`` drafted ones, up to ``k_limit``. ``open_ms_per_token``: the
        draft's ms to open its session spread over the request's remaining tokens, added to a
        drafter round per token it is expected to commit (see :meth:`wants_drafter`).
        ``missed_steps``: steps the request misses choosing anything but plain decode, in which
        the others commit their work without it (see :meth:`decodes_ahead`)."""
        k_max = min(self.k_max, self.k_limit)
        others, others_tokens = self.load.others_work(), self.load.others_tokens
        missed_ms = missed_steps * self.costs.step_ms(others_tokens + 1) if missed_steps else 0.0
        missed_tokens = missed_steps * others  # the others' work in the steps the request misses

        def goodput(tokens: float, k: int, draft_call: bool = True, free: int = 0, hit: float | None = None) -> float:
            if k == 0:
                return (tokens + others) / self.costs.round_ms(0, draft_call, others_tokens)
            opening = tokens * open_ms_per_token if draft_call else 0.0
            round_ms = self.costs.round_ms(k, draft_call, others_tokens, free, hit) + opening + missed_ms
            return (tokens + others + missed_tokens) / round_ms

        options = [(PLAIN, 0, goodput(1.0, 0))]
        if self.drafter and self.acceptance is not None and draft_available:
            f = self._num_forced(matches)
            options += [
                (
                    self.drafter,
                    f + k,
                    goodput(self._drafter_expected_tokens(f, k), f + k, free=f, hit=self._hit_probability(f, k)),
                )
                for k in range(1, min(k_max, self.k_limit - f, len(self.acceptance.rates)) + 1)
            ]
        for name, match, model in self._lookup_models(matches):
            limit = self.k_limit if name == FORCED else k_max
            options += [
                (name, k, goodput(model.expected_tokens(k), k, draft_call=False))
                for k in range(1, min(limit, len(match.tokens), len(model.rates)) + 1)
            ]
        return options

    def next_round(self, matches: Matches | None, draft_available: bool = True) -> tuple[str, int]:
        """The round's (drafter, K): ``self.drafter``, a lookup's name (propose
        ``matches[name].tokens[:K]``) or (PLAIN, 0). ``draft_available`` False (the draft session
        is not open yet, or the draft service failed recently): never the model drafter. K is at
        most what the step budget gives the request (:meth:`_within_budget`), except a probe's.
        Under load the options but plain decode also pay the step the plain round after them
        misses (:meth:`missed_steps`)."""
        drafter, k = self._best(matches, draft_available, missed_steps=self.missed_steps())
        if drafter == PLAIN and self.drafter and draft_available and self._probe_due() and self._could_win(matches):
            drafter, k = self.drafter, min(self._num_forced(matches) + min(self.probe_k, self.k_max), self.k_limit)
        else:
            k = self._within_budget(drafter, k, matches)
            drafter = drafter if k else PLAIN
        if drafter in self.lookups:
            self.lookup_ledger.charge(k, self._break_even(k, self._plain_goodput()))
        self._rounds_without_drafter = 0 if drafter == self.drafter else self._rounds_without_drafter + 1
        return drafter, k

    def decodes_ahead(self, matches: Matches | None, draft_available: bool = True) -> bool:
        """Whether a plain round may send the next round's Decode with its own (decode ahead,
        :class:`coordinator.speculation.rounds.RequestRounds`): plain decode is the best option
        for this round's ``matches`` and no probe of the model drafter is due, so the next round,
        whose choice that Decode makes for it, most likely decodes too. Changes nothing: such a
        round is counted as one without the drafter when observed (:meth:`observe`).

        Leaving a stretch of plain rounds decoded ahead costs more than a round's overhead where
        the verify engine steps without the request (:meth:`missed_steps`): its next round and
        the plain round after it each turn around, and each misses a step. So the other options
        are priced with those steps here (two whole ones: a lookup must then commit more than 3
        tokens where plain decode commits 1 a step).

        Under load, a round that decodes ahead with no matches and its lookups off is priced for
        the ``PRICE_EVERY`` - 1 rounds after it too: they keep its answers here and in
        :attr:`lookups_on` unless a match turns up (a forced token), so that a plain stretch
        checks for a probe or a change of load every ``PRICE_EVERY``-th round, not every round."""
        if self._priced_plain and not matches:
            return True
        drafter, _ = self._best(matches, draft_available, missed_steps=2.0 * self.missed_steps())
        if drafter != PLAIN:
            return False
        ahead = not (self.drafter and draft_available and self._probe_due() and self._could_win(matches))
        if ahead and not matches and not self._searched and self.load.others_seqs >= 1:
            self._priced_plain = PRICE_EVERY
        return ahead

    def missed_steps(self) -> float:
        """Steps a round that turns around misses under load (not decoded ahead: it waits for the
        step in progress where the verify engine steps without it, the others' next calls queued
        before, :meth:`specdec.engine.engine.Engine._wait_for_previous`): the share of a step such
        rounds waited (``StepCosts.missed_step_share``); 0 alone. Leaving a stretch decoded ahead
        costs two such rounds (:meth:`decodes_ahead`); any other choice than plain decode one
        more than plain decode (:meth:`next_round`: the plain round after it turns around too)."""
        return self.costs.missed_step_share if self.load.others_seqs >= 1 else 0.0

    @property
    def lookups_on(self) -> bool:
        """Whether this round looks the request's n-gram and suffix lookups up: while they pay
        (:class:`LookupLedger`: their drafts, and under load their search, counted in
        :meth:`observe`) and a lookup proposal could win at the current load
        (:meth:`_lookup_could_win`). Else their search buys nothing (the suffix lookup's was a third
        of the coordinator's CPU at the near-free ceiling's 64 streams, every round plain); their
        next call indexes the tokens committed meanwhile. The round reads it once, before its
        choice; the answer is kept for its :meth:`observe`, which would otherwise price the load
        again, and by the rounds of a priced plain stretch (:meth:`decodes_ahead`)."""
        if not self._priced_plain:
            self._searched = self.lookup_ledger.paid and self._lookup_could_win()
        return self._searched

    def _lookup_could_win(self) -> bool:
        """Under load, whether a lookup proposal of some K in 1..``k_max`` whose every token is
        accepted would commit more than its break-even (:meth:`_break_even`) at the current load
        and costs; alone, True. Where a verify step's cost grows with every token (a CPU target
        under load) even that loses to plain decode, and the lookups are not searched; where it
        barely grows (an accelerator) they always are."""
        if self.load.others_seqs < 1 or not self.lookups:
            return True
        plain = self._plain_goodput()
        return any(k > self._break_even(k, plain) for k in range(1, min(self.k_max, self.k_limit) + 1))

    def _within_budget(self, drafter: str, k: int, matches: Matches | None) -> int:
        """``k``, at most the request's share of the step budget (:mod:`coordinator.speculation.policy.step_budget`)
        among the coordinator's running requests on the target, their bids as of their last round.
        Each round first renews the request's bid: its ``drafter``'s pass probabilities (none for
        plain decode), and its draft's ms per token where the draft neither drafts ahead nor has
        hardware of its own. Alone on the service (or no budget, or draft tokens free in the
        step) ``k`` as chosen: the request's own pricing is exact there, draft-ahead's overlap
        included, which the budget's line is not."""
        if self.bids is None:
            return k
        draft_ms = self.costs.draft_ms_per_token if drafter == self.drafter and not self.hidden_behind_verify else 0.0
        self.bids[self] = Bid(self._passing(drafter, matches), draft_ms)
        intercept, slope = self.costs.line()
        if k == 0 or self.load.others_seqs < 1 or slope <= 0:
            return k
        others = max(0.0, self.load.others_work() - (len(self.bids) - 1))
        return min(k, allocate(self.bids, intercept + self.costs.overhead_ms, slope, others)[self])

    def _passing(self, drafter: str, matches: Matches | None) -> list[float]:
        """Per draft position of ``drafter``'s longest proposal this round, the probability that
        drafts 1..i all pass (empty for plain decode): the model drafter's forced tokens, then
        its drafted ones; a lookup's match."""
        if drafter == self.drafter and self.acceptance is not None:
            f = self._num_forced(matches)
            forced = self.forced.passing(f) if f and self.forced is not None else []
            limit = min(self.k_max, self.k_limit - f, len(self.acceptance.rates))
            after = forced[-1] if forced else 1.0
            return forced + [after * p for p in self.acceptance.passing(limit)]
        for name, match, model in self._lookup_models(matches):
            if name == drafter:
                return model.passing(len(match.tokens))
        return []

    def _plain_goodput(self) -> float:
        """The whole batch's tokens per ms of a plain round at the current load (:meth:`options`' measure)."""
        return (1.0 + self.load.others_work()) / self.costs.round_ms(0, False, self.load.others_tokens)

    def _break_even(self, k: int, plain_goodput: float) -> float:
        """The tokens beyond one that a lookup round of ``k`` drafts must commit to make
        ``plain_goodput`` (:meth:`_plain_goodput`) at the current load."""
        round_ms = self.costs.round_ms(k, False, self.load.others_tokens)
        return max(0.0, plain_goodput * round_ms - self.load.others_work() - 1.0)

    def opens_draft_at_prefill(self, context_tokens: int, remaining: int) -> bool:
        """Whether a greedy request opens its draft beside the target's prefill: only if the first
        round would use the drafter, its prefill priced in (:meth:`wants_drafter`, no lookup
        matches yet), else when a later one would."""
        return self.wants_drafter(None, context_tokens, remaining)

    def wants_drafter(self, matches: Matches | None, context_tokens: int = 0, remaining: int = 0) -> bool:
        """Whether the request should open its draft session now: the model drafter is the best
        option with what opening costs the draft (its prefill of the ``context_tokens`` of the
        committed log, priced by the last prefills, :meth:`StepCosts.observe_draft_prefill`)
        spread over the ``remaining`` tokens the request may still generate (0: not priced), or
        plain decode is and a probe is due, the probe's cost including its share of the opening
        (:meth:`_opening_share`), with more than ``probe_interval`` tokens left: what a probe finds
        out pays in the rounds after it, and a request near its end has none. A request opens its
        draft only then, so that on a loaded service, where speculation does not pay, no draft
        prefill takes the shared hardware from the target's steps; the opening is priced because
        it is most of what the draft costs there
        (docs/profiles.md#the-engine-loop-and-adaptive-k-under-load)."""
        if not self.drafter:
            return False
        open_ms = context_tokens * self.costs.draft_prefill_ms_per_token
        drafter, _ = self._best(matches, True, open_ms / remaining if remaining > 0 else 0.0)
        probe_due = (
            drafter == PLAIN and self._probe_due(self._opening_share(open_ms, remaining)) and self._could_win(matches)
        )
        return drafter == self.drafter or (probe_due and not 0 < remaining <= self.probe_interval)

    def _opening_share(self, open_ms: float, remaining: int) -> float:
        """A probe's share of ``open_ms``, the draft's opening: the session stays open for every
        probe the ``remaining`` tokens allow (one per ``probe_interval`` tokens at most), so each
        pays its part of it, and a probe with no later one (or ``remaining`` 0, unknown) all of it.
        Not in full: the opening grows by the prefill of one token each plain round, which puts
        the probe off by ``probe_interval`` x that / a plain round's ms, so with a draft as slow as
        the plain round the probe would never come."""
        if remaining <= self.probe_interval:
            return open_ms
        return open_ms * self.probe_interval / remaining

    def _could_win(self, matches: Matches | None) -> bool:
        """Under load, whether the model drafter, were every draft token of it accepted, would be
        this round's best option at the current load and costs: a probe measures its acceptance,
        so where even a drafter always right loses, no probe can find it worth using (on a loaded
        service whose draft shares the target's cores, most rounds). Alone, True: a probe also
        measures the draft's cost, whose start-up measurement
        can read several times too high (taken while the other services load), and a request
        alone is where that estimate is put right."""
        if self.load.others_seqs < 1:
            return True
        assert self.acceptance is not None
        always_right = AcceptanceModel([1.0] * len(self.acceptance.rates))
        drafter, _ = dataclasses.replace(self, acceptance=always_right)._best(matches, True)
        return drafter == self.drafter

    def _best(
        self, matches: Matches | None, draft_available: bool, open_ms_per_token: float = 0.0, missed_steps: float = 0.0
    ) -> tuple[str, int]:
        options = self.options(matches, draft_available, open_ms_per_token, missed_steps)
        drafter, k, _ = max(options, key=lambda option: (option[2], -option[1]))
        return drafter, k

    def _probe_due(self, open_ms: float = 0.0) -> bool:
        """Whether this round, counted, reaches :meth:`_rounds_between_probes` since the model
        drafter last proposed."""
        return self._rounds_without_drafter + 1 >= self._rounds_between_probes(open_ms)

    def _rounds_between_probes(self, open_ms: float = 0.0) -> float:
        """``probe_interval``, stretched by what a probe round costs over a plain one at the current
        load, ``open_ms`` (its share of opening the draft session) included: probing a slow draft,
        one on a loaded service or one that must first prefill a long context then costs no larger
        share of the fallback's time than probing a cheap one."""
        others = self.load.others_tokens
        probe = self.costs.round_ms(min(self.probe_k, self.k_max), True, others) + open_ms
        return self.probe_interval * max(1.0, probe / self.costs.round_ms(0, False, others))

    def observe(self, record: RoundRecord, matches: Matches | None, committed: list[int]) -> None:
        """Learns from a finished round: its record, the lookups' matches looked up before it
        (used or not) and the tokens it committed. Under load, every round tells the ledger
        whether it searched the lookups (:attr:`lookups_on`, read before the round) and whether one
        was chosen."""
        if self.lookups and self.load.others_seqs >= 1:
            self.lookup_ledger.under_load(searched=self._searched, chosen=record.drafter in self.lookups)
        self._priced_plain = max(0, self._priced_plain - 1)
        draft_call = bool(self.drafter) and record.drafter == self.drafter
        if record.decoded_ahead:  # chosen by the round before (decodes_ahead), not by next_round
            self._rounds_without_drafter += 1
        if draft_call and self.acceptance is not None:
            self.acceptance.observe(*drafted_outcome(record))
        if record.drafter in self.lookups:
            self.lookup_ledger.credit(record.num_accepted)
        for _, match, model in self._lookup_models(matches):
            model.observe_tokens(match.tokens, committed)
        self.costs.observe(record, draft_call, self.hidden_behind_verify)
        self.load.observe(record, len(committed))

    def observe_prefill(self, num_seqs: int, num_running_seqs: int) -> None:
        """Learns the load the request's prefill met (:meth:`Load.observe_prefill`)."""
        self.load.observe_prefill(num_seqs, num_running_seqs)

    def observe_draft_prefill(self, num_tokens: int, ms: float) -> None:
        """Learns what opening the draft session cost: a Prefill of ``num_tokens`` in ``ms``
        (:meth:`StepCosts.observe_draft_prefill`)."""
        self.costs.observe_draft_prefill(num_tokens, ms)

    def end(self) -> Learnt | None:
        """Takes the request's bid out of the step budget and blends what its rounds observed into
        the warm starts and the lookup memory of ``shared`` (:meth:`AdaptiveState.remember`). Returns the warm starts
        that changed, its ``owner``'s; None without ``shared``, or when its rounds observed no
        acceptance (say, a request of plain rounds alone without lookup matches)."""
        if self.bids is not None:
            self.bids.pop(self, None)
        if self.shared is None:
            return None
        priors = self.shared.remember(self)
        return Learnt(self.owner, priors) if priors else None

    def acceptance_models(self) -> dict[str, AcceptanceModel]:
        """The acceptance models the request's rounds observed, by the name each one's warm start
        is kept under; the others hold their warm start as it began (the forced-token lookup's of
        a request without structured output, a lookup's match length never matched, a drafter
        never asked to draft), which is no measurement of this request's to share."""
        models = {f"{name}/{n}": model for name, lookup in self.lookups.items() for n, model in enumerate(lookup, 1)}
        if self.drafter and self.acceptance is not None:
            models[self.drafter] = self.acceptance
        if self.forced is not None:
            models[FORCED] = self.forced
        return {source: model for source, model in models.items() if model.observed}

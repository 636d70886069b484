"""Adaptive K: each round, the number of draft tokens that maximises expected committed tokens
per millisecond, from an online acceptance model and the measured step costs.

Acceptance model: for each draft position i (1-based), the conditional probability a_i that draft
token i passes given that tokens 1..i-1 passed, tracked as an exponential moving average (as in
vLLM's adaptive speculation and DISCO, Mamou et al. 2024 / SpecDec++, Huang et al. 2024). A
round that drafted d tokens and accepted n observes passes at positions 1..n and, when n < d, a
rejection at n + 1; later positions are not observed.

Expected tokens of a round with K drafts: 1 + sum_{i=1..K} prod_{j<=i} a_j (the design brief's
(1 - a^(K+1)) / (1 - a) when every a_j = a). Its time (:class:`StepCosts`): the wait for the
draft's K forwards + the verify round's ms for K drafts + the rest of the round, where K = 0 is a
plain decode step on the verify service (the fallback). A draft that drafts ahead works during the
verify: a round waits only for the K + 1 forwards' excess over the verify, and for K more where
the proposal drafted ahead misses (:meth:`StepCosts.draft_wait_ms`).

Under load (goodput, as in SmartSpec, Liu et al. 2024): the verify service batches every request's
round into one step whose cost grows with its batched tokens, so a request's K + 1 tokens make
every other request's round slower too. With B other sequences bringing T tokens to the step (the
sequences running on the service when it served the request's last round, also those away
drafting: they are the batch a step should hold), option K is scored by the whole batch's
expected tokens per ms, (E(K) + W) / (draft(K) + step(T + K + 1) + rest), where W, the others'
work in the step, is the larger of B x g (g: the tokens a round of this request commits on
average, the others assumed alike) and T, and step(n) is the verify cost at n batched tokens: the
line the verify service publishes (``ServiceLoad.step_intercept_ms``, ``step_ms_per_token``:
fitted there to its start-up profile and to every step of decoding work it runs, for every
coordinator: :mod:`specdec.engine.step_line`), or where a service reports none, a line fitted here
to its start-up measurements (:attr:`StepCosts.batched_ms`) and to this coordinator's live rounds
whose step ran decoding work only (:meth:`StepCosts.step_ms`: a prefill chunk's tokens cost
less than a draft token's), and rest the round's overhead, not its wait for the step in progress
(other sequences' work, which their steps count: :meth:`StepCosts.observe`). Alone (B = 0) this
is the formula above. As load grows K
shrinks, and reaches 0 (plain decode) where speculation no longer pays. Each request prices its
own round and sees the others as they were; the step budget (:mod:`coordinator.speculation.step_budget`)
then caps its K at its share of one allocation over every running request of the coordinator on
the target, by the same measure (SmartSpec's greedy marginal goodput over their bids), so that the
requests sharing a step do not each take the tokens that pay for one of them alone. W counts the others'
prefill chunks as the step's work, not as its overhead: the service must prefill them whatever
this request does, and a draft token that slows the step delays them as much as it delays the
others' decode tokens. Why: docs/profiles.md#serving-under-load-one-engine-loop-per-model.
Plain rounds whose Decode went out with the round before (decode ahead,
:class:`coordinator.speculation.rounds.RequestRounds`) pay no rest beyond their step
(``StepCosts.plain_overhead_ms``); a round that turns around instead waits, under load, for the
step in progress where the engine steps without it, so the options but plain decode also pay the
steps they make the request miss (:meth:`AdaptiveK.missed_steps`).

Hybrid drafting: every round the coordinator also looks the committed text's suffix up in its own
model-free lookups (no network hop, no draft cost): the n-gram index (:mod:`specdec.lookups.ngram`, what
followed the latest match) and SuffixDecoding (:mod:`specdec.lookups.suffix`, the most frequent
continuation over the request and earlier outputs). Their proposals compete with the model
drafter's under the same formula, with acceptance tracked per lookup and matched suffix length n
(a 3-token match predicts better than a 1-token one; suffix matches from 4 tokens up share one
estimate) and a round cost of the verify call alone. A lookup's acceptance is observed every
round, whether or not its proposal was used, by comparing it with the tokens the round committed:
under greedy decoding that is exactly the acceptance test's outcome; under sampling the committed
tokens follow the target distribution p, so a match at a position has probability p(token), the
acceptance probability of a point-mass draft (Leviathan et al. 2023). So lookup estimates need no
probing and cost nothing to keep.

Structured output: where the request's grammar allows one continuation of the text only (the keys
and punctuation of a JSON schema), its tokens are free proposals, costing no draft forward. The
draft's model drafters open their proposals with them and jump over them again after each drafted
token (jump-forward), and say which tokens were forced (``ProposeResponse.forced``); the
coordinator follows the grammar too (:class:`specdec.sampling.grammar.ForcedTokenLookup`, llguidance
without torch), so it knows the f tokens forced next before a round. They count
twice: as a lookup of their own (a round of the forced tokens alone: no draft call at all; its
per-position estimates observed every round, like n-gram's), and as the free head of the model
drafter's options: option K = f + d costs d draft tokens, its expected tokens are the forced
tokens' rates then, once those passed, the drafter's; d ranges over 1..``k_max``, so forced tokens
take a round past ``k_max`` up to the verify service's largest K (more tokens per verify, at no
draft cost). The drafter's acceptance estimates and its ms per token learn from its drafted
tokens alone (:func:`drafted_outcome`), so they mean the same with a grammar and without (both
are shared with the requests without one). Forced tokens that follow a drafted token are known
only once drafted: they are priced as drafted tokens (their cost overestimated, their acceptance
the drafter's). Why both halves: the draft's report alone cannot price a round before it runs
and leaves a round of forced tokens paying the draft's hop; the coordinator's lookup alone could
not propose the text after them, which only a model drafts. Lossless either way: forced tokens
are verified like any draft token (point masses under sampling), and the choice only decides who
proposes and how many (``--grammar-aware-drafting`` off: neither half).
"""

import dataclasses
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from coordinator.observability.metrics import MISS, PLAIN, RoundRecord
from coordinator.speculation.step_budget import Bid, allocate
from coordinator.speculation.upstream import TOKENS_PER_CATCH_UP_FORWARD
from specdec.engine.step_line import fit_line
from specdec.lookups.ngram import NgramMatch
from specdec.lookups.suffix import SuffixMatch
from specdec.sampling.grammar import FORCED, ForcedMatch
from specdec.token_ids import common_prefix_length
from specdec.v1.draft_pb2 import DrafterInfo
from specdec.v1.verify_pb2 import VerifyServiceGetInfoResponse as VerifyInfo

SUFFIX_LENGTHS = 4  # suffix matches of 4 tokens and more share one acceptance estimate
LOOKUP_TRIAL_TOKENS = 8  # a request's lookups draft this many tokens before the ledger may turn them off
Match = NgramMatch | SuffixMatch | ForcedMatch
Matches = Mapping[str, Match]  # this round's proposal of each lookup that matched


def ema(old: float, new: float, weight: float) -> float:
    """Exponential moving average: ``weight`` on the new observation."""
    return (1.0 - weight) * old + weight * new


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance probabilities ``rates[i]`` of draft position i + 1.

    ``observed``: the leading positions this model has seen a round reach. A position past them
    counts at least the deepest observed position's rate (optimism under uncertainty): positions
    are only observed by rounds that draft that far, so with estimates kept as they started there,
    a choice of K that stayed short (because the starting estimates were low) would never learn
    that longer proposals pass too."""

    rates: list[float]
    weight: float = 0.25
    observed: int = 0

    def observe_tokens(self, proposal: list[int], committed: list[int]) -> None:
        """Observes a proposal against the tokens the round committed after the same prefix."""
        drafted = min(len(proposal), len(committed))
        self.observe(drafted, common_prefix_length(proposal, committed[:drafted]))

    def observe(self, drafted: int, accepted: int) -> None:
        """Updates the positions a round of ``drafted`` proposals with ``accepted`` passes observed
        (those it models: a draft that did not report its forced tokens may propose more)."""
        reached = min(accepted + 1, drafted, len(self.rates))
        for i in range(reached):
            self.rates[i] = ema(self.rates[i], 1.0 if i < accepted else 0.0, self.weight)
        self.observed = max(self.observed, reached)

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a round of ``k`` drafts (the target's own token included)."""
        return 1.0 + sum(self.passing(k))

    def pass_probability(self, k: int) -> float:
        """The probability that all of a round's first ``k`` drafts pass."""
        return ([1.0, *self.passing(k)])[-1]

    def passing(self, k: int) -> list[float]:
        """For i in 1..k (at most the positions modelled): the probability that drafts 1..i pass."""
        floor = self.rates[self.observed - 1] if self.observed else 0.0
        passing, probabilities = 1.0, []
        for i, rate in enumerate(self.rates[:k]):
            passing *= rate if i < self.observed else max(rate, floor)
            probabilities.append(passing)
        return probabilities


@dataclass
class StepCosts:
    """A drafter's and the target's step costs in ms: ``draft_ms_per_token``; ``verify_ms[k]``, a
    verify round with k drafts alone in its step (``verify_ms[0]`` = a plain decode step);
    ``batched_ms[n]``, a verify call whose step batched n tokens of several sequences;
    ``overhead_ms``, the rest of a round (gRPC, the coordinator's work, the wait for a free handler
    on a loaded service), not its wait for the verify step in progress (see :meth:`observe`);
    ``draft_prefill_ms_per_token``, what
    opening a draft session costs per token of the context it prefills; ``propose_call_ms``, the
    round trip of a Propose beyond the draft service's own time (gRPC, the streams' threads, the
    network between the coordinator and the draft), learnt from every Propose that answers, asked
    for in a round or drafted ahead: a round that asks for its proposal waits for it whole, and a
    proposal drafted ahead is ready that much later than its forwards (:meth:`draft_wait_ms`);
    learnt from every answer so that a round trip measured under load does not linger once
    few rounds ask (docs/architecture.md#design-decisions); ``plain_overhead_ms``, the rest of a
    plain round whose Decode was sent with the round before (decode ahead,
    :class:`coordinator.speculation.rounds.RequestRounds`: its step follows that one's without the
    coordinator's turnaround, so about 0 where a round trip is shorter than a step), learnt from
    those rounds, None until one ran (plain rounds are then priced with ``overhead_ms``);
    ``missed_step_share``, the share of a step a round that turned around waited for the step in
    progress (0 to 1: none, where the engine waits for its callers' turnaround; most of one, where
    the others' next calls were queued before and it steps without the round), from the rounds
    not decoded ahead that shared a step of decoding work (:meth:`AdaptiveK.missed_steps`). Seeded from
    the services' start-up measurements (GetInfo; ``propose_call_ms`` at 0), kept fresh from live
    rounds by :meth:`observe` and from the draft's prefills by :meth:`observe_draft_prefill`.
    ``service_line``: the verify service's published step line (:meth:`line`), asked for at each
    pricing (the newest report, :meth:`coordinator.speculation.placement.Placement.step_line`);
    ``reported_line``: the line its GetInfo answer carried, until a Step message brings a newer one."""

    draft_ms_per_token: float
    verify_ms: list[float]
    overhead_ms: float = 1.0
    weight: float = 0.1
    batched_ms: dict[int, float] = field(default_factory=dict)
    draft_prefill_ms_per_token: float = 0.0
    propose_call_ms: float = 0.0
    plain_overhead_ms: float | None = None
    missed_step_share: float = 0.0
    service_line: Callable[[], tuple[float, float] | None] | None = field(default=None, repr=False, compare=False)
    reported_line: tuple[float, float] | None = None
    _line: tuple[float, float] | None = field(default=None, init=False, repr=False, compare=False)

    def round_ms(
        self,
        k: int,
        draft_call: bool = True,
        others_tokens: float = 0.0,
        free: int = 0,
        hit_probability: float | None = None,
    ) -> float:
        """A round of k drafts while other sequences bring ``others_tokens`` to the step;
        ``draft_call`` False: drafts that cost nothing (n-gram lookup); ``free`` of the k cost the
        draft no forward (tokens the grammar forces); ``hit_probability``: see :meth:`draft_wait_ms`.

        A plain decode step (k = 0) is taken to cost at most the cheapest verify round (the same
        forward over fewer tokens): a start-up measurement inflated by contention would otherwise
        keep a request from ever falling back, and plain rounds never run would never correct it;
        its overhead is that of plain rounds decoded ahead where some ran (:meth:`_overhead_ms`).
        """
        if k == 0:
            verify_ms = min(self._verify_ms(j, others_tokens) for j in range(len(self.verify_ms)))
        else:
            verify_ms = self._verify_ms(k, others_tokens)
        draft_ms = self.draft_wait_ms(k - free, verify_ms, hit_probability) if draft_call and k > 0 else 0.0
        return draft_ms + verify_ms + self._overhead_ms(k)

    def _overhead_ms(self, k: int) -> float:
        """The rest of a round of k drafts: a plain round's as learnt from plain rounds decoded
        ahead, where some ran (a stretch of plain rounds decodes ahead but for its first)."""
        return self.plain_overhead_ms if k == 0 and self.plain_overhead_ms is not None else self.overhead_ms

    def draft_wait_ms(self, drafted: int, verify_ms: float, hit_probability: float | None = None) -> float:
        """The round's expected wait for a model drafter's proposal of ``drafted`` forwarded tokens.
        Not drafted ahead (``hit_probability`` None): the call's round trip (``propose_call_ms``)
        and the ``drafted`` forwards. Drafted ahead
        (:class:`coordinator.speculation.draft_side.DraftAhead`): while the target verifies one
        round, the draft drafts the next one's proposal, ``drafted`` + 1 forwards (its guess of the
        bonus token first), so every round waits for what of them, the draft call's round trip
        included, outlasts the verify call's (its ms and the round's overhead, the verify call's
        round trip in it: over a network to the draft alone, the coordinator beside the verify
        service, a proposal drafted ahead is ready a round trip after the verify's answer), and a
        round whose proposal was not drafted ahead on its branch (probability 1 -
        ``hit_probability``) also for a proposal of its own, round trip included. Why not K times
        the wait per token: the wait is not linear in K (docs/architecture.md#design-decisions);
        the round trip is priced so that a drafter whose forwards cost nothing never looks as
        cheap as plain decode."""
        asked = self.propose_call_ms + drafted * self.draft_ms_per_token  # a proposal asked for, and waited for
        if hit_probability is None:
            return asked
        outlasting = max(0.0, asked + self.draft_ms_per_token - verify_ms - self.overhead_ms)
        return outlasting + (1.0 - hit_probability) * asked

    def _observe_draft_forward(self, ms: float, miss: bool) -> None:
        """Learns a drafting-ahead draft's ms per forward from a proposal a round asked for (see
        :meth:`observe`): a miss's moves the estimate either way, another round's only down (its
        catch-up overstates a forward, never understates it), and no proposal raises it by more
        than ``weight`` (a draft service paused mid-proposal reports seconds; an estimate that high
        would keep every later request off the draft, with no round left to correct it)."""
        ms = min(ms, 2.0 * self.draft_ms_per_token)
        if miss or ms < self.draft_ms_per_token:
            self.draft_ms_per_token = ema(self.draft_ms_per_token, ms, self.weight)

    def _verify_ms(self, k: int, others_tokens: float) -> float:
        """A verify call of k drafts, in ms: alone, the plain step (k = 0) as measured and a verify
        round from the line through every K's measurement (one start-up measurement per K,
        refreshed only by the rounds that use that K, is too noisy to compare K by); under load,
        the line at the step's batched tokens."""
        if others_tokens <= 0 and k == 0:
            return self.verify_ms[0]
        return self.step_ms(others_tokens + k + 1)

    def step_ms(self, num_tokens: float) -> float:
        """A verify call's ms at ``num_tokens`` batched tokens, on :meth:`line`."""
        intercept, slope = self.line()
        return intercept + slope * num_tokens

    def line(self) -> tuple[float, float]:
        """The line :meth:`step_ms` prices a verify call by: (intercept ms, slope ms per batched
        token). The verify service's (``service_line``, else ``reported_line``), which sees every
        step; without one, :func:`specdec.engine.step_line.fit_line` through this coordinator's
        points (alone: k + 1 tokens, ``verify_ms[k]``; batched: ``batched_ms``, steps of decoding
        work only, see :meth:`observe`: the slope is what a draft token adds to a step, and a
        prefill chunk's tokens cost less). Why: docs/profiles.md#serving-under-load-one-engine-loop-per-model."""
        if self.service_line is not None and (published := self.service_line()) is not None:
            return published
        if self.reported_line is not None:
            return self.reported_line
        if self._line is None:  # fitted once per change, not per option of every round
            self._line = fit_line({k + 1: ms for k, ms in enumerate(self.verify_ms)} | self.batched_ms)
        return self._line

    def observe_draft_prefill(self, num_tokens: int, ms: float) -> None:
        """Learns from a draft session's Prefill of ``num_tokens`` tokens (those the draft's prefix
        cache did not hold) that took ``ms`` (its wall time: on shared cores, slowed by the target's
        steps as much as it slows them). Weighted at least half on the newest: a request opens its
        draft at most a few times, and the first openings under a burst take several times what
        they take alone."""
        if num_tokens > 0:
            weight = max(self.weight, 0.5)
            self.draft_prefill_ms_per_token = ema(self.draft_prefill_ms_per_token, ms / num_tokens, weight)

    def observe(self, record: RoundRecord, draft_call: bool, hidden_behind_verify: bool = False) -> None:
        """Learns from a finished round (``hidden_behind_verify``: its drafter's rounds are priced by
        :meth:`draft_wait_ms` with a hit probability). The verify costs take the forward time of
        the step that served it (``record.step_ms``; a service reporting no step: its handling
        time); the rest of the round (less the draft's time and its wait for that step,
        ``record.queue_ms``) to ``overhead_ms``, paid by every kind of round. Not kept per kind:
        a cost learnt only from the kind that runs would leave the other at its seed. The Propose
        call's round trip beyond the draft's time is the exception, kept apart
        (``propose_call_ms``): only a round that asks for a proposal pays it whole; every Propose
        answered for the round, asked for or drafted ahead, measures it
        (``record.propose_call_ms``, ``record.ahead_call_ms``). The wait for the step is priced
        nowhere: it is the service running other sequences' work (their prefill chunks, under a
        burst), which their steps count (W), not time the batch loses. Why both:
        docs/profiles.md#serving-under-load-one-engine-loop-per-model.
        The draft's ms per token counts the tokens it drafted, not those the grammar forced (they
        cost it no forward). With ``hidden_behind_verify`` it learns from the draft service's time for the
        proposals a round asked for (``record.draft_compute_ms``), not from the wait: a hit's wait
        is what outlasted the verify, a miss's also the rest of the work ahead. A miss's proposal
        feeds the draft at most K + 1 tokens first; any other round's (the first with the draft, a
        probe after plain rounds) first feeds it what was committed without it, which priced a
        forward at several times its cost after long prompts (docs/architecture.md#design-decisions),
        so those only lower the estimate (:meth:`_observe_draft_forward`). A batched step that ran
        prefill chunks too stays out of the step line (:meth:`step_ms`). A plain round decoded ahead
        (``record.decoded_ahead``) teaches ``plain_overhead_ms`` instead of ``overhead_ms``: its
        turnaround overlapped the step before."""
        k = record.num_drafted
        if draft_call and k > record.num_forced:
            forwarded = k - record.num_forced
            if not hidden_behind_verify:
                self.draft_ms_per_token = ema(self.draft_ms_per_token, record.draft_ms / forwarded, self.weight)
            elif record.draft_compute_ms > 0:
                self._observe_draft_forward(record.draft_compute_ms / forwarded, record.draft_ahead == MISS)
        verify_ms = record.step_ms if record.batch_size else record.verify_ms
        if record.batch_size > 1:
            if not record.prefill_tokens:  # see step_ms
                n = record.batched_tokens
                self.batched_ms[n] = ema(self.batched_ms.get(n, self.step_ms(n)), verify_ms, self.weight)
        elif k < len(self.verify_ms):
            self.verify_ms[k] = ema(self.verify_ms[k], verify_ms, self.weight)
        for call_ms in (record.ahead_call_ms, record.propose_call_ms):  # the Proposes answered for the round
            if call_ms > 0:
                self.propose_call_ms = ema(self.propose_call_ms, call_ms, self.weight)
        overhead = record.wall_ms - record.draft_ms - record.propose_call_ms - verify_ms - record.queue_ms
        if record.decoded_ahead:  # the step began before the round did: at most the rest of the step
            seed = self.overhead_ms if self.plain_overhead_ms is None else self.plain_overhead_ms
            self.plain_overhead_ms = ema(seed, max(0.0, overhead), self.weight)
        else:
            self.overhead_ms = ema(self.overhead_ms, overhead, self.weight)
            if record.batch_size > 1 and not record.prefill_tokens and record.step_ms > 0:
                missed = min(1.0, record.queue_ms / record.step_ms)
                self.missed_step_share = ema(self.missed_step_share, missed, self.weight)
        self._line = None


@dataclass
class Load:
    """The load on the verify service besides the request: sequences and their new tokens per step
    (EMAs of what the service reported, ``weight`` on the newest), and the tokens the request's own
    rounds commit (the share each other sequence is assumed to add)."""

    others_seqs: float = 0.0
    others_tokens: float = 0.0
    round_tokens: float = 1.0
    weight: float = 0.5

    def observe(self, record: RoundRecord, committed: int) -> None:
        """Others: the sequences running on the verify service besides this one (not only those
        that made this round's step: a request away drafting is still in the batch it would slow),
        each bringing the mean new tokens of the others in the step (1 when none were)."""
        if record.batch_size:  # 0: a service that reports no step (older, or a test double)
            others = max(record.running_seqs, record.batch_size) - 1
            in_step = record.batch_size - 1
            per_other = (record.batched_tokens - record.num_drafted - 1) / in_step if in_step else 1.0
            self.others_seqs = ema(self.others_seqs, others, self.weight)
            self.others_tokens = ema(self.others_tokens, others * per_other, self.weight)
        self.round_tokens = ema(self.round_tokens, committed, self.weight)

    def observe_prefill(self, num_seqs: int, num_running_seqs: int) -> None:
        """Starts from the load the request's prefill met (the step that decoded its first token:
        ``num_seqs`` in it, ``num_running_seqs`` running on the service, the request included),
        where larger than the coordinator's count of its own requests at the request's start: the
        others, each taken to bring one token (their prefill chunks in the step are not told
        apart from the request's own), so that the first requests of a burst do not see
        themselves alone until their first round reports the service's load."""
        others = max(num_running_seqs, num_seqs) - 1
        self.others_seqs = max(self.others_seqs, others)
        self.others_tokens = max(self.others_tokens, others)

    def others_work(self) -> float:
        """The others' work in a step, in tokens (W in the module docstring): the tokens their
        rounds commit, or the tokens they bring where more (prefill chunks; also their drafts,
        rejected ones included, which overstates it a little where they speculate)."""
        return max(self.others_seqs * self.round_tokens, self.others_tokens)


@dataclass
class LookupLedger:
    """Whether a request's own n-gram and suffix lookups pay for the verify tokens they take. Each
    round a lookup proposes owes its break-even (the tokens beyond a plain round's one it must
    commit to match plain decode's goodput at the round's load and costs) and gains the draft
    tokens accepted. Once the lookups have drafted ``trial_tokens`` and gained less than they
    owed, they stay off for the rest of the request: no more lookups are made, which saves their
    CPU on the coordinator and their rejected rows on the verify service (why:
    docs/profiles.md#under-load-where-adaptive-k-lost-to-k--0). Estimates that are right need no ledger;
    the ledger catches those that are chosen when they read high (an EMA rising after a run of
    passes) and fail as often as not."""

    trial_tokens: int = LOOKUP_TRIAL_TOKENS
    drafted: int = 0
    owed: float = 0.0
    gained: int = 0

    def charge(self, k: int, break_even: float) -> None:
        """Records a lookup round of ``k`` draft tokens whose break-even is ``break_even`` tokens."""
        self.drafted += k
        self.owed += break_even

    def credit(self, accepted: int) -> None:
        """Records the draft tokens a lookup round had accepted."""
        self.gained += accepted

    @property
    def paid(self) -> bool:
        """Whether the lookups stay on: still in their trial, or having gained what they owed."""
        return self.drafted < self.trial_tokens or self.gained >= self.owed


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
    _rounds_without_drafter: int = 0

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
            self.lookup_ledger.charge(k, self._break_even(k))
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
        tokens where plain decode commits 1 a step)."""
        drafter, _ = self._best(matches, draft_available, missed_steps=2.0 * self.missed_steps())
        if drafter != PLAIN:
            return False
        return not (self.drafter and draft_available and self._probe_due() and self._could_win(matches))

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
        """Whether the request's n-gram and suffix lookups are still looked up (:class:`LookupLedger`)."""
        return self.lookup_ledger.paid

    def _within_budget(self, drafter: str, k: int, matches: Matches | None) -> int:
        """``k``, at most the request's share of the step budget (:mod:`coordinator.speculation.step_budget`)
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

    def _break_even(self, k: int) -> float:
        """The tokens beyond one that a lookup round of ``k`` drafts must commit to make the whole
        batch's goodput of a plain round (:meth:`options`' measure) at the current load."""
        others, others_tokens = self.load.others_work(), self.load.others_tokens
        plain = (1.0 + others) / self.costs.round_ms(0, False, others_tokens)
        return max(0.0, plain * self.costs.round_ms(k, False, others_tokens) - others - 1.0)

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
        (docs/profiles.md#serving-under-load-one-engine-loop-per-model)."""
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
        (used or not) and the tokens it committed."""
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

    def acceptance_models(self) -> dict[str, AcceptanceModel]:
        """Every acceptance model of the request, by the name its warm start is kept under."""
        models = {f"{name}/{n}": model for name, lookup in self.lookups.items() for n, model in enumerate(lookup, 1)}
        if self.drafter and self.acceptance is not None:
            models[self.drafter] = self.acceptance
        if self.forced is not None and self.forced.observed:  # a request with structured output
            models[FORCED] = self.forced
        return models


def drafted_outcome(record: RoundRecord) -> tuple[int, int]:
    """A model drafter's round as its acceptance model sees it, (drafted, accepted) as
    :meth:`AcceptanceModel.observe` takes them: its drafted tokens alone, the forced ones left out
    (those are the forced-token lookup's to learn), so the drafter's estimates mean the same with
    a grammar and without. A rejection at a forced token observes no drafted rejection."""
    forced = [*record.forced, *[False] * record.num_drafted]
    reached = min(record.num_accepted + 1, record.num_drafted)
    drafted = sum(not forced[i] for i in range(reached))
    accepted = sum(not forced[i] for i in range(record.num_accepted))
    return drafted, accepted


@dataclass
class AdaptiveState:
    """What the coordinator's requests share per target: step costs per drafter kept fresh by
    every live round, and acceptance estimates per drafter (and per lookup and match length) that
    warm-start each new request (an EMA over the requests that ended). ``prior_rate`` seeds a
    model drafter's estimates never seen: optimistic, so that the first requests try it and measure
    it (its acceptance is observed only in the rounds that use it). ``lookup_prior_rate`` seeds the
    lookups': a coin toss, as their acceptance is observed every round whether used or not,
    and an optimistic start would have the first requests on a loaded service verify long lookups
    that mostly fail.
    ``forced_prior_rate`` seeds the forced-token lookup's: high, as the target is masked by the same
    grammar, so a forced token fails only where the grammar also allows another tokenization of
    the same text; it is observed every round too. ``step_budget``: the requests on one target
    bid for one speculation budget per step (``bids``, by target model; :meth:`AdaptiveK._within_budget`).

    Warm starts are kept per owner (the API key's owner hash; "" without keys, or for every key
    with ``--shared-caches``): a request starts from, and blends into, its own owner's only, so no
    tenant's requests can steer another's estimates (say, lower its K with requests whose drafts
    all fail; docs/security.md#tenants-and-the-caches). Step costs stay shared: they measure the
    services, which every request meets alike. ``service_line``: the verify service's newest
    published step line (:attr:`StepCosts.service_line`; None: the coordinator's own only)."""

    probe_interval: int = 16
    prior_rate: float = 0.8
    lookup_prior_rate: float = 0.5
    forced_prior_rate: float = 0.9
    request_weight: float = 0.5
    step_budget: bool = True
    costs: dict[tuple[str, str], StepCosts] = field(default_factory=dict)
    priors: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # by (source, target, owner)
    bids: dict[str, MutableMapping[AdaptiveK, Bid]] = field(default_factory=dict)
    service_line: Callable[[], tuple[float, float] | None] | None = None

    def policy(
        self,
        drafter: DrafterInfo | None,
        target: VerifyInfo,
        k_max: int,
        lookups: Mapping[str, int],
        others: int = 0,
        hidden_behind_verify: bool = False,
        owner: str = "",
    ) -> AdaptiveK:
        """A new request's :class:`AdaptiveK`, from the services' GetInfo replies. ``drafter``
        None: the lookups only (the request's drafter is ``ngram`` or ``suffix``). ``lookups``:
        the lookups that compete, each with its number of match-length estimates (the n-gram
        index's ``ngram_max``, SUFFIX_LENGTHS). ``others``: the requests running besides it, the
        load it assumes until its first round reports the service's. ``hidden_behind_verify``: the
        request's model drafter drafts ahead on hardware of its own (:meth:`StepCosts.draft_wait_ms`
        prices its rounds; not where the draft shares the target's cores: its forwards ahead then
        slow the verify they would hide behind). ``owner``: whose warm starts it uses."""
        name = drafter.name if drafter else None
        key = (name or "+".join(lookups), target.model)
        if key not in self.costs:
            measured = list(target.verify_ms) or [1.0]  # unmeasured: every round costs the same
            measured += measured[-1:] * (k_max + 1 - len(measured))
            batched = {cost.num_tokens: cost.ms for cost in target.step_costs if cost.num_seqs > 1}
            draft_ms = drafter.step_ms if drafter else 0.0
            self.costs[key] = StepCosts(
                draft_ms,
                measured,
                batched_ms=batched,
                draft_prefill_ms_per_token=draft_ms / TOKENS_PER_CATCH_UP_FORWARD,
                service_line=self.service_line,
            )
        if target.load.step_intercept_ms or target.load.step_ms_per_token:  # the line as of this GetInfo
            self.costs[key].reported_line = (target.load.step_intercept_ms, target.load.step_ms_per_token)
        return AdaptiveK(
            k_max,
            name,
            self._warm_start(name, target.model, k_max, self.prior_rate, owner) if name else None,
            {
                lookup: [
                    self._warm_start(f"{lookup}/{n}", target.model, k_max, self.lookup_prior_rate, owner)
                    for n in range(1, lengths + 1)
                ]
                for lookup, lengths in lookups.items()
            },
            self.costs[key],
            target.model,
            self.probe_interval,
            load=Load(others_seqs=others, others_tokens=others),
            forced=self._warm_start(
                FORCED, target.model, len(self.costs[key].verify_ms) - 1, self.forced_prior_rate, owner
            ),
            hidden_behind_verify=hidden_behind_verify,
            bids=self.bids.setdefault(target.model, weakref.WeakKeyDictionary()) if self.step_budget else None,
            owner=owner,
        )

    def _warm_start(self, source: str, target: str, k_max: int, prior_rate: float, owner: str) -> AcceptanceModel:
        prior = self.priors.setdefault((source, target, owner), [])
        prior += [prior_rate] * (k_max - len(prior))
        return AcceptanceModel(prior[:k_max])

    def priors_of(self, target: str, owner: str = "") -> dict[str, list[float]]:
        """``owner``'s warm starts for ``target`` by source (drafter, ``ngram/<n>``, ``forced``),
        for the request store."""
        return {
            source: list(rates) for (source, model, of), rates in self.priors.items() if (model, of) == (target, owner)
        }

    def set_priors(self, target: str, priors: dict[str, list[float]], owner: str = "") -> None:
        """Replaces ``owner``'s warm starts for ``target`` with those from the request store (every
        coordinator replica's requests of that owner blend into them)."""
        for source, rates in priors.items():
            self.priors[(source, target, owner)] = list(rates)

    def remember(self, policy: AdaptiveK) -> None:
        """Blends an ended request's acceptance estimates into the warm starts, and takes its bid
        out of the step budget (a request that ends otherwise leaves with its policy)."""
        if policy.bids is not None:
            policy.bids.pop(policy, None)
        for source, model in policy.acceptance_models().items():
            prior = self.priors[(source, policy.target, policy.owner)]
            for i, rate in enumerate(model.rates):
                prior[i] = ema(prior[i], rate, self.request_weight)

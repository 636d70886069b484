"""What a round costs, in ms, and the load it is priced under.

A round's time (:class:`StepCosts`): the wait for the draft's K forwards + the verify round's ms
for K drafts + the rest of the round, where K = 0 is a plain decode step on the verify service
(the fallback). A draft that drafts ahead works during the verify: a round waits only for the
K + 1 forwards' excess over the verify, and for K more where the proposal drafted ahead misses
(:meth:`StepCosts.draft_wait_ms`).

Under load (goodput, as in SmartSpec, Liu et al. 2024): the verify service batches every request's
round into one step whose cost grows with its batched tokens, so a request's K + 1 tokens make
every other request's round slower too. :class:`Load` is what the request sees of the others: B
other sequences bringing T tokens to the step (the sequences running on the service when it
served the request's last round, also those away drafting: they are the batch a step should
hold). step(n), the verify cost at n batched tokens, is the line the verify service publishes
(``ServiceLoad.step_intercept_ms``, ``step_ms_per_token``: fitted there to its start-up profile and
to every step of decoding work it runs, for every coordinator: :mod:`specdec.engine.step_line`),
or where a service reports none, a line fitted here to its start-up measurements
(:attr:`StepCosts.batched_ms`) and to this coordinator's live rounds whose step ran decoding work
only (:meth:`StepCosts.step_ms`: a prefill chunk's tokens cost less than a draft token's); the
rest is the round's overhead, not its wait for the step in progress (other sequences' work, which
their steps count: :meth:`StepCosts.observe`). How the adaptive policy scores an option with them:
:mod:`coordinator.speculation.policy.adaptive`. Why: docs/profiles.md#the-engine-loop-and-adaptive-k-under-load.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.observability.metrics import MISS, RoundRecord
from coordinator.speculation.policy.acceptance_model import ema
from specdec.engine.step_line import fit_line


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
        if k == 0:  # past j = 0 the verify of j drafts is a line in j: its least is at an end
            last = len(self.verify_ms) - 1
            verify_ms = min(self._verify_ms(j, others_tokens) for j in {0, min(1, last), last})
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
        (:class:`coordinator.speculation.draft_client.DraftAhead`): while the target verifies one
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
        prefill chunk's tokens cost less). Why: docs/profiles.md#the-engine-loop-and-adaptive-k-under-load."""
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
        docs/profiles.md#the-engine-loop-and-adaptive-k-under-load.
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
        """The others' work in a step, in tokens (W in :mod:`coordinator.speculation.policy.adaptive`):
        the tokens their rounds commit, or the tokens they bring where more (prefill chunks; also
        their drafts, rejected ones included, which overstates it a little where they speculate)."""
        return max(self.others_seqs * self.round_tokens, self.others_tokens)

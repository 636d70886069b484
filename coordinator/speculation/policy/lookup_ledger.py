"""Whether a request's own n-gram and suffix lookups pay for the verify tokens they take, and, under
load, for their search; and what the coordinator's ended requests found of theirs, so that new
requests under load skip lookups that recent ones never chose."""

from dataclasses import dataclass

LOOKUP_TRIAL_TOKENS = 8  # a request's lookups draft this many tokens before the ledger may turn them off
# Under load, rounds in a row whose lookups were searched and none chosen, after which they are off:
# at the near-free ceiling's 16 streams the suffix lookup's index (each prompt whole) and search
# took the coordinator from 0.25 to 0.43 ms of CPU a token in rounds that all decoded plainly
# (docs/benchmark.md#current-result-ceiling).
IDLE_SEARCHES = 16
# Ended requests in a row whose lookups were never chosen in IDLE_SEARCHES rounds or more under
# load, after which the coordinator's new requests under load start without them, all but one in
# TRIAL_EVERY.
IDLE_REQUESTS = 4
TRIAL_EVERY = 8


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
    passes) and fail as often as not.

    A search costs the coordinator's CPU too, which under load the services' steps share: once
    ``idle_searches`` rounds in a row under load searched the lookups and chose none (their
    proposals never good enough: random or unrepeated text), they stay off as well. Alone, a search
    costs a sliver of a round and the lookups are always searched."""

    trial_tokens: int = LOOKUP_TRIAL_TOKENS
    idle_searches: int = IDLE_SEARCHES
    drafted: int = 0
    owed: float = 0.0
    gained: int = 0
    searched_idle: int = 0  # rounds in a row under load whose search chose no lookup
    rounds_under_load: int = 0

    def charge(self, k: int, break_even: float) -> None:
        """Records a lookup round of ``k`` draft tokens whose break-even is ``break_even`` tokens."""
        self.drafted += k
        self.owed += break_even

    def credit(self, accepted: int) -> None:
        """Records the draft tokens a lookup round had accepted."""
        self.gained += accepted

    def under_load(self, searched: bool, chosen: bool) -> None:
        """Records a round under load: ``searched``, whether it searched the lookups; ``chosen``,
        whether it proposed a lookup's match."""
        self.rounds_under_load += 1
        if searched:
            self.searched_idle = 0 if chosen else self.searched_idle + 1

    @property
    def paid(self) -> bool:
        """Whether the lookups stay on: still in their trial, or having gained what they owed, and
        chosen within the last ``idle_searches`` searches under load."""
        drafts_pay = self.drafted < self.trial_tokens or self.gained >= self.owed
        return drafts_pay and self.searched_idle < self.idle_searches


@dataclass
class LookupMemory:
    """What the coordinator's ended requests on one target (of one owner) found of their lookups
    under load, for the requests that start after them. Each request indexes its prompt in its
    lookups while the target prefills it, and under load learns only afterwards that they never win:
    at the near-free ceiling's 16 streams no round of any request searched them (even a sure
    proposal lost to plain decode at that load), so indexing the Spec-Bench prompts was all they
    did (docs/profiles.md#adaptive-ks-coordinator-at-the-ceiling). Once ``idle_requests`` ended
    in a row without choosing their lookups in ``idle_searches`` rounds or more under load
    (:class:`LookupLedger`: searched and not chosen, or not searched at all), a request that starts
    under load (others running besides it) starts without lookups, neither indexing its prompt nor
    searching, except one in ``trial_every``, which has them as before: the first of those whose
    lookups are chosen (its text repeats, say) starts every request with them again. A request
    that starts alone always has them: alone a search costs a sliver of its round.

    Per owner, like the acceptance estimates' warm starts (:class:`AdaptiveState`), so that no
    tenant's requests turn off another's lookups."""

    idle_requests: int = IDLE_REQUESTS
    trial_every: int = TRIAL_EVERY
    idle_in_a_row: int = 0  # the last ended requests whose lookups were never chosen under load
    started_without: int = 0  # requests that started under load since the lookups were last chosen

    def with_lookups(self, others: int) -> bool:
        """Whether a request starting with ``others`` requests running besides it gets lookups;
        one that starts under load while the memory is on is counted (every ``trial_every``-th
        gets them)."""
        if others < 1 or self.idle_in_a_row < self.idle_requests:
            return True
        self.started_without += 1
        return self.started_without % self.trial_every == 0

    def ended(self, ledger: LookupLedger) -> None:
        """Learns from an ended request's ledger: its lookups chosen at least once (the memory
        forgets: every request has them again), never chosen in ``ledger.idle_searches`` rounds or
        more under load, or neither (it ran alone, or too short: no change)."""
        if ledger.drafted:
            self.idle_in_a_row = self.started_without = 0
        elif ledger.rounds_under_load >= ledger.idle_searches:
            self.idle_in_a_row += 1

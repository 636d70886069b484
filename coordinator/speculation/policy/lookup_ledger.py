"""Whether a request's own n-gram and suffix lookups pay for the verify tokens they take, and, under
load, for their search."""

from dataclasses import dataclass

LOOKUP_TRIAL_TOKENS = 8  # a request's lookups draft this many tokens before the ledger may turn them off
# Under load, rounds in a row whose lookups were searched and none chosen, after which they are off:
# at the near-free ceiling's 16 streams the suffix lookup's index (each prompt whole) and search
# took the coordinator from 0.25 to 0.43 ms of CPU a token in rounds that all decoded plainly
# (docs/benchmark.md#current-result-ceiling).
IDLE_SEARCHES = 16


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

    def charge(self, k: int, break_even: float) -> None:
        """Records a lookup round of ``k`` draft tokens whose break-even is ``break_even`` tokens."""
        self.drafted += k
        self.owed += break_even

    def credit(self, accepted: int) -> None:
        """Records the draft tokens a lookup round had accepted."""
        self.gained += accepted

    def searched(self, chosen: bool) -> None:
        """Records a round under load that searched the lookups: ``chosen``, whether it proposed a
        lookup's match."""
        self.searched_idle = 0 if chosen else self.searched_idle + 1

    @property
    def paid(self) -> bool:
        """Whether the lookups stay on: still in their trial, or having gained what they owed, and
        chosen within the last ``idle_searches`` searches under load."""
        drafts_pay = self.drafted < self.trial_tokens or self.gained >= self.owed
        return drafts_pay and self.searched_idle < self.idle_searches

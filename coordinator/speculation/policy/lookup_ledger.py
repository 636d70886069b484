"""Whether a request's own n-gram and suffix lookups pay for the verify tokens they take."""

from dataclasses import dataclass

LOOKUP_TRIAL_TOKENS = 8  # a request's lookups draft this many tokens before the ledger may turn them off


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

"""The K policy of a request whose K is fixed: the one it asked for, or the coordinator's
``num_speculative_tokens`` with adaptive K off."""

from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.observability.metrics import RoundRecord
from coordinator.speculation.policy.k_policy import Learnt, Matches


@dataclass(frozen=True)
class FixedK:
    """Every round asks ``drafter`` for ``k`` draft tokens (K = 0: every round a plain decode
    step, each sending the next one's Decode with its own). No lookups of the coordinator's, no
    estimates: it learns nothing from its rounds. The draft session opens beside the target's
    prefill, and again, after a failure, when a round asks the draft for its proposal
    (:meth:`coordinator.speculation.draft_client.DraftSession.proposal`)."""

    drafter: str
    k: int

    @property
    def k_max(self) -> int:
        return self.k

    @property
    def k_limit(self) -> int:
        return self.k

    @property
    def lookups(self) -> Mapping[str, object]:
        return {}

    @property
    def lookups_on(self) -> bool:
        return False

    def opens_draft_at_prefill(self, context_tokens: int, remaining: int) -> bool:
        return True

    def wants_drafter(self, matches: Matches, context_tokens: int, remaining: int) -> bool:
        return False

    def next_round(self, matches: Matches, draft_available: bool) -> tuple[str, int]:
        return self.drafter, self.k

    def decodes_ahead(self, matches: Matches, draft_available: bool) -> bool:
        return self.k == 0

    def observe(self, record: RoundRecord, matches: Matches, committed: list[int]) -> None:
        pass

    def observe_prefill(self, num_seqs: int, num_running_seqs: int) -> None:
        pass

    def observe_draft_prefill(self, num_tokens: int, ms: float) -> None:
        pass

    def end(self) -> Learnt | None:
        return None

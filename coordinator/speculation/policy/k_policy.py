"""What a round asks of a request's K policy: the contract :class:`FixedK
<coordinator.speculation.policy.fixed.FixedK>` and :class:`AdaptiveK
<coordinator.speculation.policy.adaptive.AdaptiveK>` implement, so that every request has a policy
object and the round (:mod:`coordinator.speculation.rounds`) reads the same whichever it has."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from coordinator.observability.metrics import RoundRecord
from specdec.lookups.ngram import NgramMatch
from specdec.lookups.suffix import SuffixMatch
from specdec.sampling.grammar import ForcedMatch

Match = NgramMatch | SuffixMatch | ForcedMatch
Matches = Mapping[str, Match]  # this round's proposal of each lookup that matched, by lookup name


@dataclass(frozen=True)
class Learnt:
    """The warm starts an ended request changed, for the request store to share with every
    coordinator replica: ``owner``'s for the request's target, by source, those its rounds observed
    alone (:meth:`AdaptiveState.remember
    <coordinator.speculation.policy.adaptive_state.AdaptiveState.remember>`)."""

    owner: str
    priors: dict[str, list[float]]


class KPolicy(Protocol):
    """One request's choice, each round, of its proposer (the model drafter, one of the
    coordinator's lookups, or PLAIN) and its K. Every method is called on the coordinator's event
    loop; none raises."""

    @property
    def k_max(self) -> int:
        """The most draft tokens a round's drafter drafts (the lookups' matches are asked for as
        many)."""

    @property
    def k_limit(self) -> int:
        """The most draft tokens of any round, tokens the grammar forces included (the forced-token
        lookup's matches are asked for as many)."""

    @property
    def lookups(self) -> Mapping[str, object]:
        """The coordinator's lookups (n-gram, suffix) the request drafts with, by name; empty for
        none."""

    @property
    def lookups_on(self) -> bool:
        """Whether the request's lookups are still looked up each round."""

    def opens_draft_at_prefill(self, context_tokens: int, remaining: int) -> bool:
        """Whether a greedy request opens its draft session beside the target's prefill (of
        ``context_tokens``, with ``remaining`` tokens left to generate) rather than when a later
        round would use the drafter."""

    def wants_drafter(self, matches: Matches, context_tokens: int, remaining: int) -> bool:
        """Whether a round whose draft session is not open opens it now (the round itself then
        runs without it)."""

    def next_round(self, matches: Matches, draft_available: bool) -> tuple[str, int]:
        """The round's proposer and K (``matches[proposer].tokens[:K]`` for a lookup; (PLAIN, 0)
        or K = 0 for a plain decode step). ``draft_available`` False: the draft session is not
        open, or the draft failed recently."""

    def decodes_ahead(self, matches: Matches, draft_available: bool) -> bool:
        """Whether a plain round sends the next round's Decode with its own: the next round most
        likely decodes too (decode ahead, :class:`coordinator.speculation.rounds.RequestRounds`)."""

    def observe(self, record: RoundRecord, matches: Matches, committed: list[int]) -> None:
        """Learns from a finished round: its record, the lookups' ``matches`` before it (used or
        not) and the tokens it ``committed``."""

    def observe_prefill(self, num_seqs: int, num_running_seqs: int) -> None:
        """Learns the load the request's prefill met on the verify service: ``num_seqs`` in its
        step, ``num_running_seqs`` running there."""

    def observe_draft_prefill(self, num_tokens: int, ms: float) -> None:
        """Learns what opening the draft session cost: a Prefill of ``num_tokens`` in ``ms``."""

    def end(self) -> Learnt | None:
        """Called once, when the request ends: hands what the policy learnt to the estimates the
        coordinator's requests share. Returns the warm starts that changed (the caller stores
        them), None when nothing was learnt."""

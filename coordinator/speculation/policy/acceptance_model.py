"""Acceptance estimates: for each draft position i (1-based), the conditional probability a_i
that draft token i passes given that tokens 1..i-1 passed, tracked as an exponential moving
average (as in vLLM's adaptive speculation and DISCO, Mamou et al. 2024 / SpecDec++, Huang et al.
2024). A round that drafted d tokens and accepted n observes passes at positions 1..n and, when
n < d, a rejection at n + 1; later positions are not observed.

Expected tokens of a round with K drafts: 1 + sum_{i=1..K} prod_{j<=i} a_j (the design brief's
(1 - a^(K+1)) / (1 - a) when every a_j = a).
"""

from dataclasses import dataclass

from coordinator.observability.metrics import RoundRecord
from specdec.token_ids import common_prefix_length


def ema(old: float, new: float, weight: float) -> float:
    """Exponential moving average: ``weight`` on the new observation (every estimate of the K
    policy is kept by one: acceptance rates, step costs, load)."""
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

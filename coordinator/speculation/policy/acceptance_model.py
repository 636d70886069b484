"""Acceptance estimates: for each draft position i (1-based), the conditional probability a_i
that draft token i passes given that tokens 1..i-1 passed, tracked as an exponential moving
average (as in vLLM's adaptive speculation and DISCO, Mamou et al. 2024 / SpecDec++, Huang et al.
2024). A round that drafted d tokens and accepted n observes passes at positions 1..n and, when
n < d, a rejection at n + 1; later positions are not observed.

Expected tokens of a round with K drafts: 1 + sum_{i=1..K} prod_{j<=i} a_j (the design brief's
(1 - a^(K+1)) / (1 - a) when every a_j = a).
"""

from dataclasses import dataclass, field

from coordinator.observability.metrics import RoundRecord
from specdec.token_ids import common_prefix_length


def ema(old: float, new: float, weight: float) -> float:
    """Exponential moving average: ``weight`` on the new observation (every estimate of the K
    policy is kept by one: acceptance rates, step costs, load)."""
    return (1.0 - weight) * old + weight * new


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance probabilities ``rates[i]`` of draft position i + 1.

    ``counts[i]``: the rounds that reached position i + 1 (a round reaches the leading positions,
    so the counts never grow with i); :attr:`observed`: the leading positions some round reached.
    A position past the deepest one reached by 1 / ``weight`` rounds (the EMA's memory; before any
    has, the deepest reached) counts at least that position's rate (optimism under uncertainty):
    positions are only observed by rounds that draft that far, so with estimates kept as they
    started there, or as one rejection left them,
    a choice of K that stayed short would never learn that longer proposals pass too (at batch 1
    one rejection at position 5 held a request at K = 4 where position 5 passed 88-94% of the time:
    docs/profiles.md#batch-1-on-an-avx2-host-where-the-tokens-a-round-went).

    What the policy asks of it every round, for every K (:meth:`passing`, :meth:`expected_tokens`,
    :meth:`pass_probability`), is computed once per change of the estimates (:meth:`observe`) and
    read from then on: asked afresh, it was a third of adaptive K's CPU a round."""

    rates: list[float]
    weight: float = 0.25
    counts: list[int] = field(init=False)
    # (passing of every position, expected tokens of every K); None: to compute (see _tables)
    _cached: tuple[list[float], list[float]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.rates)

    @property
    def observed(self) -> int:
        """The leading positions some round reached."""
        return self._reached_by(1)

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
            self.counts[i] += 1
        self._cached = None

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a round of ``k`` drafts (the target's own token included)."""
        return self._tables()[1][min(max(k, 0), len(self.rates))]

    def pass_probability(self, k: int) -> float:
        """The probability that all of a round's first ``k`` drafts pass."""
        passing = self._tables()[0]
        return passing[min(k, len(passing)) - 1] if k > 0 and passing else 1.0

    def passing(self, k: int) -> list[float]:
        """For i in 1..k (at most the positions modelled): the probability that drafts 1..i pass."""
        return self._tables()[0][: max(k, 0)]

    def _tables(self) -> tuple[list[float], list[float]]:
        """:meth:`passing` of every position modelled, and its running sums plus one (the expected
        tokens of K = 0, 1, ...), computed once per change of the estimates."""
        if self._cached is None:
            floor_at = self._reached_by(round(1.0 / self.weight)) or self.observed
            floor = self.rates[floor_at - 1] if floor_at else 0.0
            passing, probabilities, expected = 1.0, [], [1.0]
            for i, rate in enumerate(self.rates):
                passing *= rate if i < floor_at else max(rate, floor)
                probabilities.append(passing)
                expected.append(expected[-1] + passing)
            self._cached = probabilities, expected
        return self._cached

    def _reached_by(self, rounds: int) -> int:
        """The leading positions at least ``rounds`` rounds reached (0: none)."""
        return sum(count >= rounds for count in self.counts)


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

"""Adaptive K: each round, the number of draft tokens that maximises expected committed tokens
per millisecond, from an online acceptance model and the measured step costs.

Acceptance model: for each draft position i (1-based), the conditional probability a_i that draft
token i passes given that tokens 1..i-1 passed, tracked as an exponential moving average (as in
vLLM's adaptive speculation and DISCO, Mamou et al. 2024 / SpecDec++, Huang et al. 2024). A
round that drafted d tokens and accepted n observes passes at positions 1..n and, when n < d, a
rejection at n + 1; later positions are not observed.

Expected tokens of a round with K drafts: 1 + sum_{i=1..K} prod_{j<=i} a_j (the design brief's
(1 - a^(K+1)) / (1 - a) when every a_j = a). Its time (:class:`StepCosts`): K x the draft's ms
per token + the verify round's ms for K drafts + the rest of the round, where K = 0 is a plain
decode step on the verify service (the fallback).
"""

from dataclasses import dataclass, field

from coordinator.metrics import RoundRecord
from specdec.v1.draft_pb2 import DrafterInfo
from specdec.v1.verify_pb2 import VerifyServiceGetInfoResponse as VerifyInfo


def ema(old: float, new: float, weight: float) -> float:
    """Exponential moving average: ``weight`` on the new observation."""
    return (1.0 - weight) * old + weight * new


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance probabilities ``rates[i]`` of draft position i + 1."""

    rates: list[float]
    weight: float = 0.25

    def observe(self, drafted: int, accepted: int) -> None:
        """Updates the positions a round of ``drafted`` proposals with ``accepted`` passes observed."""
        for i in range(min(accepted + 1, drafted)):
            self.rates[i] = ema(self.rates[i], 1.0 if i < accepted else 0.0, self.weight)

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a round of ``k`` drafts (the target's own token included)."""
        total, passing = 1.0, 1.0
        for rate in self.rates[:k]:
            passing *= rate
            total += passing
        return total


@dataclass
class StepCosts:
    """A drafter's and the target's step costs in ms: ``draft_ms_per_token``; ``verify_ms[k]``, a
    verify round with k drafts (``verify_ms[0]`` = a plain decode step); ``overhead_ms[0]`` and
    ``[1]``, the rest of a plain and of a speculative round (gRPC, the coordinator's work; a
    speculative round has one call more). Seeded from the services' start-up measurements
    (GetInfo), kept fresh from live rounds by :meth:`observe`."""

    draft_ms_per_token: float
    verify_ms: list[float]
    overhead_ms: list[float] = field(default_factory=lambda: [1.0, 2.0])
    weight: float = 0.1

    def round_ms(self, k: int) -> float:
        return k * self.draft_ms_per_token + self.verify_ms[k] + self.overhead_ms[k > 0]

    def observe(self, record: RoundRecord) -> None:
        k = record.num_drafted
        if k:
            self.draft_ms_per_token = ema(self.draft_ms_per_token, record.draft_ms / k, self.weight)
        if k < len(self.verify_ms):
            self.verify_ms[k] = ema(self.verify_ms[k], record.verify_ms, self.weight)
        overhead = record.wall_ms - record.draft_ms - record.verify_ms
        self.overhead_ms[record.k > 0] = ema(self.overhead_ms[record.k > 0], overhead, self.weight)


def choose_k(acceptance: AcceptanceModel, costs: StepCosts, k_max: int) -> int:
    """The K in [0, k_max] with the most expected tokens per ms (the smallest K on a tie)."""
    k_max = min(k_max, len(acceptance.rates), len(costs.verify_ms) - 1)
    return max(range(k_max + 1), key=lambda k: (acceptance.expected_tokens(k) / costs.round_ms(k), -k))


@dataclass
class AdaptiveK:
    """One session's choice of K. While the best K is 0 (plain decode: the fallback), every
    ``probe_interval``-th round drafts ``probe_k`` tokens anyway, so that a session whose text
    becomes predictable is noticed and returns to speculation."""

    k_max: int
    acceptance: AcceptanceModel
    costs: StepCosts
    probe_interval: int = 16
    pair: tuple[str, str] = ("", "")  # (drafter, target) whose shared state this session uses
    probe_k: int = 2
    _fallback_rounds: int = 0

    def next_k(self) -> int:
        k = choose_k(self.acceptance, self.costs, self.k_max)
        self._fallback_rounds = self._fallback_rounds + 1 if k == 0 else 0
        if self._fallback_rounds and self._fallback_rounds % self.probe_interval == 0:
            return min(self.probe_k, self.k_max)
        return k

    def observe(self, record: RoundRecord) -> None:
        self.acceptance.observe(record.num_drafted, record.num_accepted)
        self.costs.observe(record)


@dataclass
class AdaptiveState:
    """What the coordinator's sessions share per (drafter, target): step costs kept fresh by every
    live round, and acceptance estimates that warm-start each new session (an EMA over the
    sessions that ended). ``prior_rate`` seeds a pair never seen: optimistic, so that the first
    sessions try speculation and measure it."""

    probe_interval: int = 16
    prior_rate: float = 0.8
    session_weight: float = 0.5
    costs: dict[tuple[str, str], StepCosts] = field(default_factory=dict)
    priors: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def policy(self, drafter: DrafterInfo, target: VerifyInfo, k_max: int) -> AdaptiveK:
        """A new session's :class:`AdaptiveK`, from the services' GetInfo replies."""
        key = (drafter.name, target.model)
        if key not in self.costs:
            measured = list(target.verify_ms) or [1.0]  # unmeasured: every round costs the same
            measured += measured[-1:] * (k_max + 1 - len(measured))
            self.costs[key] = StepCosts(drafter.step_ms, measured)
        prior = self.priors.setdefault(key, [self.prior_rate] * k_max)
        prior += [self.prior_rate] * (k_max - len(prior))
        return AdaptiveK(k_max, AcceptanceModel(prior[:k_max]), self.costs[key], self.probe_interval, pair=key)

    def remember(self, policy: AdaptiveK) -> None:
        """Blends an ended session's acceptance estimates into its pair's warm start."""
        prior = self.priors[policy.pair]
        for i, rate in enumerate(policy.acceptance.rates):
            prior[i] = ema(prior[i], rate, self.session_weight)

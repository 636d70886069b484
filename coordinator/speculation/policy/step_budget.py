"""One speculation budget per verify step: how many draft tokens each running request gets.

The verify service runs every running request's round in one batched step whose cost grows with
its batched tokens, so a draft token is worth verifying only where it adds more expected committed
tokens than it costs the whole batch. Following SmartSpec (Liu et al. 2024, "Optimizing
Speculative Decoding for Serving LLMs Using Goodput"), the budget is allocated greedily by
marginal goodput:

- a step of n batched tokens costs ``intercept_ms + slope_ms * n`` (ms; the line
  :meth:`coordinator.speculation.policy.step_costs.StepCosts.step_ms` fits, the round's overhead in the
  intercept);
- every request brings one token of its own (the target's bonus token, or its plain decode step:
  1 expected committed token), and the step's other work (``others_tokens``: prefill chunks, other
  coordinators' sequences) brings as many tokens as it commits, at the same cost per token;
- a request's i-th draft token costs ``slope_ms`` plus its ``draft_ms`` (its drafter's forward
  where the draft shares the target's hardware and does not draft ahead; 0 for a lookup, which
  costs no forward) and commits ``passing[i]`` tokens in expectation (the probability that drafts
  1..i + 1 all pass);
- goodput is expected committed tokens per ms of the step; a token of probability p and cost c
  raises the goodput E / C of the step so far iff p / c > E / C. Taken in order of p / c, highest
  first (each request's ``passing`` is non-increasing, so each gets a prefix of its drafts), until
  the first token that does not raise it. K = 0 for every request is where the first does not.

Decision (docs/architecture.md, "Design decisions"): the budget lives in the coordinator, which
holds each request's acceptance estimates and proposals before the step is formed, rather than in
the verify service's scheduler, which would receive the drafts already drafted (their cost spent)
and would have to be sent every request's estimates with every call. The same budget in the verify
engine, tried, read within the runs' spread of this one. A coordinator replica sees only its own
requests: the others on the verify service count as ``others_tokens``.
"""

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

Bidder = TypeVar("Bidder", bound=Hashable)


@dataclass(frozen=True)
class Bid:
    """A running request's offer for the next step: ``passing[i]``, the probability that its drafts
    1..i + 1 all pass (as its proposer for the round would draft them; non-increasing, entries
    above an earlier one are taken as that one), and ``draft_ms``, what each draft token costs its
    drafter in ms besides the verify token (0: a lookup, or a draft that drafts ahead)."""

    passing: Sequence[float]
    draft_ms: float = 0.0


def allocate(
    bids: Mapping[Bidder, Bid], intercept_ms: float, slope_ms: float, others_tokens: float = 0.0
) -> dict[Bidder, int]:
    """The number of draft tokens (K) for each request of ``bids`` in the next step, by greedy
    marginal goodput (the module docstring). ``intercept_ms`` and ``slope_ms`` (ms, ms per
    batched token) price the step; ``others_tokens`` is the step's work besides the bidders' (in
    tokens). Returns every bidder, K = 0 for those whose first draft token does not pay.

    ``intercept_ms`` may be below 0: a line fitted through steps that cost more per token the more
    tokens they take (a CPU's) prices a token added to a step above the step's mean. Where the line
    prices the step of the bidders' own tokens and the others' at 0 ms or less, no draft token can
    raise its goodput: K = 0 for every bidder.

    Raises ValueError for ``slope_ms`` <= 0: no draft token would then be dearer than none."""
    if slope_ms <= 0:
        raise ValueError(f"a step's price needs slope_ms > 0, got {slope_ms}")
    tokens = len(bids) + max(0.0, others_tokens)
    expected, cost = tokens, intercept_ms + slope_ms * tokens
    ks = dict.fromkeys(bids, 0)
    if cost <= 0:
        return ks
    for _, _, key, p, token_ms in sorted(_candidates(bids, slope_ms), key=lambda c: (-c[0], c[1])):
        if p * cost <= token_ms * expected:  # p / c <= E / C: this token lowers the step's goodput
            break
        ks[key] += 1
        expected += p
        cost += token_ms
    return ks


def _candidates(bids: Mapping[Bidder, Bid], slope_ms: float) -> list[tuple[float, int, Bidder, float, float]]:
    """Every bidder's draft tokens as (p / c, position, bidder, p, c), ``passing`` made
    non-increasing (a later draft never passes unless the earlier ones did)."""
    candidates = []
    for key, bid in bids.items():
        token_ms, running = slope_ms + max(0.0, bid.draft_ms), 1.0
        for position, p in enumerate(bid.passing):
            running = min(running, max(0.0, p))
            candidates.append((running / token_ms, position, key, running, token_ms))
    return candidates

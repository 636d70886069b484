"""What one tenant can do to another's adaptive K through shared acceptance estimates, and what
keeping them per owner costs, with the coordinator's own policy code (no services: rounds are
drawn, each draft passing with a given probability, and priced with SmolLM2's verify costs on 2
CPU cores and an 8.4 ms draft token, as tests/test_adaptive.py does).

- Steering: key ka runs N requests of 64 tokens whose drafts all fail, then key kb runs one of 128
  tokens whose drafts pass with probability 0.9: kb's rounds and modelled ms with warm starts
  shared by both keys, and per owner (what the coordinator keeps:
  docs/security.md#tenants-and-the-caches).
- The cost: ka runs 20 honest requests, then kb its first, both at the same acceptance: what kb
  loses by starting from the priors instead of ka's learnt estimates.

Each figure is a mean over 20 seeds.

    .venv/bin/python scripts/acceptance_steering.py
"""

import random
import statistics

from coordinator.observability.metrics import PLAIN, RoundRecord
from coordinator.speculation.policy.adaptive_state import AdaptiveState
from specdec.v1 import draft_pb2, verify_pb2

VERIFY_MS = [60.0, 70.0, 75.0, 80.0, 85.0]  # K = 0..4
DRAFT_MS = 8.4  # per draft token
SEEDS = 20
DRAFTER = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=DRAFT_MS)
TARGET = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=VERIFY_MS)


def request(state: AdaptiveState, owner: str, acceptance: float, tokens: int, rng: random.Random) -> tuple[int, float]:
    """One request of ``owner`` to ``tokens`` tokens, each draft passing with probability
    ``acceptance``; its rounds and modelled ms. Its estimates are then remembered."""
    policy = state.policy(DRAFTER, TARGET, k_max=4, lookups={}, owner=owner)
    done, rounds, ms = 0, 0, 0.0
    while done < tokens:
        _, k = policy.next_round(None)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        wall_ms = VERIFY_MS[k] + DRAFT_MS * k + 2.0
        record = RoundRecord(
            drafter=DRAFTER.name if k else PLAIN,
            k=k,
            num_drafted=k,
            num_accepted=accepted,
            draft_ms=DRAFT_MS * k,
            verify_ms=VERIFY_MS[k],
            wall_ms=wall_ms,
            wire_bytes=0,
        )
        policy.observe(record, None, [1])
        done, rounds, ms = done + accepted + 1, rounds + 1, ms + wall_ms
    policy.end()
    return rounds, ms


def victim(before: int, before_acceptance: float, acceptance: float, shared: bool) -> tuple[float, float]:
    """kb's 128 tokens after ka's ``before`` requests at ``before_acceptance``: mean rounds and ms."""
    runs = []
    for seed in range(SEEDS):
        rng, state = random.Random(seed), AdaptiveState()
        for _ in range(before):
            request(state, "ka-and-kb" if shared else "ka", before_acceptance, 64, rng)
        runs.append(request(state, "ka-and-kb" if shared else "kb", acceptance, 128, rng))
    return statistics.fmean(r for r, _ in runs), statistics.fmean(ms for _, ms in runs)


def main() -> None:
    print("steering: ka's N requests whose drafts all fail, then kb's 128 tokens at acceptance 0.9")
    for before in (0, 5, 20):
        for shared in (True, False):
            rounds, ms = victim(before, 0.0, 0.9, shared)
            label = "shared   " if shared else "per owner"
            print(f"  N = {before:2d}, warm starts {label}: {rounds:5.1f} rounds {ms:5.0f} ms")
    print("cost: ka's 20 requests, then kb's first 128 tokens, both at the same acceptance")
    for acceptance in (0.9, 0.6, 0.3):
        for shared in (True, False):
            rounds, ms = victim(20, acceptance, acceptance, shared)
            label = "shared   " if shared else "per owner"
            print(f"  acceptance {acceptance}, warm starts {label}: {rounds:5.1f} rounds {ms:5.0f} ms")


if __name__ == "__main__":
    main()

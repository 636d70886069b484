"""Per-request speculative-decoding metrics, named as vLLM reports them (design brief)."""

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from specdec.timing import ms_since
from specdec.v1 import coordinator_pb2

# The drafter of a plain decode round (K = 0): the name the benchmark reports such rounds under
# (rounds_per_drafter), and never a drafter's.
PLAIN = "plain"
HIT, MISS = "hit", "miss"  # the outcomes of a proposal drafted ahead (RoundRecord.draft_ahead)
# The branches of a proposal drafted ahead (RoundRecord.draft_ahead_branch): every predicted token
# accepted and the draft's first guess of the bonus token; every one accepted and another bonus
# token; a rejection, then the draft's second choice as the recovered token.
MAIN, BONUS, RECOVERED = "main", "bonus", "recovered"


def histogram(values: Iterable[int], size: int) -> list[int]:
    """``counts[j]`` = how many of ``values`` equal j, for j in [0, size)."""
    counts = [0] * size
    for value in values:
        counts[value] += 1
    return counts


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One round: K = ``k`` draft tokens asked of ``drafter`` (K = 0 and drafter PLAIN: a plain
    decode step), ``num_drafted`` tokens proposed (fewer than K when the drafter has no more; 0
    makes the round a plain decode step), ``num_accepted`` of them accepted; times in ms (draft
    and verify are the services' own handling times, their queues included); ``wire_bytes``:
    protobuf bytes of the round's requests and responses; ``batch_size``, ``batched_tokens`` and
    ``step_ms``: the verify service's step that served the round (sequences, new tokens, forward
    time), ``queue_ms`` the round's wait before it, ``running_seqs`` the sequences running on the
    verify service then, ``prefill_tokens`` the step's batched tokens of prefill chunks (see
    ``StepStats``); ``draft_ahead``: ``"hit"`` when the proposal was
    drafted ahead during the previous round, ``"miss"`` when one was but verification went
    another way, else ``""`` (the draft time of a hit is the round's wait for it, often 0);
    ``forced``: per proposed token, whether the request's grammar forced it (the forced-token
    lookup's, or the model drafter's jump-forward: no draft forward), empty when none was;
    ``draft_ahead_branch``: of a hit, the branch verification went down (``"main"``, ``"bonus"``
    or ``"recovered"``, see :mod:`coordinator.speculation.draft_client`); ``draft_ahead_branches``:
    the branches besides the main one drafted ahead for this round; ``draft_compute_ms``: the
    draft service's ms for a proposal asked for in the round (0 for a hit, or no draft call), and
    ``propose_call_ms`` that call's round trip beyond them (gRPC, the streams' threads, the
    network); ``ahead_call_ms``: the same of the Propose drafted ahead for this round (0 without
    one), which ran beside the previous round's verify, off this round's critical path;
    ``decoded_ahead``: a plain round whose Decode was sent with the previous round's
    (:class:`coordinator.speculation.rounds.RequestRounds`), so its step followed that one's
    without waiting for a round trip."""

    drafter: str
    k: int
    num_drafted: int
    num_accepted: int
    draft_ms: float
    verify_ms: float
    wall_ms: float
    wire_bytes: int
    batch_size: int = 0
    batched_tokens: int = 0
    queue_ms: float = 0.0
    running_seqs: int = 0
    step_ms: float = 0.0
    draft_ahead: str = ""
    forced: tuple[bool, ...] = ()
    draft_ahead_branch: str = ""
    draft_ahead_branches: int = 0
    draft_compute_ms: float = 0.0
    prefill_tokens: int = 0
    propose_call_ms: float = 0.0
    ahead_call_ms: float = 0.0
    decoded_ahead: bool = False

    @property
    def coordination_ms(self) -> float:
        """The round's wall time less its draft and verify times, at least 0: a round decoded ahead
        began after its Decode's step did."""
        return max(0.0, self.wall_ms - self.draft_ms - self.verify_ms)

    @property
    def num_forced(self) -> int:
        """Proposed tokens the grammar forced."""
        return sum(self.forced[: self.num_drafted])


@dataclass
class MetricsRecorder:
    start: float = field(default_factory=time.perf_counter)
    num_prompt_tokens: int = 0
    prefill_ms: float = 0.0
    first_token_ms: float | None = None
    rounds: list[RoundRecord] = field(default_factory=list)

    def record_first_token(self) -> None:
        if self.first_token_ms is None:
            self.first_token_ms = ms_since(self.start)

    def to_proto(self, num_generated: int, **identity) -> coordinator_pb2.RequestMetrics:
        """``identity``: the fields not computed from the rounds (seed, drafter, adaptive, ...)."""
        spec = [r for r in self.rounds if r.num_drafted]
        drafted = sum(r.num_drafted for r in spec)
        accepted = sum(r.num_accepted for r in spec)
        total_ms = ms_since(self.start)
        draft_ms = sum(r.draft_ms for r in self.rounds)
        verify_ms = sum(r.verify_ms for r in self.rounds)
        ahead = [r.draft_ahead for r in self.rounds if r.draft_ahead]
        hits = ahead.count(HIT)
        ahead_hits = [r for r in self.rounds if r.draft_ahead == HIT]
        return coordinator_pb2.RequestMetrics(
            num_spec_steps=len(spec),
            num_draft_tokens=drafted,
            num_accepted_draft_tokens=accepted,
            draft_acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_acceptance_length=1.0 + accepted / len(spec) if spec else 1.0,
            acceptance_histogram=histogram(
                (r.num_accepted for r in spec), max((r.num_drafted for r in spec), default=-1) + 1
            ),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=num_generated,
            num_target_forwards=len(self.rounds),
            tokens_per_second=num_generated / (total_ms / 1000.0) if total_ms else 0.0,
            time_to_first_token_ms=self.first_token_ms or 0.0,
            total_time_ms=total_ms,
            prefill_time_ms=self.prefill_ms,
            draft_time_ms=draft_ms,
            verify_time_ms=verify_ms,
            coordination_time_ms=sum(r.coordination_ms for r in self.rounds),
            round_wire_bytes=sum(r.wire_bytes for r in self.rounds),
            rounds_per_k=k_histogram(self.rounds),
            drafter_usage=drafter_usage(self.rounds),
            mean_batch_size=mean(r.batch_size for r in self.rounds),
            mean_batched_tokens=mean(r.batched_tokens for r in self.rounds),
            queue_time_ms=sum(r.queue_ms for r in self.rounds),
            num_draft_ahead_proposals=len(ahead),
            num_draft_ahead_hits=hits,
            draft_ahead_hit_rate=hits / len(ahead) if ahead else 0.0,
            draft_ahead_hits_per_branch=collections.Counter(r.draft_ahead_branch for r in ahead_hits),
            num_draft_ahead_branches=sum(r.draft_ahead_branches for r in self.rounds),
            num_rounds_decoded_ahead=sum(r.decoded_ahead for r in self.rounds),
            verify_costs=verify_costs(self.rounds),
            num_forced_draft_tokens=sum(r.num_forced for r in spec),
            **identity,
        )


def mean(values: Iterable[float]) -> float:
    """The mean of ``values``; 0 for none."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def k_histogram(rounds: list[RoundRecord]) -> list[int]:
    """``counts[K]``: rounds that asked for K draft tokens."""
    return histogram((r.k for r in rounds), max((r.k for r in rounds), default=-1) + 1)


def verify_costs(rounds: list[RoundRecord]) -> list[coordinator_pb2.VerifyCost]:
    """The rounds' verify calls and forwards summed per number of new tokens (K drafted + 1)."""
    by_tokens: dict[int, list[RoundRecord]] = {}
    for r in rounds:
        by_tokens.setdefault(r.num_drafted + 1, []).append(r)
    return [
        coordinator_pb2.VerifyCost(
            num_tokens=n,
            num_rounds=len(own),
            call_ms=sum(r.verify_ms for r in own),
            forward_ms=sum(r.step_ms for r in own),
        )
        for n, own in sorted(by_tokens.items())
    ]


def drafter_usage(rounds: list[RoundRecord]) -> dict[str, coordinator_pb2.DrafterUsage]:
    """Per drafter, the rounds that asked it for a proposal (plain decode rounds are in none)."""
    usage = {}
    for name in {r.drafter for r in rounds if r.drafter != PLAIN}:
        own = [r for r in rounds if r.drafter == name]
        usage[name] = coordinator_pb2.DrafterUsage(
            num_rounds=len(own),
            num_draft_tokens=sum(r.num_drafted for r in own),
            num_accepted_draft_tokens=sum(r.num_accepted for r in own),
            rounds_per_k=k_histogram(own),
        )
    return usage

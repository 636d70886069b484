"""What a round takes from the draft service: a proposal asked for in the round, or one drafted
ahead during the round before (:class:`DraftAhead`), with whether verification went down one of
its branches (:class:`DraftProposal`). The calls are :class:`coordinator.speculation.draft_client.DraftSession`'s."""

import asyncio
import time
from dataclasses import dataclass, field

from coordinator.observability.metrics import BONUS, MAIN, RECOVERED
from specdec.v1 import draft_pb2


@dataclass
class DraftAhead:
    """A Propose for the next round, sent with round ``round``'s Verify when the committed log held
    ``start`` tokens: its main branch is every ``predicted`` token accepted, then the bonus token
    the draft guessed; its other branches (``ProposeResponse.branches``) other outcomes. ``task``
    gives the ProposeResponse or raises SpecdecError; ``sent`` and ``answered`` (time.perf_counter(),
    0 until then) time its round trip."""

    task: asyncio.Future
    round: int
    start: int
    predicted: list[int]
    request_bytes: int
    sent: float = field(default_factory=time.perf_counter)
    answered: float = 0.0

    def call_ms(self, response: draft_pb2.ProposeResponse) -> float:
        """The Propose's round trip beyond the draft's compute, ms (0 while unanswered)."""
        return max(0.0, (self.answered - self.sent) * 1000 - response.compute_ms) if self.answered else 0.0

    def hit(
        self, committed: list[int], response: draft_pb2.ProposeResponse
    ) -> tuple[draft_pb2.ProposeResponse, str] | None:
        """The proposal of the branch verification went down, as a ProposeResponse, and that
        branch's kind (MAIN, BONUS or RECOVERED); None when it went down none drafted."""
        outcome = committed[self.start :]
        if (
            response.token_ids
            and response.HasField("predicted_bonus_token_id")
            and outcome == [*self.predicted, response.predicted_bonus_token_id]
        ):
            return response, MAIN
        for branch in response.branches:
            if branch.token_ids and outcome == [*self.predicted[: branch.num_accepted], branch.next_token_id]:
                proposal = draft_pb2.ProposeResponse(
                    token_ids=branch.token_ids,
                    distributions=branch.distributions,
                    forced=branch.forced,
                    compute_ms=response.compute_ms,
                )
                return proposal, BONUS if branch.num_accepted == len(self.predicted) else RECOVERED
        return None


@dataclass
class DraftProposal:
    """A round's proposal from the draft: the response (None when the draft is unavailable or
    failed), the ms the round waited for it, the draft-ahead outcome (HIT, MISS or ``""``), the
    branch of a hit (MAIN, BONUS or RECOVERED, else ``""``), the branches besides the main one the
    draft drafted ahead for this round, the protobuf bytes of the round's Propose calls both
    ways, the draft service's ms for a proposal asked for in the round (``compute_ms``; 0 for
    a hit, drafted during the previous round: a miss waits for both) and that call's round trip
    beyond them (``call_ms``: gRPC, the streams' threads, the network; 0 when the round asked for
    none), and the same of the Propose drafted ahead for the round (``ahead_call_ms``, hit or miss;
    off the round's critical path, a measure of the draft link for :class:`StepCosts`)."""

    response: draft_pb2.ProposeResponse | None = None
    wait_ms: float = 0.0
    ahead: str = ""
    wire_bytes: int = 0
    branch: str = ""
    num_branches: int = 0
    compute_ms: float = 0.0
    call_ms: float = 0.0
    ahead_call_ms: float = 0.0

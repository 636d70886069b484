"""The coordinator's client of the draft service (:class:`DraftClient`, one per coordinator) and a
request's session on it (:class:`DraftSession`): the one place that decides whether a request's
round may ask the draft service, as :mod:`coordinator.speculation.verify_client` is for the verify
service; and what a round takes from it (:class:`DraftProposal`: a proposal asked for, or one
drafted ahead, :class:`DraftAhead`).

A session is opened by a Prefill of the committed log in the background, told the committed tokens
it has not seen at each Propose, and after a failure left alone for ``retry_s`` seconds before it
is prefilled again under a new session id (so a late call to the old one cannot collide). A
Propose that missed its deadline is the exception: the session is kept, and if the draft answers
the call late (slowed by a burst of load, not hung), it is used again at once with what that call
carried; only when no answer came within ``retry_s`` is it released and prefilled again. Why: a
burst of requests arriving together misses the deadline learnt at low load without the draft being
hung (docs/faults.md#a-draft-that-hangs).
"""

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from coordinator.observability.metrics import BONUS, HIT, MAIN, MISS, RECOVERED
from coordinator.speculation.plan import ResolvedRequest
from coordinator.speculation.policy.k_policy import KPolicy
from coordinator.speculation.upstream import TOKENS_PER_CATCH_UP_FORWARD, ServiceClients
from specdec.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, SpecdecError, Unavailable
from specdec.rpc.step_client import MissedDeadline
from specdec.timing import ms_since
from specdec.v1 import draft_pb2

log = logging.getLogger(__name__)


class DraftClient:
    """The draft service's replicas (a draft pool, shared by every coordinator) as every request of
    a coordinator sees them: a replica whose call failed to answer (unreachable, or past its
    deadline) is down for ``down_s`` seconds (no session opens there meanwhile, and its sessions
    move to another, see :class:`DraftSession`) unless a late answer shows it alive first; the
    last GetInfo stands in while every replica is down. Replicas are named by their ``host:port``;
    which one a session opens on is placement's choice (:mod:`coordinator.speculation.placement`)."""

    def __init__(self, clients: ServiceClients, down_s: float = 2.0):
        self.clients, self.down_s = clients, down_s
        self.placement = clients.placements["draft"]
        self._down_until: dict[str, float] = {}
        self._info: draft_pb2.DraftServiceGetInfoResponse | None = None

    def down(self, replica: str | None = None) -> bool:
        """Whether ``replica`` failed to answer in the last ``down_s`` seconds; without one,
        whether every replica did (or none is found): requests then run without the draft instead
        of waiting on it."""
        now = time.monotonic()
        if replica is not None:
            return self._down_until.get(replica, 0.0) > now
        return all(self._down_until.get(r, 0.0) > now for r in self.clients.draft_replicas.addresses)

    def mark_down(self, replica: str) -> None:
        """Records that a call found ``replica`` unreachable or late."""
        self._down_until[replica] = time.monotonic() + self.down_s

    def order(self, prompt: Sequence[int] = (), cache_salt: str = "") -> list[str]:
        """The replicas in the order to open a session over ``prompt`` of ``cache_salt`` on
        (placement's choice first), those down last."""
        replicas = self.clients.draft_replicas.addresses
        return self.placement.rank(replicas, prompt, [r for r in replicas if self.down(r)], cache_salt)

    async def _marking_down(self, replica: str, call: Awaitable):
        try:
            return await call
        except Unavailable:
            self.mark_down(replica)
            raise

    async def info(self) -> draft_pb2.DraftServiceGetInfoResponse | None:
        """The GetInfo of the first replica that answers; while every one is down or none
        answers, the last one seen (None if none). Once one was seen, a replica gets the Propose
        deadline to answer (a hung draft then delays a new request that long, once per
        ``down_s``)."""
        if self._info is not None and self.down():
            return self._info
        timeout = self.clients.propose_deadline.seconds(0) if self._info is not None else None
        for replica in sorted(self.clients.draft_replicas.addresses, key=self.down):  # a GetInfo places nothing
            with contextlib.suppress(Unavailable):
                self._info = await self._marking_down(replica, self.clients.draft_info(replica, timeout))
                break
        return self._info

    async def prefill(
        self, replica: str, request: draft_pb2.DraftServicePrefillRequest
    ) -> draft_pb2.DraftServicePrefillResponse:
        return await self._marking_down(replica, self.clients.prefill_draft(replica, request))

    async def propose(
        self, replica: str, request: draft_pb2.ProposeRequest, on_late: Callable[[], None] | None = None
    ) -> draft_pb2.ProposeResponse:
        """A Propose; a late answer to one that missed its deadline clears the down mark (the draft
        is alive, only slowed by load, and the deadline has just learnt its new round trip) and
        calls ``on_late()``."""

        def alive() -> None:
            self._down_until.pop(replica, None)
            if on_late is not None:
                on_late()

        return await self._marking_down(replica, self.clients.propose(replica, request, on_late=alive))

    async def release(self, replica: str, session_id: str) -> None:
        """A Release: background clean-up, so a failure does not mark the replica down."""
        await self.clients.release_draft(replica, session_id)


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
        outcome, main = committed[self.start :], [*self.predicted, response.predicted_bonus_token_id]
        if response.token_ids and response.HasField("predicted_bonus_token_id") and outcome == main:
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
    draft drafted ahead for this round, the protobuf bytes of the round's Propose calls both ways,
    the draft service's ms for a proposal asked for in the round (``compute_ms``; 0 for a hit,
    drafted during the previous round: a miss waits for both) and that call's round trip beyond them
    (``call_ms``: gRPC, the streams' threads, the network; 0 when the round asked for none), and the
    same of the Propose drafted ahead for the round (``ahead_call_ms``, hit or miss; off the round's
    critical path, a measure of the draft link for :class:`StepCosts`)."""

    response: draft_pb2.ProposeResponse | None = None
    wait_ms: float = 0.0
    ahead: str = ""
    wire_bytes: int = 0
    branch: str = ""
    num_branches: int = 0
    compute_ms: float = 0.0
    call_ms: float = 0.0
    ahead_call_ms: float = 0.0


class DraftSession:
    """A request's session on the draft service (see the module docstring). Args: ``service`` the
    coordinator's :class:`DraftClient`; ``request`` the resolved request (its drafter, sampling;
    ``uses_draft_service`` False makes this session never open); ``committed`` the request's
    committed log, read at every call; ``new_session_id()`` names each new session;
    ``in_background`` runs a Release (a function making the call) without waiting; ``retry_s``
    seconds without the draft after a failure; ``owner`` the tag of the request's client its
    sessions carry (DraftServicePrefillRequest.owner). With the request's plan (``request.draft``,
    :class:`coordinator.speculation.plan.DraftPlan`) drafting ahead, it drafts the next round while
    this one verifies, for up to ``branches`` outcomes of its verification, as many as the draft can
    draft while the target verifies (:meth:`observe_verify`)."""

    def __init__(
        self,
        service: DraftClient,
        request: ResolvedRequest,
        committed: list[int],
        new_session_id: Callable[[], str],
        in_background: Callable[[Callable[[], Awaitable]], None],
        retry_s: float = 2.0,
        owner: str = "",
    ):
        self.service, self.request, self.committed = service, request, committed
        self.new_session_id, self.in_background = new_session_id, in_background
        self.retry_s, self.owner = retry_s, owner
        self.uses_draft = request.uses_draft_service
        self.verify_ms = 0.0  # the recent rounds' verify calls, ms: the time a draft-ahead has (0: unknown)
        self.session_id: str | None = None  # None: no open session
        self.replica = ""  # the draft replica holding session_id
        self.used: list[str] = []  # the replicas its sessions opened on, in order
        self.seen = 0  # length of the committed prefix the session has seen
        self.retry_at = 0.0  # time.monotonic() before which the draft is not asked again
        self.failures = 0
        self._failure_counted = False  # the draft's failure that keeps these rounds without it is counted
        self._prefill: asyncio.Future | None = None  # the background prefill
        self._late = False  # the session's last Propose missed its deadline: its late answer is awaited
        self.num_cached_tokens: int | None = None  # found in the draft's prefix cache at the first Prefill
        self._ahead: DraftAhead | None = None  # the Propose drafting ahead, in flight or unread

    def opens_at_once(self, policy: KPolicy) -> bool:
        """Whether the session is prefilled alongside the target's: always under sampling (see
        :meth:`coordinator.speculation.rounds.RequestRounds.prefill`); under greedy decoding as
        ``policy`` decides (:meth:`KPolicy.opens_draft_at_prefill`: always for a fixed K)."""
        if not self.request.sampling.greedy:
            return True
        generated = len(self.committed) - len(self.request.prompt_ids)
        return policy.opens_draft_at_prefill(len(self.committed), self.request.max_new_tokens - generated)

    def available(self) -> bool:
        """Whether this round may ask the draft service: the session is open (prefilled) and the
        draft has not failed recently, for this request or (unreachable, late) its replica."""
        return self.session_id is not None and not self._late and not self._failed_recently(self.replica)

    def _failed_recently(self, replica: str | None = None) -> bool:
        """Whether this request's draft failed in the last ``retry_s``, or ``replica`` (without
        one: every replica) failed to answer in the draft service's ``down_s``."""
        return time.monotonic() < self.retry_at or self.service.down(replica)

    def open(self) -> None:
        """Starts the session's prefill in the background, unless the request uses no draft, the
        session is open or opening, or the draft failed recently; rounds go on without it. A
        session whose missed Propose got no late answer within ``retry_s`` is released first (what
        the draft made of that call is unknown)."""
        if self._late and not self._failed_recently():
            self._late = False
            self._release_open()
        closed = self.session_id is None and self._prefill is None
        if self.uses_draft and closed and not self._failed_recently():
            self._prefill = asyncio.ensure_future(self._open_or_fail())

    async def wait_for_prefill(self) -> None:
        """Waits for the background prefill, if any, at most as long as a Propose of its size may
        take (the Propose deadline for its forwards, :class:`coordinator.speculation.upstream.ProposeDeadline`):
        a draft that hangs costs a sampling request that deadline, not ``prefill_timeout_s``, and
        its rounds go on without the draft until the prefill finishes or fails. A wait that ends
        at the deadline counts as a draft failure (``RequestMetrics.num_draft_failures``): under
        sampling those rounds draw another exact sample than the same seed with the draft."""
        if not self.request.sampling.greedy:
            self.open()  # a draft down when the request opened may be back: its first round waits for it too
        if self._prefill is None:
            return
        forwards = math.ceil(len(self.committed) / TOKENS_PER_CATCH_UP_FORWARD)
        timeout = self.service.clients.propose_deadline.seconds(forwards)
        try:
            await asyncio.wait_for(asyncio.shield(self._prefill), timeout)
        except TimeoutError:
            self.failures += 1
            log.warning("draft session prefill not done within its %.2f s deadline; plain decode until it is", timeout)

    def check_prefill(self) -> tuple[int, float] | None:
        """Once the background prefill is done: raises what it found wrong with the request itself
        (INVALID_ARGUMENT, FAILED_PRECONDITION; other failures only defer the draft); returns,
        once, the tokens the draft prefilled (those its prefix cache did not hold) and the ms the
        Prefill took, when it opened the session (None otherwise)."""
        if self._prefill is not None and self._prefill.done():
            prefill, self._prefill = self._prefill, None
            return prefill.result()
        return None

    async def _open(self) -> tuple[int, float]:
        """Prefills a new session with the committed log; returns the tokens the draft computed and
        the Prefill's ms."""
        cache_salt = self.request.cache_salt
        session_id, order = self.new_session_id(), self.service.order(self.committed, cache_salt)
        if not order:
            raise Unavailable("no draft replica found")
        replica = order[0]  # a failure marks it down: the next try goes to another
        request = draft_pb2.DraftServicePrefillRequest(
            session_id=session_id,
            drafter=self.request.drafter,
            token_ids=self.committed,
            sampling=self.request.sampling.to_proto(),
            cache_salt=cache_salt,
            owner=self.owner,
        )
        seen, start = len(self.committed), time.perf_counter()  # rounds may commit more while the prefill runs
        placement = self.service.placement
        placement.opening(replica, self.committed[:seen], self.request.max_length, cache_salt)
        try:
            response = await self.service.prefill(replica, request)
        except BaseException as err:
            placement.closed(replica, self.request.max_length)
            if isinstance(err, asyncio.CancelledError | Unavailable):  # the replica may open the session all the same
                self._release(replica, session_id)
            raise
        if self.session_id is not None:  # replaces a session its replica lost
            placement.closed(self.replica, self.request.max_length)
        self.session_id, self.replica, self.seen = session_id, replica, seen
        self.used.append(replica)
        placement.opened(replica, response.num_cached_tokens)
        if self.num_cached_tokens is None:
            self.num_cached_tokens = response.num_cached_tokens
        return seen - response.num_cached_tokens, ms_since(start)

    async def _open_or_fail(self) -> tuple[int, float] | None:
        try:
            return await self._open()
        except SpecdecError as err:
            self._failed(err)
            return None

    def _failed(self, err: SpecdecError) -> None:
        """Goes on without the draft until ``retry_s`` has passed, or, when its replica did not
        answer and another one is up, only until the next round, which opens a session there (a
        draft pool: the session moves). Raises ``err`` when it says the request itself is wrong
        (INVALID_ARGUMENT, FAILED_PRECONDITION)."""
        if isinstance(err, InvalidArgument | FailedPrecondition):
            raise err
        self.failures += 1
        self._failure_counted = True
        self._late = isinstance(err, MissedDeadline) and self.session_id is not None
        moves = isinstance(err, Unavailable) and not self._late and not self.service.down()
        self.retry_at = time.monotonic() + (0.0 if moves else self.retry_s)  # another replica answers: at once
        log.warning(
            "draft session %s: %s; %s",
            self.session_id or "(opening)",
            err,
            f"plain decode until it answers late, or for {self.retry_s:g} s"
            if self._late
            else "opening it on another draft replica"
            if moves
            else f"plain decode until the draft is retried in {self.retry_s:g} s",
        )
        if not self._late:
            self._release_open()

    def _answered_late(self, session_id: str | None, seen: int) -> None:
        """A Propose of ``session_id`` that missed its deadline was answered: the draft holds the
        committed log's first ``seen`` tokens, and the session is used again."""
        if self._late and session_id == self.session_id:
            log.info("draft session %s answered late: drafting again", session_id)
            self._late, self.seen, self.retry_at = False, seen, 0.0

    async def proposal(self, k: int, round_number: int, start: float, max_k: int | None = None) -> DraftProposal:
        """Round ``round_number``'s proposal of up to ``k`` tokens (``start``: the round's
        time.perf_counter()): the one drafted ahead during the previous round when verification
        went down its branch, else one asked for now; none while the draft is unavailable (its
        opening is then started in the background). With draft-ahead on, the next round's
        Propose is sent before returning, unless the proposal fills ``max_k`` (the most draft
        tokens the request's token budget leaves this round, None: no limit): accepted whole, it
        ends the request, and the draft's work ahead would only compete with the next request's
        prefill where both share cores."""
        taken = await self._take_ahead(round_number)
        response = taken.response
        wait_ms = ms_since(start)  # the wait for the Propose drafting ahead
        if response is None and self.available():
            asked = time.perf_counter()
            response, request_bytes = await self._proposal(k)
            taken.wire_bytes += request_bytes
            if response is not None:
                taken.compute_ms = response.compute_ms
                taken.call_ms = max(0.0, ms_since(asked) - response.compute_ms)
            wait_ms += taken.compute_ms
        elif response is None:
            self._count_failure()
            self.open()  # this round is a plain one while the draft opens
        if response is not None:
            self._failure_counted = False
        if response is not None and response.token_ids and self.request.draft.drafts_ahead and self.available():
            proposed = list(response.token_ids[:k])
            if max_k is None or len(proposed) < max_k:
                self._send_ahead(proposed, k, round_number)
        taken.response, taken.wait_ms = response, wait_ms
        return taken

    def _count_failure(self) -> None:
        """Counts a draft failure (``RequestMetrics.num_draft_failures``) for a round that runs
        without the draft because the draft failed recently, for this request or (down: unreachable
        or late for another request) for every request, once for each stretch of such rounds: under
        sampling they draw another exact sample than the same seed with the draft, and a request
        that counts no failure must be reproducible by its seed (docs/faults.md)."""
        if self.uses_draft and self._failed_recently(self.replica or None) and not self._failure_counted:
            self.failures += 1
            self._failure_counted = True

    async def _proposal(self, k: int) -> tuple[draft_pb2.ProposeResponse | None, int]:
        """The draft's proposal and its bytes both ways; None when the draft service failed."""
        try:
            try:
                return await self._propose(k)
            except NotFound:
                log.warning("session %s lost on the draft service: prefilling it again", self.session_id)
                await self._open()
                return await self._propose(k)
        except SpecdecError as err:
            self._failed(err)
            return None, 0

    async def _propose(self, k: int) -> tuple[draft_pb2.ProposeResponse, int]:
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id,
            appended_token_ids=self.committed[self.seen :],
            num_speculative_tokens=k,
            num_branches=self.request.draft.branches,  # the draft keeps what branching the next draft-ahead needs
        )
        session_id, carried = self.session_id, len(self.committed)
        response = await self.service.propose(
            self.replica, request, on_late=lambda: self._answered_late(session_id, carried)
        )
        self.seen = carried
        return response, request.ByteSize() + response.ByteSize()

    def _send_ahead(self, predicted: list[int], k: int, round_number: int) -> None:
        """Sends the Propose of the branch after ``predicted`` (see :class:`DraftAhead`) and goes on
        without waiting for it."""
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id,
            appended_token_ids=self.committed[self.seen :],
            num_speculative_tokens=k,
            predicted_token_ids=predicted,
            num_branches=self.request.draft.branches,
            branch_budget_ms=self.verify_ms,
        )
        session_id, carried = self.session_id, len(self.committed)
        self.seen = carried
        task = asyncio.ensure_future(
            self.service.propose(self.replica, request, on_late=lambda: self._answered_late(session_id, carried))
        )
        ahead = DraftAhead(task, round_number, len(self.committed), predicted, request.ByteSize())
        task.add_done_callback(lambda _: setattr(ahead, "answered", time.perf_counter()))
        self._ahead = ahead

    async def _take_ahead(self, round_number: int) -> DraftProposal:
        """Waits for the draft-ahead Propose in flight, if any (no other draft call may overtake
        it: it carries committed tokens). Its proposal (``response``) when verification went down
        one of its branches (``branch``), else None; the outcome, HIT or MISS, or ``""`` when there
        was none or it is stale (a round in between did not use the draft); its other branches; its
        bytes both ways."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return DraftProposal()
        try:
            response = await ahead.task
        except NotFound:
            return DraftProposal()  # the next Propose finds the session gone and prefills it
        except SpecdecError as err:
            self._failed(err)
            return DraftProposal()
        wire_bytes, call_ms = ahead.request_bytes + response.ByteSize(), ahead.call_ms(response)
        if ahead.round != round_number - 1:
            return DraftProposal(wire_bytes=wire_bytes)
        hit = ahead.hit(self.committed, response)
        if hit is None:
            return DraftProposal(None, 0.0, MISS, wire_bytes, "", len(response.branches), ahead_call_ms=call_ms)
        return DraftProposal(hit[0], 0.0, HIT, wire_bytes, hit[1], len(response.branches), ahead_call_ms=call_ms)

    def observe_verify(self, ms: float) -> None:
        """Learns how long a round's verify call took (an EMA), the time the next draft-ahead's
        branches may take (``ProposeRequest.branch_budget_ms``)."""
        self.verify_ms = ms if not self.verify_ms else 0.7 * self.verify_ms + 0.3 * ms

    async def release(self) -> None:
        """Releases the session in the background; a prefill still running is cancelled and its
        session id released all the same (a cancelled Prefill may still open it), a Propose
        drafting ahead is cancelled."""
        if self._prefill is not None and not self._prefill.done():
            self._prefill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prefill
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SpecdecError):
                await ahead.task
        self._release_open()

    def release_left_behind(self, session_id: str) -> None:
        """Releases, in the background, a session another coordinator opened for this request, on
        every draft replica (it may be on any; Release of an id a replica lacks is a no-op)."""
        for replica in self.service.clients.draft_replicas.addresses:
            self._release(replica, session_id)

    def _release_open(self) -> None:
        if self.session_id is not None:
            self.service.placement.closed(self.replica, self.request.max_length)
            self._release(self.replica, self.session_id)
        self.session_id = None

    def _release(self, replica: str, session_id: str) -> None:
        self.in_background(lambda: self.service.release(replica, session_id))

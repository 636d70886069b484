"""The speculative round loop's state for one request: the committed token log and the sessions
on the draft service and on one verify replica.

Each round: the draft proposes K tokens (carrying the committed tokens it has not yet seen), the
verify service accepts n of them and returns the next token, and the committed log grows by
draft[:n] + [next]. K = 0, or an empty proposal, is a plain decode step on the verify service.
Under adaptive K a round's proposal may instead come from one of the coordinator's own lookups,
n-gram or suffix (:meth:`RequestRounds.lookup_matches`); the draft session then catches up at
its next Propose.

Draft-ahead (model drafters, ``draft_ahead``): while the verify service checks a round's
proposal, the draft service already drafts the next round's, on the branch where verification
accepts every proposed token and the bonus token is the draft's own most likely next token (as in
PEARL, Liu et al. 2025, and SSD, Kumar et al. 2025, with a single branch). When verification goes
down that branch (a hit) the next round's proposal is ready, and the draft's time hides behind the
verifier's; otherwise (a miss) the next round asks for a proposal as usual, and the draft rolls
back what it drafted ahead. Verification is unchanged, so output is too: under greedy decoding
and seeded sampling a pre-drafted proposal is the one a plain Propose would have drawn.

Faults. The committed log here is the truth; a service's session is a cache of it that can be
rebuilt by a Prefill of the log, under a new session id (so a late call to the old one cannot
collide; the old one is released in the background):
- the draft service fails (unreachable, its Propose deadline missed — see
  :class:`coordinator.upstream.ProposeDeadline` —, session limit, session lost twice): the
  round goes on as a plain decode step and later rounds run without the draft (plain decode, or
  the coordinator's n-gram and suffix lookups under adaptive K) until ``draft_retry_s`` has passed; then the
  draft session is prefilled again and speculation resumes when it answers;
- a verify call fails (the replica is unreachable or missed its deadline, or answers NOT_FOUND):
  the session is rebuilt on a replica and the call retried (:mod:`coordinator.failover`), until
  ``failover_timeout_s`` has passed; then the request fails with UNAVAILABLE.
A retried call is exact: Verify and Decode depend only on the committed log and the per-position
seed, so greedy and seeded sampling output is the same as without the fault.
"""

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coordinator.adaptive import AdaptiveK
from coordinator.failover import VerifyReplicas, VerifySession
from coordinator.metrics import HIT, MISS, PLAIN, RoundRecord
from coordinator.request import ResolvedRequest
from coordinator.upstream import TOKENS_PER_CATCH_UP_FORWARD, ServiceClients
from specdec.background import BackgroundTasks
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, SpecdecError, Unavailable
from specdec.ngram import NgramIndex, NgramMatch
from specdec.suffix import SuffixIndex, SuffixMatch
from specdec.timing import ms_since
from specdec.token_ids import point_masses
from specdec.v1 import common_pb2, draft_pb2

log = logging.getLogger(__name__)
RELEASE_RETRY_S = 1.0  # the pause before another try of a Release the service did not answer, seconds


@dataclass
class DraftAhead:
    """A Propose for the next round, sent with round ``round``'s Verify when the committed log held
    ``start`` tokens: its branch is every ``predicted`` token accepted, then the bonus token the
    draft guessed. ``task`` gives the ProposeResponse or raises SpecdecError."""

    task: asyncio.Future
    round: int
    start: int
    predicted: list[int]
    request_bytes: int

    def hit(self, committed: list[int], response: draft_pb2.ProposeResponse) -> bool:
        """Whether verification went down the branch (and the branch has a proposal)."""
        branch = [*self.predicted, response.predicted_bonus_token_id]
        return (
            bool(response.token_ids)
            and response.HasField("predicted_bonus_token_id")
            and committed[self.start :] == branch
        )


class RequestRounds:
    """One request's rounds: its committed log, its session on the draft service and its session
    on a verify replica (:class:`coordinator.failover.VerifySession`); :meth:`step` runs a round.

    Args: ``clients`` the coordinator's upstream clients, ``replicas`` its verify replicas (both
    shared by its requests); ``session_prefix`` begins the id of every session the request opens
    (``<prefix>.d1``, ``<prefix>.v2``, ...: a rebuilt session gets a new id); ``committed`` the
    request's committed log (prompt plus generated tokens, when a resumed request starts from
    stored ones); ``lookups``: the coordinator's own model-free lookups by name (hybrid drafting
    under adaptive K); ``draft_ahead``: draft the next round while this one verifies (a model
    drafter); ``draft_retry_s``, ``failover_timeout_s`` in seconds.
    Each round's record says whether its proposal was drafted ahead (``RoundRecord.draft_ahead``)."""

    def __init__(
        self,
        clients: ServiceClients,
        replicas: VerifyReplicas,
        session_prefix: str,
        request: ResolvedRequest,
        committed: list[int],
        lookups: dict[str, NgramIndex | SuffixIndex] | None = None,
        draft_retry_s: float = 2.0,
        failover_timeout_s: float = 60.0,
        draft_ahead: bool = False,
    ):
        self.clients = clients
        self.session_prefix = session_prefix
        self.request = request
        self.committed = committed
        self.uses_draft = request.uses_draft_service
        self.lookups = lookups or {}
        self.draft_retry_s = draft_retry_s
        self.draft_session: str | None = None  # None: no open draft session
        self.draft_seen = 0  # length of the committed prefix the draft session has seen
        self.draft_retry_at = 0.0  # time.monotonic() before which the draft is not asked again
        self.draft_failures = 0
        self.verify = VerifySession(
            replicas,
            committed,
            request.sampling,
            lambda: self._new_session_id("v"),
            self._in_background,
            failover_timeout_s,
        )
        self._generation = 0  # numbers the session ids of rebuilt sessions
        self._round_bytes = 0  # protobuf bytes of the current round's messages
        self._releases = BackgroundTasks()
        self._draft_prefill: asyncio.Future | None = None  # the draft's background prefill
        self.draft_ahead = draft_ahead and self.uses_draft
        self._ahead: DraftAhead | None = None  # the Propose drafting ahead, in flight or unread
        self.num_rounds = 0

    def _new_session_id(self, service: str) -> str:
        self._generation += 1
        return f"{self.session_prefix}.{service}{self._generation}"

    async def prefill(self, open_draft: bool = True) -> None:
        """Opens the session on a verify replica; raises UNAVAILABLE or RESOURCE_EXHAUSTED when no
        replica takes it. With ``open_draft`` the draft session (when the request uses one; a
        draft that fails here is only retried later) is prefilled alongside; without, it opens
        when a round first wants it (:meth:`open_draft`). Under greedy decoding the first tokens
        do not wait for it (a small draft prefills a long prompt slower than the target): rounds
        run without the draft until it is ready, which cannot change greedy output. Under sampling
        they wait (bounded, :meth:`_wait_for_draft_prefill`), because the sampled tokens depend on
        the proposals: a seed reproduces a completion only if the same rounds use the draft
        whatever the timing. Waits for a verify replica to answer up to ``failover_timeout_s``
        (the only one may be restarting)."""
        if open_draft:
            self.open_draft()
        await self.verify.open(time.monotonic() + self.verify.failover_timeout_s)
        if self._draft_prefill is not None and not self.request.sampling.greedy:
            await self._wait_for_draft_prefill()

    async def _wait_for_draft_prefill(self) -> None:
        """Waits for the draft's prefill at most as long as a Propose of its size may take (the
        Propose deadline for its forwards, :class:`coordinator.upstream.ProposeDeadline`): a draft
        that hangs costs a sampling request that deadline, not ``prefill_timeout_s``, and its
        rounds go on without the draft until the prefill finishes or fails."""
        assert self._draft_prefill is not None
        forwards = math.ceil(len(self.committed) / TOKENS_PER_CATCH_UP_FORWARD)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._draft_prefill), self.clients.propose_deadline.seconds(forwards))

    def _release_draft(self) -> None:
        """Releases the draft session in the background, if one is open."""
        if self.draft_session is not None:
            self._release_on_draft(self.draft_session)
        self.draft_session = None

    def _release_on_draft(self, session_id: str) -> None:
        self._in_background(lambda: self.clients.release_draft(session_id))

    # --- draft side ----------------------------------------------------------------------

    def _check_draft_prefill(self) -> None:
        """Once the background draft prefill is done: raises what it found wrong with the request
        itself (INVALID_ARGUMENT, FAILED_PRECONDITION; other failures only defer the draft)."""
        if self._draft_prefill is not None and self._draft_prefill.done():
            prefill, self._draft_prefill = self._draft_prefill, None
            prefill.result()

    def draft_available(self) -> bool:
        """Whether this round may ask the draft service: its session is open (prefilled) and the
        draft has not failed recently, for this request or (unreachable, late) for any."""
        return self.draft_session is not None and not self._draft_failed_recently()

    def _draft_failed_recently(self) -> bool:
        """Whether this request's draft calls failed in the last ``draft_retry_s``, or any draft
        call of the coordinator found the service unreachable or late (:meth:`ServiceClients.draft_down`)."""
        return time.monotonic() < self.draft_retry_at or self.clients.draft_down()

    def open_draft(self) -> None:
        """Starts the draft session's prefill in the background, unless the request uses no draft,
        the session is open or opening, or the draft failed recently; rounds go on without it."""
        closed = self.draft_session is None and self._draft_prefill is None
        if self.uses_draft and closed and not self._draft_failed_recently():
            self._draft_prefill = asyncio.ensure_future(self._open_draft_or_fail())

    async def _open_draft(self) -> None:
        session_id = self._new_session_id("d")
        request = draft_pb2.DraftServicePrefillRequest(
            session_id=session_id,
            drafter=self.request.drafter,
            token_ids=self.committed,
            sampling=self.request.sampling.to_proto(),
        )
        seen = len(self.committed)  # rounds may commit more while the prefill runs
        try:
            await self.clients.prefill_draft(request)
        except (asyncio.CancelledError, Unavailable):  # the draft service may open the session all the same
            self._release_on_draft(session_id)
            raise
        self.draft_session, self.draft_seen = session_id, seen

    async def _open_draft_or_fail(self) -> None:
        try:
            await self._open_draft()
        except SpecdecError as err:
            self._draft_failed(err)

    def _draft_failed(self, err: SpecdecError) -> None:
        """Goes on without the draft until ``draft_retry_s`` has passed. Raises ``err`` when it
        says the request itself is wrong (INVALID_ARGUMENT, FAILED_PRECONDITION)."""
        if isinstance(err, InvalidArgument | FailedPrecondition):
            raise err
        self.draft_failures += 1
        self.draft_retry_at = time.monotonic() + self.draft_retry_s
        log.warning(
            "sessions %s.*: %s; plain decode until the draft is retried in %g s",
            self.session_prefix,
            err,
            self.draft_retry_s,
        )
        self._release_draft()

    async def _proposal(self, k: int) -> draft_pb2.ProposeResponse | None:
        """The draft's proposal of up to ``k`` tokens; None when the draft service failed."""
        try:
            try:
                return await self._propose(k)
            except NotFound:
                log.warning("session %s lost on the draft service: prefilling it again", self.draft_session)
                await self._open_draft()
                return await self._propose(k)
        except SpecdecError as err:
            self._draft_failed(err)
            return None

    def _send_ahead(self, predicted: list[int], k: int) -> None:
        """Sends the Propose of the branch after ``predicted`` (see :class:`DraftAhead`) and goes on
        without waiting for it."""
        request = draft_pb2.ProposeRequest(
            session_id=self.draft_session,
            appended_token_ids=self.committed[self.draft_seen :],
            num_speculative_tokens=k,
            predicted_token_ids=predicted,
        )
        self.draft_seen = len(self.committed)
        task = asyncio.ensure_future(self.clients.propose(request))
        self._ahead = DraftAhead(task, self.num_rounds, len(self.committed), predicted, request.ByteSize())

    async def _take_ahead(self) -> tuple[draft_pb2.ProposeResponse | None, str]:
        """Waits for the draft-ahead Propose in flight, if any (no other draft call may overtake
        it: it carries committed tokens). Returns its proposal if verification went down its
        branch (else None) and the outcome, HIT or MISS, or ``""`` when there was none or it is
        stale (a round in between did not use the draft)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None, ""
        try:
            response = await ahead.task
        except NotFound:
            return None, ""  # the next Propose finds the session gone too, and prefills it again
        except SpecdecError as err:
            self._draft_failed(err)
            return None, ""
        self._round_bytes += ahead.request_bytes + response.ByteSize()
        if ahead.round != self.num_rounds - 1:
            return None, ""
        if ahead.hit(self.committed, response):
            return response, HIT
        return None, MISS

    async def _cancel_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SpecdecError):
                await ahead.task

    async def _propose(self, k: int) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(
            session_id=self.draft_session,
            appended_token_ids=self.committed[self.draft_seen :],
            num_speculative_tokens=k,
        )
        response = await self.clients.propose(request)
        self.draft_seen = len(self.committed)
        self._round_bytes += request.ByteSize() + response.ByteSize()
        return response

    # --- rounds --------------------------------------------------------------------------

    def lookup_matches(self, k: int) -> dict[str, NgramMatch | SuffixMatch]:
        """Each lookup's proposal of up to ``k`` tokens after the committed log, by lookup name
        (those without a match left out). Call it every round: the lookups index the tokens
        committed since the last call."""
        matches = {name: index.lookup(self.committed, k) for name, index in self.lookups.items()}
        return {name: match for name, match in matches.items() if match}

    async def step(self, policy: AdaptiveK | None, max_k: int) -> tuple[list[int], RoundRecord]:
        """Runs one round of at most ``max_k`` draft tokens (a round commits up to K + 1 tokens:
        never draft past the request's budget). Returns the newly committed tokens and the
        round's record. Read top to bottom, like gpt-fast's ``speculative_decode``:

        1. choose the proposer and K: fixed by the request, or by the adaptive ``policy`` among the
           draft model and the coordinator's lookups, from their acceptance estimates;
        2. propose: a lookup's match, or the draft service's proposal (drafted ahead during the
           previous round when verification went down its branch, else asked for now); none while
           the draft is unavailable, which makes the round a plain decode step;
        3. verify the proposal on the target (accepted tokens plus the bonus or recovered token),
           or decode one token when there is none;
        4. commit the new tokens to the log;
        5. let the policy learn from the outcome.
        """
        start, self._round_bytes = time.perf_counter(), 0
        self.num_rounds += 1
        self._check_draft_prefill()
        # 1. choose the proposer and K
        matches: dict[str, NgramMatch | SuffixMatch] = {}
        if policy is None:
            proposer, k = self.request.drafter, min(self.request.num_speculative_tokens, max_k)
        else:
            matches = self.lookup_matches(min(policy.k_max, max_k))
            if not self.draft_available() and policy.wants_drafter(matches):
                self.open_draft()
            proposer, k = policy.next_round(matches, self.draft_available())
            k = min(k, max_k)
        # 2. propose
        proposal, distributions, draft_ms, ahead = [], [], 0.0, ""
        if proposer in matches:
            proposal = matches[proposer].tokens[:k]
            distributions = [] if self.request.sampling.greedy else point_masses(proposal)
        elif k > 0:
            proposed, draft_ms, ahead = await self._draft_proposal(k, start)
            if proposed is None:  # the draft is unavailable: a plain decode round
                k = 0
            else:
                proposal, distributions = list(proposed.token_ids[:k]), proposed.distributions[:k]
        if k == 0:
            proposer = PLAIN
        # 3. verify, or decode one token
        n, new, verify_ms, step = await self._verify_or_decode(proposal, distributions)
        # 4. commit
        self.committed.extend(new)
        record = RoundRecord(
            proposer,
            k,
            len(proposal),
            n,
            draft_ms,
            verify_ms,
            ms_since(start),
            self._round_bytes,
            step.num_seqs,
            step.num_tokens,
            step.queue_ms,
            step.num_running_seqs,
            step.step_ms,
            ahead,
        )
        log.debug("sessions %s.* round: %s", self.session_prefix, record)
        # 5. learn
        if policy is not None:
            policy.observe(record, matches, new)
        return new, record

    async def _draft_proposal(self, k: int, start: float) -> tuple[draft_pb2.ProposeResponse | None, float, str]:
        """The draft service's proposal of up to ``k`` tokens, the ms the round waited for it, and
        the draft-ahead outcome (HIT, MISS or ``""``). None when the draft is unavailable or failed
        (its opening started in the background if it is not open). With draft-ahead on, the next
        round's Propose is sent before returning."""
        proposed, ahead = await self._take_ahead()
        draft_ms = ms_since(start)  # the wait for the Propose drafting ahead
        if proposed is None and self.draft_available():
            proposed = await self._proposal(k)
            draft_ms += proposed.compute_ms if proposed else 0.0
        elif proposed is None:
            self.open_draft()  # this round is a plain one while the draft opens
        if proposed is not None and proposed.token_ids and self.draft_ahead and self.draft_available():
            self._send_ahead(list(proposed.token_ids[:k]), k)
        return proposed, draft_ms, ahead

    async def _verify_or_decode(
        self, proposal: list[int], distributions
    ) -> tuple[int, list[int], float, common_pb2.StepStats]:
        """(accepted count n, the new tokens: proposal[:n] + the bonus or recovered token, the
        target's compute ms, the engine step's statistics)."""
        if proposal:
            verified, size = await self.verify.verify(proposal, distributions)
            self._round_bytes += size
            n = verified.num_accepted
            return n, [*proposal[:n], verified.next_token_id], verified.compute_ms, verified.step
        decoded, size = await self.verify.decode()
        self._round_bytes += size
        return 0, [decoded.token_id], decoded.compute_ms, decoded.step

    def open_sessions(self) -> dict[str, str]:
        """The ids of the sessions this request holds now, by service (``verify``, ``draft``)."""
        held = {"verify": self.verify.session_id, "draft": self.draft_session or ""}
        return {service: session_id for service, session_id in held.items() if session_id}

    def release_left_behind(self, sessions: dict[str, str]) -> None:
        """Releases, in the background, the sessions (by service, as :meth:`open_sessions` gives
        them) that another coordinator opened for this request before it died: the draft
        service's, and the verify session on every replica (the others hold no session by that id:
        Release is a no-op there). They would otherwise hold KV cache until the services' idle
        timeout."""
        if sessions.get("draft"):
            self._release_on_draft(sessions["draft"])
        if sessions.get("verify"):
            self.verify.release_everywhere(sessions["verify"])

    async def release(self) -> None:
        """Releases both sessions and waits for the background releases; failures are logged (the
        services' idle timeout reclaims what is left). A draft prefill still running is cancelled
        and its session id released all the same (a cancelled Prefill may still open it)."""
        if self._draft_prefill is not None and not self._draft_prefill.done():
            self._draft_prefill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._draft_prefill
        await self._cancel_ahead()
        self.verify.release()
        self._release_draft()
        await self._releases.wait()

    def _in_background(self, release: Callable[[], Awaitable]) -> None:
        """Runs a Release call (``release()`` makes it) without waiting for it. While the service
        does not answer (stopped, restarting) the call is repeated every RELEASE_RETRY_S for up to
        ``failover_timeout_s``, so a service that comes back frees the session at once; a failure
        after that is logged (the service's idle timeout reclaims the session, or it died with
        the service)."""

        async def retried():
            deadline = time.monotonic() + self.verify.failover_timeout_s
            while True:
                try:
                    await release()
                    return
                except Unavailable as err:
                    if time.monotonic() >= deadline:
                        log.info("sessions %s.*: a release failed: %s", self.session_prefix, err)
                        return
                except SpecdecError as err:
                    log.info("sessions %s.*: a release failed: %s", self.session_prefix, err)
                    return
                await asyncio.sleep(RELEASE_RETRY_S)

        self._releases.run(retried())

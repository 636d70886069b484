"""The coordinator's client of the verify service, as :mod:`coordinator.speculation.draft_client`
is of the draft service: a request's session on the verify service (:class:`VerifySession`: its
Verify and Decode calls, decode ahead) lives on one replica at a time, and fails over: it is
rebuilt on another from the coordinator's committed log when its replica fails, loses it, or is
gone from discovery.

:class:`VerifyClient`, one per coordinator, keeps which replicas failed recently and the order
to try them in: placement's (:mod:`coordinator.speculation.placement`: prefix affinity and load),
those that failed in the last ``down_s`` last. A call that finds its replica unreachable, past its
deadline, or without the session (NOT_FOUND: restarted, evicted as idle, preempted) marks the
replica down, releases the old session in the background, prefills the committed log on a replica
(in that order) under a new session id (so a late call to the old one cannot collide), and
retries the call; passes over the replicas repeat every RETRY_INTERVAL_S until
``failover_timeout_s`` has passed, and the request then fails with UNAVAILABLE. A retried call is
exact: Verify and Decode depend only on the committed log and the per-position seed. A Decode
sent ahead (:meth:`VerifySession.decode_ahead`) does not fail over: the round that takes it
decodes again, failing over, when it failed or went to a session rebuilt since.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.speculation.upstream import ServiceClients
from specdec.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted, SpecdecError, Unavailable
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import common_pb2, verify_pb2

log = logging.getLogger(__name__)
RETRY_INTERVAL_S = 0.25  # between passes over the verify replicas while none can take the session


class VerifyClient:
    """The verify replicas of ``clients`` as every request of a coordinator sees them: a replica
    that failed a call is tried last for ``down_s`` seconds. Replicas are named by their
    ``host:port``."""

    def __init__(self, clients: ServiceClients, down_s: float = 5.0):
        self.clients, self.down_s = clients, down_s
        self.placement = clients.placements["verify"]
        self._down_until: dict[str, float] = {}

    def order(self, prompt: Sequence[int] = (), cache_salt: str = "") -> list[str]:
        """Every verify replica discovery finds, in the order to try them for a session over
        ``prompt`` of ``cache_salt`` (placement's choice first), those that failed in the last
        ``down_s`` seconds last."""
        now = time.monotonic()
        replicas = self.clients.verify_replicas.addresses
        down = [r for r in replicas if self._down_until.get(r, 0.0) > now]
        return self.placement.rank(replicas, prompt, down, cache_salt)

    def mark_down(self, replica: str) -> None:
        """Records that a verify replica failed a call."""
        self._down_until[replica] = time.monotonic() + self.down_s

    def none_found(self) -> Unavailable:
        return Unavailable(f"no verify replica found at {', '.join(self.clients.verify_replicas.discovery.given)}")

    async def info(self, deadline: float | None = None) -> verify_pb2.VerifyServiceGetInfoResponse:
        """GetInfo of the first replica that answers, passing over the replicas every
        RETRY_INTERVAL_S until ``deadline`` (time.monotonic(); None: one pass). Raises the last
        replica's error when none answered by then (UNAVAILABLE when discovery finds none)."""
        error: SpecdecError = self.none_found()
        while True:
            now = time.monotonic()  # not placement's order: a GetInfo places nothing
            replicas = self.clients.verify_replicas.addresses
            for replica in sorted(replicas, key=lambda r: self._down_until.get(r, 0.0) > now):
                try:
                    return await self.clients.verify_info(replica)
                except SpecdecError as err:  # another replica may answer
                    error = err
                    self.mark_down(replica)
            if deadline is None or time.monotonic() >= deadline:
                raise error
            await asyncio.sleep(RETRY_INTERVAL_S)


class Admit(Protocol):
    """Runs a verify session's opening (``attempt``, the function that makes the call) once it is
    let in: the coordinator's fair queue (:meth:`coordinator.api.admission.FairQueue.run`, bound to
    the request's client). ``rebuild_deadline`` (time.monotonic()): the opening rebuilds a running
    request's session, which waits until then."""

    def __call__(
        self,
        attempt: Callable[[], Awaitable[verify_pb2.VerifyServicePrefillResponse]],
        *,
        rebuild_deadline: float | None = None,
    ) -> Awaitable[verify_pb2.VerifyServicePrefillResponse]: ...


@dataclass(frozen=True)
class DecodeAhead:
    """A Decode sent before the last call's answer (:meth:`VerifySession.decode_ahead`): the
    session it went to, the request and the task awaiting its answer."""

    session_id: str
    request: verify_pb2.DecodeRequest
    task: "asyncio.Future[verify_pb2.DecodeResponse]"


class VerifySession:
    """A request's session on the verify service: its id and the replica holding it (one of
    ``replicas``). ``committed``: the request's committed log (read at every rebuild); ``new_session_id()``
    names each new session; ``in_background`` runs a Release (a function that makes the call)
    without waiting for it; ``max_length``: the most tokens its session may hold (the prompt's and
    the most the request may generate, placement's weight for it); ``cache_salt``: the partition of
    the replicas' prefix caches its sessions use (:func:`coordinator.api.cache_salt.cache_salt`);
    ``owner``: the tag of the request's client its sessions carry
    (VerifyServicePrefillRequest.owner). ``admit``: how a rebuild waits for room (the
    coordinator's fair queue, set with the request's first Prefill; None: it retries every
    RETRY_INTERVAL_S)."""

    def __init__(
        self,
        replicas: VerifyClient,
        committed: list[int],
        sampling: SamplingParams,
        new_session_id: Callable[[], str],
        in_background: Callable,
        failover_timeout_s: float,
        max_length: int,
        cache_salt: str = "",
        owner: str = "",
    ):
        self.replicas, self.clients = replicas, replicas.clients
        self.max_length = max_length
        self.cache_salt = cache_salt
        self.committed, self.sampling, self.owner = committed, sampling, owner
        self.admit: Admit | None = None
        self.new_session_id, self.in_background = new_session_id, in_background
        self.failover_timeout_s = failover_timeout_s
        self.replica = ""  # the verify replica holding session_id (its host:port)
        self.session_id = ""  # empty: not opened yet
        self.rebuilds = 0
        self.num_cached_tokens = 0  # found in the replica's prefix cache at the first Prefill
        self.used: list[str] = []  # the replicas the request's sessions opened on, in order

    async def open(
        self, deadline: float, wait_while_full: bool = False, decode: bool = False
    ) -> verify_pb2.VerifyServicePrefillResponse:
        """Prefills the committed log on a replica, the healthy ones first, passing over the
        replicas every RETRY_INTERVAL_S until ``deadline`` (time.monotonic()). A pass on which every
        replica refused for being full (or, FAILED_PRECONDITION, for a KV budget that can never hold
        the context) ends the wait unless ``wait_while_full`` (a rebuild mid-request waits for room;
        a new request is told to back off, and waits in the coordinator's fair queue). ``decode``: the
        replica also decodes the token after the log (the response's ``next_token_id``, committed on the
        session but not yet in ``committed``: the caller appends it). Raises the last replica's
        UNAVAILABLE or RESOURCE_EXHAUSTED when none takes it. A Prefill that failed unanswered
        (unreachable, late) or was cancelled has its session id released: the replica may still
        open it."""
        session_id = self.new_session_id()
        request = verify_pb2.VerifyServicePrefillRequest(
            session_id=session_id,
            token_ids=self.committed,
            sampling=self.sampling.to_proto(),
            decode=decode,
            cache_salt=self.cache_salt,
            owner=self.owner,
        )
        error: SpecdecError = self.replicas.none_found()
        placement = self.replicas.placement
        while True:
            unreachable = not self.clients.verify_replicas.addresses  # none found yet: discovery may find some
            for replica in self.replicas.order(self.committed, self.cache_salt):
                placement.opening(replica, self.committed, self.max_length, self.cache_salt)
                try:
                    response = await self.clients.prefill_verify(replica, request)
                except (ResourceExhausted, FailedPrecondition) as err:  # full now; or its KV budget too small ever
                    placement.closed(replica, self.max_length)
                    error = err
                    continue
                except Unavailable as err:
                    placement.closed(replica, self.max_length)
                    self.replicas.mark_down(replica)
                    self._release(replica, session_id)
                    error, unreachable = err, True
                    continue
                except asyncio.CancelledError:
                    placement.closed(replica, self.max_length)
                    self._release(replica, session_id)
                    raise
                if not self.used:  # the first Prefill, not a rebuild
                    self.num_cached_tokens = response.num_cached_tokens
                self.replica, self.session_id = replica, session_id
                self.used.append(replica)
                placement.opened(replica, response.num_cached_tokens)
                return response
            if time.monotonic() >= deadline or not (unreachable or wait_while_full):
                raise error
            await asyncio.sleep(RETRY_INTERVAL_S)

    async def verify(
        self, proposal: list[int], distributions: list[common_pb2.TokenDistribution]
    ) -> tuple[verify_pb2.VerifyResponse, int]:
        """Verifies ``proposal`` (draft ids, with their draft distributions under sampling),
        failing over as the module docstring says. Returns the response and the protobuf bytes
        both ways."""

        def send(replica: str, session_id: str):
            request = verify_pb2.VerifyRequest(
                session_id=session_id, draft_token_ids=proposal, draft_distributions=distributions
            )
            return request, self.clients.verify(replica, request)

        return await self._call(send)

    async def decode(self) -> tuple[verify_pb2.DecodeResponse, int]:
        """One plain decode step after the committed log, failing over as :meth:`verify`; the
        response and its bytes. The Decode names the log's length
        (``DecodeRequest.num_committed_tokens``): a session that committed more (a Decode sent
        ahead that the coordinator gave up on, answered late) fails it with FAILED_PRECONDITION,
        and is rebuilt from the log like a lost one, never decoded after tokens the log lacks."""

        def send(replica: str, session_id: str):
            request = verify_pb2.DecodeRequest(session_id=session_id, num_committed_tokens=len(self.committed))
            return request, self.clients.decode(replica, request)

        return await self._call(send, FailedPrecondition)

    def decode_ahead(self) -> DecodeAhead:
        """Sends a Decode on the session as it is now, without waiting for the one in flight (it
        follows that one's token: ``num_committed_tokens`` the log's length plus 1) and without
        failover (the round that takes its answer, :meth:`take`, fails over)."""
        session_id, replica = self.session_id, self.replica
        request = verify_pb2.DecodeRequest(session_id=session_id, num_committed_tokens=len(self.committed) + 1)
        task = asyncio.ensure_future(self.clients.decode(replica, request))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # taken, or dropped
        return DecodeAhead(session_id, request, task)

    def usable(self, ahead: DecodeAhead) -> bool:
        """Whether a Decode sent ahead may still answer for the session: sent on it as it is now
        (not rebuilt since), and not known to have failed."""
        task = ahead.task
        failed = task.done() and (task.cancelled() or task.exception() is not None)
        return ahead.session_id == self.session_id and not failed

    async def take(self, ahead: DecodeAhead) -> tuple[verify_pb2.DecodeResponse, int]:
        """The answer to a Decode sent ahead that was :meth:`usable` when its round began, as
        :meth:`decode` returns it; when it fails, a Decode of its own (failing over)."""
        try:
            response = await ahead.task
        except SpecdecError as err:
            log.info("verify session %s: a Decode sent ahead failed (%s); decoding again", ahead.session_id, err)
            return await self.decode()
        return response, ahead.request.ByteSize() + response.ByteSize()

    async def _call(self, send: Callable[[str, str], tuple], *rebuild_on: type[SpecdecError]) -> tuple:
        """``send(replica, session_id)`` gives a request and the awaitable of its call; retried on a
        rebuilt session until ``failover_timeout_s`` after UNAVAILABLE, NOT_FOUND or the errors
        ``rebuild_on`` names."""
        deadline = None
        rebuilt: tuple[type[SpecdecError], ...] = (Unavailable, NotFound, *rebuild_on)
        while True:
            try:
                request, call = send(self.replica, self.session_id)
                response = await call
                return response, request.ByteSize() + response.ByteSize()
            except rebuilt as err:
                log.warning("verify session %s: %s; rebuilding it from the committed log", self.session_id, err)
                if isinstance(err, Unavailable):
                    self.replicas.mark_down(self.replica)
                self.release()
                deadline = deadline or time.monotonic() + self.failover_timeout_s
                await self._rebuild(deadline)
                self.rebuilds += 1

    async def _rebuild(self, deadline: float) -> None:
        """Prefills the committed log again on a replica by ``deadline`` (time.monotonic()), waiting
        its turn in ``admit`` (the fair queue, as the request's client) while every replica is full,
        as a new request does."""
        if self.admit is None:
            await self.open(deadline, wait_while_full=True)
        else:
            await self.admit(lambda: self.open(deadline), rebuild_deadline=deadline)

    def release(self) -> None:
        """Releases the session in the background (nothing when none is open)."""
        if self.session_id:
            self.replicas.placement.closed(self.replica, self.max_length)
            self._release(self.replica, self.session_id)
            self.session_id = ""

    def release_everywhere(self, session_id: str) -> None:
        """Releases ``session_id`` on every replica in the background: a session another
        coordinator left behind may be on any (Release of an id a replica lacks is a no-op)."""
        for replica in self.clients.verify_replicas.addresses:
            self._release(replica, session_id)

    def _release(self, replica: str, session_id: str) -> None:
        self.in_background(lambda: self.clients.release_verify(replica, session_id))

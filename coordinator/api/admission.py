"""Admission of requests to the coordinator: how many one client may run, and who goes first when
the verify service is full. Both APIs (gRPC Generate and the HTTP API) admit through here.

- :class:`ClientLimit`: a client (its API key's owner hash when the coordinator has keys, else its
  IP address) runs at most ``max_streams_per_client`` requests at once on every coordinator
  replica together, each choice of a request with n > 1 counted. Running requests hold leases in
  the request store (:meth:`coordinator.request_store.store.RequestStore.acquire_leases`), renewed
  while they run, so a coordinator that dies gives its clients' share back within a lease's life.
  While the store cannot be reached each coordinator counts its own, up to its share of the limit:
  ``max_streams_per_client // max_coordinator_replicas``, so that the replicas together stay within
  it (the leases' scripts run on a full Redis too, so a full store does not come to this).
- :class:`FairQueue`: a request every verify replica refused for being full (RESOURCE_EXHAUSTED at
  its first Prefill) waits at the coordinator, with the others so refused, instead of failing;
  the waiting requests retry in round-robin order across clients (deficit round-robin with a
  quantum of one request, as Shreedhar & Varghese 1995 with equal packets), one at a time, when
  room may have appeared: a request ended here, or ``retry_s`` passed (another coordinator's
  request may have ended); a client whose try is refused goes last and the next one tries at
  once, each client once per such moment (the verify service keeps room for the client holding
  fewer sessions, :mod:`specdec.rpc.sessions`, which may be the next one here). While anyone
  waits, new requests queue behind them rather than take the room first. Bounded in length
  (``max_queued_requests``) and in wait (``queue_timeout_s``).
  A running request whose verify session must be rebuilt (its replica lost it: preempted,
  restarted) waits here too, as one of its client's, ahead of that client's new requests, until its
  ``failover_timeout_s`` (running requests bound how many, so the length bound leaves it out).
- :func:`owner_tag`: what a client's sessions carry to the draft and verify services, which admit
  them fairly by it and, under KV pressure, preempt the owner holding the most KV first.

Beyond either bound a request gets :class:`Overloaded` (RESOURCE_EXHAUSTED, HTTP 429 with
``Retry-After``), its message naming the setting.
"""

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import Gauge, Histogram

from coordinator.request_store.store import RequestStore, StoreUnavailable
from specdec.rpc.errors import ResourceExhausted

log = logging.getLogger(__name__)
T = TypeVar("T")

LEASE_TTL_S = 30.0  # a running request's lease in the request store lives this long unless renewed, seconds
# A Prefill that the verify service refuses for being full comes back at once (its session count or
# KV budget checked before any work); one still running after this long was taken, and the next
# waiting request may try, seconds.
REFUSAL_WINDOW_S = 0.05


def owner_tag(client: str) -> str:
    """The opaque tag of ``client`` (``key <owner hash>`` or ``host <address>``) that its sessions
    carry to the draft and verify services (their Prefill's ``owner``): 16 hex digits of its SHA-256,
    so the services learn neither the owner hash nor the address."""
    return hashlib.sha256(client.encode()).hexdigest()[:16]


class Overloaded(ResourceExhausted):
    """RESOURCE_EXHAUSTED with a hint of when to try again: ``retry_after_s`` seconds (HTTP
    ``Retry-After``, gRPC ``retry-after`` trailing metadata)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """Whole seconds, at least 1, as HTTP's Retry-After wants them."""
        return str(max(1, math.ceil(self.retry_after_s)))


class ClientLimit:
    """At most ``max_per_client`` running requests per client (0: no limit) on every coordinator
    sharing ``store``, of which at most ``replicas`` run at once. One event loop uses it: no lock."""

    def __init__(self, store: RequestStore, max_per_client: int, replicas: int = 1, lease_ttl_s: float = LEASE_TTL_S):
        self.store, self.max_per_client, self.lease_ttl_s = store, max_per_client, lease_ttl_s
        self.share = max_per_client // replicas  # this coordinator's, while the store cannot be reached
        self.replicas = replicas
        self._leases: dict[str, set[str]] = collections.defaultdict(set)  # client -> lease ids held here
        self._renewing: asyncio.Task | None = None

    @property
    def num_running(self) -> int:
        """Requests (choices) this coordinator runs under the limit."""
        return sum(map(len, self._leases.values()))

    async def run(
        self, client: str, responses: AsyncGenerator[T, None], num_requests: int = 1
    ) -> AsyncGenerator[T, None]:
        """``responses`` counted as ``num_requests`` of ``client``'s running requests until it ends
        or is closed (closing this closes ``responses``). Raises Overloaded at the first step when
        they would take the client past the limit."""
        leases = [uuid.uuid4().hex for _ in range(num_requests)]
        try:
            await self._acquire(client, leases)
            try:
                async for response in responses:
                    yield response
            finally:
                await self._release(client, leases)
        finally:
            await responses.aclose()

    async def _acquire(self, client: str, leases: list[str]) -> None:
        if not self.max_per_client:
            return
        held_here = len(self._leases[client])
        try:
            running = await self.store.acquire_leases(client, leases, self.max_per_client, self.lease_ttl_s)
        except StoreUnavailable:  # the store is down: this coordinator's own count, within its share
            if held_here + len(leases) > self.share:
                self._drop_if_empty(client)
                raise Overloaded(
                    f"the request store cannot be reached, and this client already runs {held_here} requests here and "
                    f"asks for {len(leases)} more; meanwhile each of up to {self.replicas} coordinators "
                    f"(max_coordinator_replicas) admits max_streams_per_client / {self.replicas} = {self.share} of a "
                    "client's requests: wait for one to finish, ask for fewer choices (n), or retry when the store "
                    "is back",
                    retry_after_s=1.0,
                ) from None
            running = None
        if running is not None:
            self._drop_if_empty(client)
            raise Overloaded(
                f"this client already runs {running} requests and asks for {len(leases)} more; the limit per "
                f"client (max_streams_per_client, over every coordinator) is {self.max_per_client}: wait for one "
                "to finish, ask for fewer choices (n), or raise --max-streams-per-client",
                retry_after_s=1.0,
            )
        self._leases[client].update(leases)
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.ensure_future(self._renew())

    def _drop_if_empty(self, client: str) -> None:
        if not self._leases[client]:
            del self._leases[client]

    async def _release(self, client: str, leases: list[str]) -> None:
        if not self.max_per_client:
            return
        self._leases[client].difference_update(leases)
        if not self._leases[client]:
            del self._leases[client]
        with contextlib.suppress(StoreUnavailable):  # the leases then expire
            await self.store.release_leases(client, leases)

    async def _renew(self) -> None:
        """Renews the leases held here every third of their life, while there are any."""
        while self._leases:
            await asyncio.sleep(self.lease_ttl_s / 3)
            with contextlib.suppress(StoreUnavailable):
                await self.store.renew_leases({c: sorted(ls) for c, ls in self._leases.items()}, self.lease_ttl_s)

    def close(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()


@dataclass(eq=False)
class _Waiter:
    client: str
    deadline: float  # time.monotonic(): it gets Overloaded then
    rebuild: bool = False  # a running request's session rebuilt, not a new request
    since: float = field(default_factory=time.monotonic)
    turn: asyncio.Event = field(default_factory=asyncio.Event)  # set: this waiter may try now


class FairQueue:
    """Requests waiting for room on the verify service (see the module docstring); ``waiting``
    and ``wait_time`` (Prometheus: a Gauge and a Histogram in seconds) export its length and
    waits. One event loop uses it: no lock."""

    def __init__(self, max_queued: int, timeout_s: float, waiting: Gauge, wait_time: Histogram, retry_s: float = 0.25):
        self.max_queued, self.timeout_s, self.retry_s = max_queued, timeout_s, retry_s
        self.waiting, self.wait_time = waiting, wait_time
        self._queues: collections.OrderedDict[str, collections.deque[_Waiter]] = collections.OrderedDict()
        self._tries_left = 0  # clients that may still try, one after another, since room may have appeared
        self._ticking: asyncio.Task | None = None

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    async def run(
        self, client: str, attempt: Callable[[], Awaitable[T]], *, rebuild_deadline: float | None = None
    ) -> T:
        """``await attempt()`` (a new request's first Prefill), at once when nobody waits; while it
        raises ResourceExhausted (every verify replica full), or while others wait, ``client``'s
        request waits its turn and tries again. Raises Overloaded when the queue is full or the
        wait passes ``timeout_s``, and what ``attempt`` raises otherwise. With ``rebuild_deadline``
        (time.monotonic()) ``attempt`` rebuilds a running request's session: it waits ahead of its
        client's new requests, whatever the queue's length, until that deadline."""
        rebuild = rebuild_deadline is not None
        if not self._queues:
            try:
                return await attempt()
            except ResourceExhausted:
                if not (self.max_queued or rebuild):
                    raise
        waiter = self._enqueue(client, rebuild_deadline=rebuild_deadline)
        try:
            return await self._take_turns(waiter, attempt)
        finally:
            self._remove(waiter)

    async def _take_turns(self, waiter: _Waiter, attempt: Callable[[], Awaitable[T]]) -> T:
        while True:
            await self._turn(waiter)
            task = asyncio.ensure_future(attempt())
            try:
                await asyncio.wait({task}, timeout=REFUSAL_WINDOW_S)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if task.done() and isinstance(task.exception(), ResourceExhausted):
                self._refused(waiter)
                continue
            self._served(waiter)
            try:
                return await task
            except ResourceExhausted:  # refused after the window: back to the head of its client's queue
                self._enqueue(waiter.client, waiter)

    async def _turn(self, waiter: _Waiter) -> None:
        """Waits until ``waiter`` is at the head of the round-robin and room may have appeared."""
        waiter.turn.clear()
        self._tick_while_waiting()
        try:
            await asyncio.wait_for(waiter.turn.wait(), max(0.0, waiter.deadline - time.monotonic()))
        except TimeoutError:
            waited = time.monotonic() - waiter.since
            if waiter.rebuild:
                message = (
                    f"every verify replica stayed full for {waited:.0f} s while this request's lost session waited "
                    "its turn to be rebuilt (failover_timeout_s): retry later, or add verify replicas"
                )
            else:
                message = (
                    f"every verify replica stayed full for {self.timeout_s:g} s while this request waited its turn "
                    f"(queue_timeout_s): retry later, or add verify replicas"
                )
            raise Overloaded(message, retry_after_s=self.retry_s * max(1, len(self))) from None

    def _enqueue(self, client: str, waiter: _Waiter | None = None, rebuild_deadline: float | None = None) -> _Waiter:
        """Queues a new waiter at the back of ``client``'s queue (a rebuild: at its front), or
        ``waiter`` again at its front."""
        queue = self._queues.setdefault(client, collections.deque())
        if waiter is None and rebuild_deadline is not None:
            waiter = _Waiter(client, rebuild_deadline, rebuild=True)
        elif waiter is None:
            if len(self) >= self.max_queued:
                if not queue:
                    del self._queues[client]
                raise Overloaded(
                    f"{len(self)} requests already wait for room on the verify service, the coordinator's limit "
                    "(max_queued_requests): retry later, or raise --max-queued-requests",
                    retry_after_s=self.retry_s * max(1, len(self)),
                )
            waiter = _Waiter(client, time.monotonic() + self.timeout_s)
            queue.append(waiter)
            self.waiting.set(len(self))
            return waiter
        queue.appendleft(waiter)
        self.waiting.set(len(self))
        return waiter

    def _served(self, waiter: _Waiter) -> None:
        """``waiter`` got in: it leaves, its client goes last in the round-robin, and the next one
        may try at once (there may be more room)."""
        self._remove(waiter)
        self.wait_time.observe(time.monotonic() - waiter.since)
        if waiter.client in self._queues:
            self._queues.move_to_end(waiter.client)
        self.room()

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.client]
            self.waiting.set(len(self))

    def _refused(self, waiter: _Waiter) -> None:
        """``waiter``'s try was refused: its client goes last in the round-robin and, until each
        waiting client has tried once since room may have appeared, the next one tries at once (the
        verify service may keep the room for a client holding fewer sessions than this one)."""
        if waiter.client in self._queues:
            self._queues.move_to_end(waiter.client)
        self._tries_left -= 1
        if self._tries_left > 0:
            next(iter(self._queues.values()))[0].turn.set()

    def room(self) -> None:
        """Room may have appeared on the verify service: the request at the head of the
        round-robin tries again (and, refused, the next client's: :meth:`_refused`)."""
        if self._queues:
            self._tries_left = len(self._queues)
            next(iter(self._queues.values()))[0].turn.set()

    def _tick_while_waiting(self) -> None:
        if self._ticking is None or self._ticking.done():
            self._ticking = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        """Room elsewhere (another coordinator's request ended) is not announced here: while
        anyone waits, the head tries again every ``retry_s``."""
        while self._queues:
            await asyncio.sleep(self.retry_s)
            self.room()

    def close(self) -> None:
        if self._ticking is not None:
            self._ticking.cancel()

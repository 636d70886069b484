"""The coordinator's gRPC clients of its upstream services, every replica of the draft service and
of the verify service, with deadlines on every call; over TLS (mutual TLS with a client
certificate) when given credentials (:func:`specdec.rpc.tls.reloading_channel_credentials`). The
public client of the coordinator itself is :mod:`coordinator.api.client`.

Each service is a :class:`ReplicaSet`: the addresses discovery finds for its targets
(:mod:`coordinator.speculation.discovery`), one :class:`Replica` each (one channel, one
connection, one Step stream), followed as they come and go. Which replica a session opens on is
:mod:`coordinator.speculation.placement`'s choice, fed from here with every replica's load
reports and round trips; whether to go on asking one that failed is
:mod:`coordinator.speculation.draft_client`'s and :mod:`coordinator.speculation.verify_client`'s concern.
"""

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Literal

import grpc

from coordinator.speculation.discovery import Address, Discovery
from coordinator.speculation.placement import Placement
from specdec.rpc.errors import Unavailable, from_rpc_error
from specdec.rpc.server import MAX_MESSAGE_BYTES, grpc_options
from specdec.rpc.step_client import StepStream
from specdec.rpc.tls import Reloading
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

log = logging.getLogger(__name__)

# A restarted service is reconnected to within a second (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
TLS_CHECK_INTERVAL_S = 1.0  # how often the client certificate files are looked at, seconds
# Tokens one draft forward takes in about the time of a one-token decode forward (appending and
# predicting first, before the K forwards of a Propose; docs/faults.md#a-draft-that-hangs).
TOKENS_PER_CATCH_UP_FORWARD = 16
RELEASE_TIMEOUT_S = 1.0  # a Release's deadline (callers retry one the service did not answer)
REFRESH_AFTER_FAILURE_S = 1.0  # the soonest discovery runs again after a replica failed, seconds
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name
Service = Literal["draft", "verify"]


class ProposeDeadline:
    """The deadline of a Propose call that costs ``num_forwards`` draft forwards
    (:meth:`forwards`), seconds: ``factor`` times the slowest of the last ``window`` Propose calls
    that succeeded, each scaled linearly to ``num_forwards`` (so a long catch-up after rounds
    without the draft neither misses its deadline nor stretches the next short call's); at least
    ``floor_s``, at most ``ceiling_s``, and ``10 * floor_s`` (capped) until a Propose has been
    measured. Round trips are measured as the
    coordinator sees them, the draft service's queue included, so the deadline grows with load;
    calls that missed it and were answered late count too (:meth:`ServiceClients.propose`), so a
    burst that slows the draft at once raises it within a few calls, not failing every call while
    the load lasts. A draft that stops answering (no late answer) then costs a round this
    deadline instead of the RPC deadline (docs/faults.md#a-draft-that-hangs)."""

    def __init__(self, floor_s: float, factor: float, ceiling_s: float, window: int = 64):
        self.floor_s, self.factor, self.ceiling_s = floor_s, factor, ceiling_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)

    def seconds(self, num_forwards: int) -> float:
        if self._recent:
            estimate = self.factor * max(s * num_forwards / max(n, 1) for s, n in self._recent)
        else:
            estimate = 10 * self.floor_s
        return min(max(estimate, self.floor_s), self.ceiling_s)

    def observe(self, seconds: float, num_forwards: int) -> None:
        """Records a successful Propose: its round trip in seconds and its :meth:`forwards`."""
        self._recent.append((seconds, num_forwards))

    @staticmethod
    def forwards(request: draft_pb2.ProposeRequest) -> int:
        """The draft forwards a Propose costs, counted in one-token decode forwards: the K that
        draft one token each, after one per TOKENS_PER_CATCH_UP_FORWARD tokens it first appends
        (committed, not yet seen) and predicts (draft-ahead) in chunks."""
        catch_up = len(request.appended_token_ids) + len(request.predicted_token_ids)
        return request.num_speculative_tokens + math.ceil(catch_up / TOKENS_PER_CATCH_UP_FORWARD)


def _channel(address: Address, credentials: grpc.ChannelCredentials | None, options: list) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address.address, options=options)
    if address.name:  # an address found under a name: its certificate names the name, not the pod's IP
        options = [*options, ("grpc.ssl_target_name_override", address.name)]
    return grpc.aio.secure_channel(address.address, credentials, options=options)


class Replica:
    """One replica of the draft or the verify service: one channel (one HTTP/2 connection), its
    stub and its Step stream. ``on_load(load)``: called with the load report of every Step
    stream message."""

    def __init__(
        self,
        service: Service,
        address: Address,
        credentials: grpc.ChannelCredentials | None,
        options: list,
        on_load: Callable[[common_pb2.ServiceLoad], None],
    ):
        self.found, self.address = address, address.address
        self.where = f"{service} service at {address.address}" + (f" ({address.name})" if address.name else "")
        self.channel = _channel(address, credentials, options)
        if service == "draft":
            self.stub: draft_pb2_grpc.DraftServiceStub | verify_pb2_grpc.VerifyServiceStub = (
                draft_pb2_grpc.DraftServiceStub(self.channel)
            )
            kinds: tuple = (draft_pb2.DraftStepRequest, draft_pb2.DraftCall, DRAFT_SERVICE)
        else:
            self.stub = verify_pb2_grpc.VerifyServiceStub(self.channel)
            kinds = (verify_pb2.VerifyStepRequest, verify_pb2.VerifyCall, VERIFY_SERVICE)
        request_cls, call_cls, full_name = kinds
        self.steps = StepStream(self.stub.Step, request_cls, call_cls, full_name, self.where, on_load)

    async def close(self, grace_s: float | None = None) -> None:
        """Ends the Step stream and closes the channel, calls in flight given ``grace_s`` seconds."""
        await self.steps.close()
        await self.channel.close(grace=grace_s)


class ReplicaSet:
    """The replicas of one service: one :class:`Replica` for each address ``discovery`` finds,
    made by ``connect(address)``, in the order found. :meth:`refresh` follows what discovery finds
    now: new replicas are connected, gone ones closed once their calls finish (``grace_s``)."""

    def __init__(
        self,
        service: Service,
        discovery: Discovery,
        connect: Callable[[Address], Replica],
        grace_s: float,
    ):
        self.service, self.discovery, self.connect, self.grace_s = service, discovery, connect, grace_s
        self._replicas: dict[str, Replica] = {}
        self._closing: set[asyncio.Task] = set()

    @property
    def addresses(self) -> list[str]:
        """The replicas' addresses (``host:port``), in discovery's order."""
        return list(self._replicas)

    def get(self, address: str) -> Replica:
        """The replica at ``address``. Raises Unavailable when discovery no longer finds it (its
        sessions are then rebuilt on another)."""
        replica = self._replicas.get(address)
        if replica is None:
            raise Unavailable(f"{self.service} service at {address} is no longer among the replicas found")
        return replica

    def follow(self, found: Sequence[Address]) -> None:
        """Connects the replicas in ``found`` not connected yet and retires those not in it."""
        wanted = {address.address: address for address in found}
        for gone in [a for a in self._replicas if a not in wanted]:
            log.info("%s service at %s is gone: no new sessions go there", self.service, gone)
            self._retire(self._replicas.pop(gone))
        for address, found_address in wanted.items():
            if address not in self._replicas:
                if self._replicas:
                    log.info("%s service at %s found: it takes new sessions", self.service, address)
                self._replicas[address] = self.connect(found_address)
        self._replicas = {address: self._replicas[address] for address in wanted}  # discovery's order

    async def refresh(self) -> None:
        """Resolves the targets again and follows what is found."""
        self.follow(await self.discovery.resolve())

    def reconnect(self) -> None:
        """Every replica on a new channel (new TLS credentials); the old ones close after their calls."""
        for address, replica in list(self._replicas.items()):
            self._retire(replica)
            self._replicas[address] = self.connect(replica.found)

    def _retire(self, replica: Replica) -> None:
        task = asyncio.ensure_future(replica.close(self.grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for replica in self._replicas.values():
            await replica.close()
        for task in list(self._closing):
            task.cancel()


class ServiceClients:
    """The coordinator's calls to every replica of the draft and the verify service, one typed
    method per call, each naming the replica (its ``host:port``). The per-round calls (Propose,
    Verify, Decode) of all its requests go over one Step stream per replica
    (:mod:`specdec.rpc.step_client`); the per-request ones (GetInfo, Prefill, Release)
    are unary RPCs. Every call has a deadline; a failed call raises the matching
    :class:`specdec.rpc.errors.SpecdecError` naming the replica, and one that found its replica
    unreachable makes discovery run again soon. Propose calls have the deadline
    ``propose_deadline`` (default: the ``rpc_timeout_s``); messages are limited to
    ``max_message_bytes`` each way. ``tls``: TLS to every service, None for plaintext; when its
    files change (looked at every TLS_CHECK_INTERVAL_S seconds at most), new calls go over new
    channels made with the new certificate, and calls in flight finish on the old ones.

    ``draft_targets``, ``verify_targets``: ``host:port`` of replicas or of DNS names
    (:mod:`coordinator.speculation.discovery`, through ``nameservers`` when given). IP targets
    are connected at once, names by :meth:`start`, which also resolves them again every
    ``refresh_s`` seconds. ``placements``: the placement of each service's sessions, fed here
    with every replica's load reports and call times from its Step stream (not its GetInfo
    answers: every request asks one replica for those, and a load known for that replica alone
    would make it look busier than the others, whose other coordinators' sessions go unseen).
    """

    def __init__(
        self,
        draft_targets: Sequence[str],
        verify_targets: Sequence[str],
        rpc_timeout_s: float,
        prefill_timeout_s: float,
        tls: Reloading[grpc.ChannelCredentials] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        propose_deadline: ProposeDeadline | None = None,
        placements: dict[Service, Placement] | None = None,
        nameservers: Sequence[str] = (),
        refresh_s: float = 10.0,
    ):
        if not verify_targets:
            raise ValueError("no verify service address: set --verify-addresses")
        self.rpc_timeout_s, self.prefill_timeout_s, self.refresh_s = rpc_timeout_s, prefill_timeout_s, refresh_s
        self.placements: dict[Service, Placement] = placements or {"draft": Placement(), "verify": Placement()}
        self._options = [*grpc_options(max_message_bytes), *RECONNECT_OPTIONS]
        self._tls, self._tls_checked = tls, time.monotonic()
        self._credentials = tls.value if tls else None
        grace_s = max(rpc_timeout_s, prefill_timeout_s)
        self.draft_replicas = self._replica_set("draft", Discovery(draft_targets, nameservers), grace_s)
        self.verify_replicas = self._replica_set("verify", Discovery(verify_targets, nameservers), grace_s)
        for replicas in (self.draft_replicas, self.verify_replicas):
            replicas.follow(replicas.discovery.known())  # the IP targets: nothing to resolve
        self.propose_deadline = propose_deadline or ProposeDeadline(rpc_timeout_s, 1.0, rpc_timeout_s)
        self._refreshing: asyncio.Task | None = None
        self._refreshed = 0.0  # time.monotonic() of the last refresh

    def _replica_set(self, service: Service, discovery: Discovery, grace_s: float) -> ReplicaSet:
        """The ReplicaSet of ``service``, each replica's load reports fed to its placement."""
        placement = self.placements[service]

        def connect(address: Address) -> Replica:
            on_load = lambda load: placement.observe(address.address, load=load)  # noqa: E731
            return Replica(service, address, self._credentials, self._options, on_load)

        return ReplicaSet(service, discovery, connect, grace_s)

    def replicas(self, service: Service) -> ReplicaSet:
        return self.draft_replicas if service == "draft" else self.verify_replicas

    # --- discovery ------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolves the targets' names and keeps resolving them every ``refresh_s`` seconds."""
        await self.refresh()
        if (self.draft_replicas.discovery.names or self.verify_replicas.discovery.names) and self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh_every())

    async def refresh(self) -> None:
        """Resolves every target again and follows what is found (see :class:`ReplicaSet`)."""
        self._refreshed = time.monotonic()
        for replicas in (self.draft_replicas, self.verify_replicas):
            await replicas.refresh()
            self.placements[replicas.service].forget(replicas.addresses)

    async def _refresh_every(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            with contextlib.suppress(Exception):  # a failure is logged by discovery; the next try comes
                await self.refresh()

    def _unreachable(self, service: Service) -> None:
        """A replica of ``service`` did not answer: with names to resolve, discovery runs again
        (at most once every REFRESH_AFTER_FAILURE_S), so a replica that is gone is dropped."""
        if self.replicas(service).discovery.names and time.monotonic() - self._refreshed > REFRESH_AFTER_FAILURE_S:
            self._refreshed = time.monotonic()
            task = asyncio.ensure_future(self.refresh())
            task.add_done_callback(lambda done: done.cancelled() or done.exception())

    # --- TLS ------------------------------------------------------------------------------

    def _follow_certificate(self) -> None:
        """New channels when the TLS files changed; the old ones close after their calls' deadlines."""
        if self._tls is None or time.monotonic() - self._tls_checked < TLS_CHECK_INTERVAL_S:
            return
        self._tls_checked = time.monotonic()
        credentials = self._tls.latest()
        if credentials is None:
            return
        self._credentials = credentials
        self.draft_replicas.reconnect()
        self.verify_replicas.reconnect()

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        await self.draft_replicas.close()
        await self.verify_replicas.close()

    # --- calls ----------------------------------------------------------------------------

    async def _call(self, service: Service, address: str, method: str, request, timeout_s: float | None):
        """The unary ``method`` of the replica at ``address``, under ``timeout_s`` (default
        rpc_timeout_s)."""
        self._follow_certificate()
        replica = self.replicas(service).get(address)
        try:
            return await getattr(replica.stub, method)(request, timeout=timeout_s or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, replica.where)
        if isinstance(error, Unavailable):
            self._unreachable(service)
        raise error

    async def _step(self, service: Service, address: str, kind: str, request, timeout_s: float, on_late=None):
        """A ``kind`` call over the Step stream of the replica at ``address``; its round trip and
        the compute the replica reports for it are placement's sample of the replica's speed."""
        self._follow_certificate()
        replica, start = self.replicas(service).get(address), time.monotonic()
        try:
            response = await replica.steps.call(kind, request, timeout_s, on_late=on_late)
        except Unavailable:
            self._unreachable(service)
            raise
        round_trip_ms = (time.monotonic() - start) * 1000
        self.placements[service].observe(address, round_trip_ms=round_trip_ms, compute_ms=response.compute_ms)
        return response

    async def draft_info(self, replica: str, timeout: float | None = None) -> draft_pb2.DraftServiceGetInfoResponse:
        """DraftService.GetInfo of the replica at ``replica``; ``timeout`` in seconds defaults to
        rpc_timeout_s."""
        return await self._call("draft", replica, "GetInfo", draft_pb2.DraftServiceGetInfoRequest(), timeout)

    async def prefill_draft(
        self, replica: str, request: draft_pb2.DraftServicePrefillRequest
    ) -> draft_pb2.DraftServicePrefillResponse:
        """DraftService.Prefill under the ``prefill_timeout_s`` deadline."""
        return await self._call("draft", replica, "Prefill", request, self.prefill_timeout_s)

    async def propose(
        self, replica: str, request: draft_pb2.ProposeRequest, on_late: Callable[[], None] | None = None
    ) -> draft_pb2.ProposeResponse:
        """A Propose over the replica's Step stream, under the Propose deadline for its forwards
        (:class:`ProposeDeadline`), which learns from its round trip: also from a call that
        missed it and was answered late (a draft slowed by a burst of load, not one that hangs,
        so that the deadline grows with the load instead of failing every call under it);
        ``on_late()`` is called then too."""
        num_forwards = ProposeDeadline.forwards(request)
        timeout = self.propose_deadline.seconds(num_forwards)
        start = time.monotonic()

        def learn(seconds: float) -> None:
            self.propose_deadline.observe(seconds, num_forwards)

        def learn_late(seconds: float) -> None:
            learn(seconds)
            if on_late is not None:
                on_late()

        response = await self._step("draft", replica, "propose", request, timeout, on_late=learn_late)
        learn(time.monotonic() - start)
        return response

    async def release_draft(self, replica: str, session_id: str) -> None:
        """DraftService.Release under a RELEASE_TIMEOUT_S deadline (callers retry one the service
        did not answer); nothing for a replica discovery no longer finds (:meth:`_release`)."""
        await self._release("draft", replica, draft_pb2.DraftServiceReleaseRequest(session_id=session_id))

    async def verify_info(self, replica: str) -> verify_pb2.VerifyServiceGetInfoResponse:
        """VerifyService.GetInfo of the replica at ``replica``, under rpc_timeout_s."""
        return await self._call("verify", replica, "GetInfo", verify_pb2.VerifyServiceGetInfoRequest(), None)

    async def prefill_verify(
        self, replica: str, request: verify_pb2.VerifyServicePrefillRequest
    ) -> verify_pb2.VerifyServicePrefillResponse:
        """VerifyService.Prefill on the replica at ``replica``, under prefill_timeout_s."""
        return await self._call("verify", replica, "Prefill", request, self.prefill_timeout_s)

    async def verify(self, replica: str, request: verify_pb2.VerifyRequest) -> verify_pb2.VerifyResponse:
        """A Verify over the replica's Step stream, under rpc_timeout_s."""
        return await self._step("verify", replica, "verify", request, self.rpc_timeout_s)

    async def decode(self, replica: str, request: verify_pb2.DecodeRequest) -> verify_pb2.DecodeResponse:
        """A Decode over the replica's Step stream, under rpc_timeout_s."""
        return await self._step("verify", replica, "decode", request, self.rpc_timeout_s)

    async def release_verify(self, replica: str, session_id: str) -> None:
        """VerifyService.Release on the replica at ``replica`` under a RELEASE_TIMEOUT_S deadline;
        nothing for a replica discovery no longer finds (:meth:`_release`)."""
        await self._release("verify", replica, verify_pb2.VerifyServiceReleaseRequest(session_id=session_id))

    async def _release(self, service: Service, replica: str, request) -> None:
        """A Release, unless the replica is gone from discovery: going away (a pod scaled down, its
        sessions with it) or still serving others, its idle timeout reclaims the session; retrying
        a Release there for the failover timeout would only wait on a replica nobody calls."""
        if replica in self.replicas(service).addresses:
            await self._call(service, replica, "Release", request, RELEASE_TIMEOUT_S)

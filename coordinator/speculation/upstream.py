"""The coordinator's gRPC clients of its upstream services, the draft service and the verify
replicas, with deadlines on every call; over TLS (mutual TLS with a client certificate) when given credentials
(:func:`specdec.tls.reloading_channel_credentials`). The public client of the coordinator itself
is :mod:`coordinator.api.client`; which verify replica to call is :mod:`coordinator.speculation.failover`'s
concern."""

import asyncio
import collections
import math
import time
from collections.abc import Callable

import grpc

from coordinator.speculation.step_client import StepStream
from specdec.errors import from_rpc_error
from specdec.server import MAX_MESSAGE_BYTES, grpc_options
from specdec.tls import Reloading
from specdec.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

# A restarted service is reconnected to within a second (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
TLS_CHECK_INTERVAL_S = 1.0  # how often the client certificate files are looked at, seconds
# Tokens one draft forward takes in about the time of a one-token decode forward: on the default
# draft (SmolLM2-135M, llama.cpp, 2 CPU cores) a K = 8 Propose took the same 100-200 ms with 0 and
# with 17 tokens to append and predict first.
TOKENS_PER_CATCH_UP_FORWARD = 16
RELEASE_TIMEOUT_S = 1.0  # a Release's deadline (callers retry one the service did not answer)
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
VERIFY_SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


class ProposeDeadline:
    """The deadline of a Propose call that costs ``num_forwards`` draft forwards
    (:meth:`forwards`), seconds: ``factor`` times the slowest of the last ``window`` Propose calls
    that succeeded, each scaled linearly to ``num_forwards`` (so a long catch-up after rounds
    without the draft neither misses its deadline nor stretches the next short call's); at least
    ``floor_s``, at most ``ceiling_s``, and ``10 * floor_s`` (capped) until a Propose has been
    measured. Round trips are measured as the
    coordinator sees them, the draft service's queue included, so the deadline grows with load;
    calls that missed it and were answered late count too (:meth:`ServiceClients.propose`), so a
    burst that slows the draft at once raises it within a few calls instead of failing every call
    while the load lasts. A draft that stops answering (no late answer) then costs a round this
    deadline instead of the RPC deadline."""

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


def _channel(address: str, credentials: grpc.ChannelCredentials | None, options: list) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class ServiceClients:
    """The coordinator's calls to the draft service and every verify replica, one typed method
    per call. The per-round calls (Propose, Verify, Decode) of all its requests go over one Step
    stream per service (:mod:`coordinator.speculation.step_client`); the per-request ones
    (GetInfo, Prefill, Release) are unary RPCs. Every call has a deadline; a failed call raises
    the matching :class:`specdec.errors.SpecdecError` naming the service and its address
    (whether to go on asking a service that failed is :mod:`coordinator.speculation.draft_side`'s
    and :mod:`coordinator.speculation.failover`'s concern). Propose calls have the deadline
    ``propose_deadline`` (default: the ``rpc_timeout_s``); messages are limited to
    ``max_message_bytes`` each way. ``tls``: TLS to every service, None for plaintext; when its
    files change (looked at every TLS_CHECK_INTERVAL_S seconds at most), new calls go over new
    channels made with the new certificate, and calls in flight finish on the old ones."""

    def __init__(
        self,
        draft_address: str,
        verify_addresses: list[str],
        rpc_timeout_s: float,
        prefill_timeout_s: float,
        tls: Reloading[grpc.ChannelCredentials] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        propose_deadline: ProposeDeadline | None = None,
    ):
        if not verify_addresses:
            raise ValueError("no verify service address: set --verify-addresses")
        self.draft_address, self.verify_addresses = draft_address, list(verify_addresses)
        self.rpc_timeout_s, self.prefill_timeout_s = rpc_timeout_s, prefill_timeout_s
        self._options = [*grpc_options(max_message_bytes), *RECONNECT_OPTIONS]
        self._draft_where = f"draft service at {draft_address}"
        self._verify_where = [f"verify service at {address}" for address in verify_addresses]
        self._tls, self._tls_checked = tls, time.monotonic()
        self._retiring: set[asyncio.Task] = set()  # old channels closing once their calls finish
        self._connect(tls.value if tls else None)
        self.propose_deadline = propose_deadline or ProposeDeadline(rpc_timeout_s, 1.0, rpc_timeout_s)

    def _connect(self, credentials: grpc.ChannelCredentials | None) -> None:
        addresses = (self.draft_address, *self.verify_addresses)
        self._channels = [_channel(address, credentials, self._options) for address in addresses]
        self._draft = draft_pb2_grpc.DraftServiceStub(self._channels[0])
        self._verify = [verify_pb2_grpc.VerifyServiceStub(channel) for channel in self._channels[1:]]
        self._draft_steps = StepStream(
            self._draft.Step, draft_pb2.DraftStepRequest, draft_pb2.DraftCall, DRAFT_SERVICE, self._draft_where
        )
        self._verify_steps = [
            StepStream(stub.Step, verify_pb2.VerifyStepRequest, verify_pb2.VerifyCall, VERIFY_SERVICE, where)
            for stub, where in zip(self._verify, self._verify_where, strict=True)
        ]

    @property
    def num_verify_replicas(self) -> int:
        return len(self.verify_addresses)

    def _follow_certificate(self) -> None:
        """New channels when the TLS files changed; the old ones close after their calls' deadlines."""
        if self._tls is None or time.monotonic() - self._tls_checked < TLS_CHECK_INTERVAL_S:
            return
        self._tls_checked = time.monotonic()
        credentials = self._tls.latest()
        if credentials is None:
            return
        old = self._channels
        self._connect(credentials)
        for channel in old:
            task = asyncio.ensure_future(channel.close(grace=max(self.rpc_timeout_s, self.prefill_timeout_s)))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        for stream in (self._draft_steps, *self._verify_steps):
            await stream.close()
        for channel in self._channels:
            await channel.close()
        for task in list(self._retiring):
            task.cancel()

    async def _call(self, method, request, where: str, timeout: float | None):
        try:
            return await method(request, timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, where) from None

    async def draft_info(self, timeout: float | None = None) -> draft_pb2.DraftServiceGetInfoResponse:
        """DraftService.GetInfo; ``timeout`` in seconds defaults to rpc_timeout_s."""
        self._follow_certificate()
        return await self._call(self._draft.GetInfo, draft_pb2.DraftServiceGetInfoRequest(), self._draft_where, timeout)

    async def prefill_draft(
        self, request: draft_pb2.DraftServicePrefillRequest
    ) -> draft_pb2.DraftServicePrefillResponse:
        """DraftService.Prefill under the ``prefill_timeout_s`` deadline."""
        self._follow_certificate()
        return await self._call(self._draft.Prefill, request, self._draft_where, self.prefill_timeout_s)

    async def propose(
        self, request: draft_pb2.ProposeRequest, on_late: Callable[[], None] | None = None
    ) -> draft_pb2.ProposeResponse:
        """A Propose over the draft's Step stream, under the Propose deadline for its forwards
        (:class:`ProposeDeadline`), which learns from its round trip: also from a call that
        missed it and was answered late (a draft slowed by a burst of load, not one that hangs,
        so that the deadline grows with the load instead of failing every call under it);
        ``on_late()`` is called then too."""
        num_forwards = ProposeDeadline.forwards(request)
        timeout = self.propose_deadline.seconds(num_forwards)
        start = time.monotonic()
        self._follow_certificate()

        def learn(seconds: float) -> None:
            self.propose_deadline.observe(seconds, num_forwards)

        def learn_late(seconds: float) -> None:
            learn(seconds)
            if on_late is not None:
                on_late()

        response = await self._draft_steps.call("propose", request, timeout, on_late=learn_late)
        learn(time.monotonic() - start)
        return response

    async def release_draft(self, session_id: str) -> None:
        """DraftService.Release under a RELEASE_TIMEOUT_S deadline (callers retry one the service
        did not answer)."""
        request = draft_pb2.DraftServiceReleaseRequest(session_id=session_id)
        await self._call(self._draft.Release, request, self._draft_where, RELEASE_TIMEOUT_S)

    async def verify_info(self, replica: int) -> verify_pb2.VerifyServiceGetInfoResponse:
        """VerifyService.GetInfo on replica number ``replica``, under rpc_timeout_s."""
        request = verify_pb2.VerifyServiceGetInfoRequest()
        return await self._call(self._verify_stub(replica).GetInfo, request, self._verify_where[replica], None)

    async def prefill_verify(
        self, replica: int, request: verify_pb2.VerifyServicePrefillRequest
    ) -> verify_pb2.VerifyServicePrefillResponse:
        """VerifyService.Prefill on replica number ``replica``, under prefill_timeout_s."""
        stub, where = self._verify_stub(replica), self._verify_where[replica]
        return await self._call(stub.Prefill, request, where, self.prefill_timeout_s)

    async def verify(self, replica: int, request: verify_pb2.VerifyRequest) -> verify_pb2.VerifyResponse:
        """A Verify over replica ``replica``'s Step stream, under rpc_timeout_s."""
        self._follow_certificate()
        return await self._verify_steps[replica].call("verify", request, self.rpc_timeout_s)

    async def decode(self, replica: int, request: verify_pb2.DecodeRequest) -> verify_pb2.DecodeResponse:
        """A Decode over replica ``replica``'s Step stream, under rpc_timeout_s."""
        self._follow_certificate()
        return await self._verify_steps[replica].call("decode", request, self.rpc_timeout_s)

    async def release_verify(self, replica: int, session_id: str) -> None:
        """VerifyService.Release on replica number ``replica`` under a RELEASE_TIMEOUT_S deadline."""
        request = verify_pb2.VerifyServiceReleaseRequest(session_id=session_id)
        await self._call(self._verify_stub(replica).Release, request, self._verify_where[replica], RELEASE_TIMEOUT_S)

    def _verify_stub(self, replica: int) -> verify_pb2_grpc.VerifyServiceStub:
        self._follow_certificate()
        return self._verify[replica]

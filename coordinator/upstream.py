"""The coordinator's gRPC clients of its upstream services, the draft service and the verify
replicas, with deadlines on every call; over TLS (mutual TLS with a client certificate) when given credentials
(:func:`specdec.tls.reloading_channel_credentials`). The public client of the coordinator itself
is :mod:`coordinator.client`; which verify replica to call is :mod:`coordinator.failover`'s
concern."""

import asyncio
import collections
import math
import time

import grpc

from specdec.errors import Unavailable, from_rpc_error
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


class ProposeDeadline:
    """The deadline of a Propose call that costs ``num_forwards`` draft forwards
    (:meth:`forwards`), seconds: ``factor`` times the slowest of the last ``window`` Propose calls
    that succeeded, each scaled linearly to ``num_forwards`` (so a long catch-up after rounds
    without the draft neither misses its deadline nor stretches the next short call's); at least
    ``floor_s``, at most ``ceiling_s``, and ``10 * floor_s`` (capped) until a Propose has been
    measured. Round trips are measured as the
    coordinator sees them, the draft service's queue included, so the deadline grows with load. A
    draft that stops answering then costs a round this deadline instead of the RPC deadline."""

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
    """Stubs for the draft service and every verify replica. Every call has a deadline; a failed
    call raises the matching :class:`specdec.errors.SpecdecError` naming the service and its
    address. The draft service, once it failed to answer in time or at all, is not asked for
    ``draft_down_s`` seconds
    (:meth:`draft_down`). Propose calls have the deadline ``propose_deadline`` (default: the
    ``rpc_timeout_s``); messages are limited to ``max_message_bytes`` each way. ``tls``: TLS to every service, None for
    plaintext; when its files change (looked at every TLS_CHECK_INTERVAL_S seconds at most), new
    calls go over new channels made with the new certificate, and calls in flight finish on the
    old ones."""

    def __init__(
        self,
        draft_address: str,
        verify_addresses: list[str],
        rpc_timeout_s: float,
        prefill_timeout_s: float,
        tls: Reloading[grpc.ChannelCredentials] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        propose_deadline: ProposeDeadline | None = None,
        draft_down_s: float = 2.0,
    ):
        if not verify_addresses:
            raise ValueError("no verify service address: set --verify-addresses")
        self.draft_address, self.verify_addresses = draft_address, list(verify_addresses)
        self.rpc_timeout_s, self.prefill_timeout_s = rpc_timeout_s, prefill_timeout_s
        self._options = [*grpc_options(max_message_bytes), *RECONNECT_OPTIONS]
        self._tls, self._tls_checked = tls, time.monotonic()
        self._retiring: set[asyncio.Task] = set()  # old channels closing once their calls finish
        self._connect(tls.value if tls else None)
        self.propose_deadline = propose_deadline or ProposeDeadline(rpc_timeout_s, 1.0, rpc_timeout_s)
        self.draft_down_s, self._draft_down_until = draft_down_s, 0.0

    def _connect(self, credentials: grpc.ChannelCredentials | None) -> None:
        addresses = (self.draft_address, *self.verify_addresses)
        self._channels = [_channel(address, credentials, self._options) for address in addresses]
        self.draft = draft_pb2_grpc.DraftServiceStub(self._channels[0])
        self.verify = [verify_pb2_grpc.VerifyServiceStub(channel) for channel in self._channels[1:]]

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
        for channel in self._channels:
            await channel.close()
        for task in list(self._retiring):
            task.cancel()

    async def _call(self, method, request, where: str, timeout: float | None):
        try:
            return await method(request, timeout=timeout or self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, where) from None

    async def call_draft(self, method: str, request, timeout: float | None = None):
        """Calls DraftService.<method>; ``timeout`` in seconds defaults to the Propose deadline for
        Propose, rpc_timeout_s for the others. A call that finds the service unreachable or misses
        its deadline marks the draft down (:meth:`draft_down`) and raises Unavailable."""
        self._follow_certificate()
        where = f"draft service at {self.draft_address}"
        num_forwards = ProposeDeadline.forwards(request) if method == "Propose" and timeout is None else None
        if num_forwards is not None:
            timeout = self.propose_deadline.seconds(num_forwards)
            where += f" (Propose deadline {timeout * 1000:.0f} ms)"
        start = time.monotonic()
        try:
            response = await self._call(getattr(self.draft, method), request, where, timeout)
        except Unavailable:
            self._draft_down_until = time.monotonic() + self.draft_down_s
            raise
        if num_forwards is not None:
            self.propose_deadline.observe(time.monotonic() - start, num_forwards)
        return response

    def draft_down(self) -> bool:
        """Whether a draft call failed to answer (unreachable, or past its deadline) in the last
        ``draft_down_s`` seconds: requests then run without the draft instead of waiting on it."""
        return time.monotonic() < self._draft_down_until

    async def call_verify(self, replica: int, method: str, request, timeout: float | None = None):
        """Calls VerifyService.<method> on replica number ``replica``; ``timeout`` in seconds
        defaults to rpc_timeout_s."""
        where = f"verify service at {self.verify_addresses[replica]}"
        self._follow_certificate()
        return await self._call(getattr(self.verify[replica], method), request, where, timeout)

    async def release_draft(self, session_id: str) -> None:
        """DraftService.Release under a RELEASE_TIMEOUT_S deadline. Background clean-up, retried
        by the caller while the service is away: a failure raises Unavailable but does not mark
        the draft down (:meth:`draft_down` is for the calls on a request's path)."""
        request = draft_pb2.DraftServiceReleaseRequest(session_id=session_id)
        await self._call(self.draft.Release, request, f"draft service at {self.draft_address}", RELEASE_TIMEOUT_S)

    async def release_verify(self, replica: int, session_id: str) -> None:
        """VerifyService.Release on replica number ``replica`` under a RELEASE_TIMEOUT_S deadline."""
        request = verify_pb2.VerifyServiceReleaseRequest(session_id=session_id)
        await self.call_verify(replica, "Release", request, RELEASE_TIMEOUT_S)

    async def draft_info(self, timeout: float | None = None) -> draft_pb2.DraftServiceGetInfoResponse:
        return await self.call_draft("GetInfo", draft_pb2.DraftServiceGetInfoRequest(), timeout)

"""The coordinator's gRPC clients of the draft service and the verify replicas, with deadlines on
every call and a shared view of which verify replicas failed recently; over TLS (mutual TLS with a
client certificate) when given credentials (:func:`specdec.tls.reloading_channel_credentials`)."""

import asyncio
import time

import grpc

from specdec.errors import SpecdecError, from_rpc_error
from specdec.server import MAX_MESSAGE_BYTES, grpc_options
from specdec.tls import Reloading
from specdec.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

# A restarted service is reconnected to within a second (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
TLS_CHECK_INTERVAL_S = 1.0  # how often the client certificate files are looked at, seconds


def _channel(address: str, credentials: grpc.ChannelCredentials | None, options: list) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class ServiceClients:
    """Stubs for the draft service and every verify replica. Every call has a deadline; a failed
    call raises the matching :class:`specdec.errors.SpecdecError` naming the service and its
    address. A verify replica that failed is tried last for ``replica_down_s`` seconds; messages
    are limited to ``max_message_bytes`` each way. ``tls``: TLS to every service, None for
    plaintext; when its files change (looked at every TLS_CHECK_INTERVAL_S seconds at most), new
    calls go over new channels made with the new certificate, and calls in flight finish on the
    old ones."""

    def __init__(
        self, draft_address: str, verify_addresses: list[str], rpc_timeout_s: float, prefill_timeout_s: float,
        replica_down_s: float = 5.0, tls: Reloading[grpc.ChannelCredentials] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        if not verify_addresses:
            raise ValueError("no verify service address: set --verify-addresses")
        self.draft_address, self.verify_addresses = draft_address, list(verify_addresses)
        self.rpc_timeout_s, self.prefill_timeout_s, self.replica_down_s = rpc_timeout_s, prefill_timeout_s, replica_down_s
        self._options = [*grpc_options(max_message_bytes), *RECONNECT_OPTIONS]
        self._tls, self._tls_checked = tls, time.monotonic()
        self._retiring: set[asyncio.Task] = set()  # old channels closing once their calls finish
        self._connect(tls.value if tls else None)
        self._down_until = [0.0] * len(self.verify)
        self._next = 0

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
        """Calls DraftService.<method>; ``timeout`` in seconds defaults to rpc_timeout_s."""
        self._follow_certificate()
        return await self._call(getattr(self.draft, method), request, f"draft service at {self.draft_address}", timeout)

    async def call_verify(self, replica: int, method: str, request, timeout: float | None = None):
        """Calls VerifyService.<method> on replica number ``replica``; ``timeout`` in seconds
        defaults to rpc_timeout_s."""
        where = f"verify service at {self.verify_addresses[replica]}"
        self._follow_certificate()
        return await self._call(getattr(self.verify[replica], method), request, where, timeout)

    def replica_order(self) -> list[int]:
        """Every verify replica, round robin from one call to the next, those that failed in the
        last ``replica_down_s`` seconds last."""
        n = len(self.verify)
        start, self._next = self._next, (self._next + 1) % n
        order = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        return sorted(order, key=lambda i: self._down_until[i] > now)

    def mark_down(self, replica: int) -> None:
        """Records that a verify replica failed a call."""
        self._down_until[replica] = time.monotonic() + self.replica_down_s

    async def draft_info(self) -> draft_pb2.DraftServiceGetInfoResponse:
        return await self.call_draft("GetInfo", draft_pb2.DraftServiceGetInfoRequest())

    async def verify_info(self) -> verify_pb2.VerifyServiceGetInfoResponse:
        """GetInfo of the first replica that answers. Raises the last replica's error if none does."""
        error = None
        for replica in self.replica_order():
            try:
                return await self.call_verify(replica, "GetInfo", verify_pb2.VerifyServiceGetInfoRequest())
            except SpecdecError as err:  # another replica may answer
                error = err
                self.mark_down(replica)
        raise error

"""The coordinator's gRPC clients of the draft and verify services, with deadlines on every call."""

import grpc

from specdec.errors import from_rpc_error
from specdec.server import GRPC_OPTIONS
from specdec.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc


class ServiceClients:
    """Stubs for both services. Every call has a deadline; a failed call raises the matching
    :class:`specdec.errors.SpecdecError` naming the service and its address."""

    def __init__(self, draft_address: str, verify_address: str, rpc_timeout_s: float, prefill_timeout_s: float):
        self.draft_address, self.verify_address = draft_address, verify_address
        self.rpc_timeout_s, self.prefill_timeout_s = rpc_timeout_s, prefill_timeout_s
        self._channels = [
            grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            for address in (draft_address, verify_address)
        ]
        self.draft = draft_pb2_grpc.DraftServiceStub(self._channels[0])
        self.verify = verify_pb2_grpc.VerifyServiceStub(self._channels[1])

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def _call(self, method, request, where: str, timeout: float):
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, where) from None

    async def call_draft(self, method: str, request, timeout: float | None = None):
        """Calls DraftService.<method>; ``timeout`` in seconds defaults to rpc_timeout_s."""
        return await self._call(
            getattr(self.draft, method), request, f"draft service at {self.draft_address}",
            timeout or self.rpc_timeout_s,
        )

    async def call_verify(self, method: str, request, timeout: float | None = None):
        """Calls VerifyService.<method>; ``timeout`` in seconds defaults to rpc_timeout_s."""
        return await self._call(
            getattr(self.verify, method), request, f"verify service at {self.verify_address}",
            timeout or self.rpc_timeout_s,
        )

    async def draft_info(self) -> draft_pb2.DraftServiceGetInfoResponse:
        return await self.call_draft("GetInfo", draft_pb2.DraftServiceGetInfoRequest())

    async def verify_info(self) -> verify_pb2.VerifyServiceGetInfoResponse:
        return await self.call_verify("GetInfo", verify_pb2.VerifyServiceGetInfoRequest())

"""API keys of the coordinator's public APIs: ``Authorization: Bearer <key>`` on HTTP, the same
value as ``authorization`` metadata on the gRPC CoordinatorService. With no key configured both are
open. Health checks (gRPC health, HTTP ``/health``) and gRPC reflection never need a key."""

import hmac
from collections.abc import Iterable

import grpc

from specdec.errors import SpecdecError
from specdec.v1 import coordinator_pb2_grpc

HOW = (
    "send `Authorization: Bearer <key>` (gRPC: `authorization` metadata) with a key the "
    "coordinator was started with (--api-key)"
)


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ApiKeys:
    """The accepted keys; empty: no authentication."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [key.encode() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless ``authorization`` (an Authorization header or metadata
        value) is ``Bearer <key>`` with an accepted key, or no key is required."""
        if not self._keys:
            return
        if not authorization:
            raise Unauthenticated(f"missing API key: {HOW}")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated(f"malformed authorization {scheme!r}: {HOW}")
        given = key.strip().encode()
        # every key is compared (no early exit), each in constant time
        if not any([hmac.compare_digest(given, accepted) for accepted in self._keys]):
            raise Unauthenticated(f"invalid API key: {HOW}")


class AuthenticatedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The CoordinatorService behind API keys: each call is checked before it reaches ``servicer``
    (UNAUTHENTICATED without a valid key). It wraps the servicer rather than intercepting the server
    so that health and reflection, served by the same server, stay open."""

    def __init__(self, servicer: coordinator_pb2_grpc.CoordinatorServiceServicer, keys: ApiKeys):
        self.servicer, self.keys = servicer, keys

    async def Generate(self, request, context):
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.keys.check(metadata.get("authorization"))
        except Unauthenticated as err:
            await context.abort(err.code, str(err))
        async for response in self.servicer.Generate(request, context):
            yield response

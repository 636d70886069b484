"""The coordinator's public gRPC server checks a call's API key from its metadata, before it reads
the request message, and bounds the calls it runs (docs/security.md#the-public-grpc-server).

gRPC calls a unary-request handler only once the whole request message has arrived: a check inside
the handler (or an interceptor that returns an aborting unary handler) waits meanwhile, and a
client that declares a large message and sends a few bytes of it holds the call as long as it
likes. :class:`ApiKeyInterceptor` runs when a call's headers arrive: a call without an accepted key
is answered UNAUTHENTICATED by a request-streaming handler, which gRPC runs at once without waiting
for a message, so the call ends then. Health checks and server reflection need no key.

The bound on the calls in progress (``--max-concurrent-rpcs``) is kept here too, not by gRPC's own
``maximum_concurrent_rpcs``: gRPC counts a call from its headers, health checks and calls without a
key included, so stalled keyless streams took every place. Here only calls with a key count (health
checks and reflection never do), each from the moment its request message has arrived until it ends;
a stream that never finishes sending its message holds none (what bounds such streams: the HTTP/2
settings of :func:`specdec.rpc.server.connection_options`).
"""

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from coordinator.api.auth import ApiKeys, Unauthenticated

# Services open without a key: the standard health service and server reflection (both versions'
# names: a client may ask for either).
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})


def service_of(method: str) -> str:
    """``/specdec.v1.CoordinatorService/Generate`` -> ``specdec.v1.CoordinatorService``."""
    return method.lstrip("/").partition("/")[0]


def refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code`` with ``details`` at once: request-streaming, so gRPC runs it
    without waiting for (or reading) the request message."""

    async def refuse(_requests, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    return grpc.stream_unary_rpc_method_handler(refuse)


class CallsInProgress:
    """The calls with a key that run at once, at most ``limit`` (0: no bound)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def take(self) -> bool:
        """Counts one more call; False (and nothing counted) when ``limit`` run already."""
        if self.limit and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def give(self) -> None:
        self.count -= 1

    def refused(self) -> str:
        return (
            f"the coordinator already serves {self.limit} calls, its limit (max_concurrent_rpcs): retry later, "
            "or raise --max-concurrent-rpcs"
        )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call to any service but :data:`OPEN_SERVICES` with UNAUTHENTICATED when its
    ``authorization`` metadata holds no key of ``keys`` (none needed when ``keys`` is empty), before
    its message is read; counts a call with one in ``calls`` while its handler runs, refusing it
    with RESOURCE_EXHAUSTED (naming ``--max-concurrent-rpcs``) when ``calls`` are at their limit."""

    def __init__(self, keys: ApiKeys, calls: CallsInProgress):
        self.keys, self.calls = keys, calls

    async def intercept_service(self, continuation, handler_call_details):
        if service_of(handler_call_details.method) in OPEN_SERVICES:
            return await continuation(handler_call_details)
        try:
            self.keys.check(dict(handler_call_details.invocation_metadata or ()).get("authorization"))
        except Unauthenticated as err:
            return refusal(grpc.StatusCode.UNAUTHENTICATED, str(err))
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:  # the public API's calls are unary-request
            return handler
        return self._counted(handler)

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        calls = self.calls
        if handler.response_streaming:
            method = handler.unary_stream

            async def stream_behavior(request, context):
                if not calls.take():
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, calls.refused())
                try:
                    async for response in method(request, context):
                        yield response
                finally:
                    calls.give()

            return handler._replace(unary_stream=stream_behavior)
        unary = handler.unary_unary

        async def unary_behavior(request, context):
            if not calls.take():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, calls.refused())
            try:
                return await unary(request, context)
            finally:
                calls.give()

        return handler._replace(unary_unary=unary_behavior)

"""The coordinator's public gRPC server checks a call's API key from its metadata, before it reads
the request message, bounds how long a request message may take to arrive, and bounds the calls it
runs (docs/security.md#the-public-grpc-server).

gRPC calls a unary-request handler only once the whole request message has arrived: a check inside
the handler (or an interceptor that returns an aborting unary handler) waits meanwhile, and a
client that declares a large message and sends a few bytes of it holds the call, and the bytes it
sent, as long as it likes. :class:`ApiKeyInterceptor` runs when a call's headers arrive: a call
without an accepted key is answered UNAUTHENTICATED by a request-streaming handler, which gRPC runs
at once without waiting for a message, so the call ends then. Health checks and server reflection
need no key. Every other call's handler is made request-streaming too, reading its request message
itself under ``--grpc-request-message-timeout-s`` (:func:`next_request`) before it runs the
original behaviour: a message still arriving past it ends the call with DEADLINE_EXCEEDED and frees
what had come.

The bound on the calls in progress (``--max-concurrent-rpcs``) is kept here too, not by gRPC's own
``maximum_concurrent_rpcs``: gRPC counts a call from its headers, health checks and calls without a
key included, so stalled keyless streams took every place. Here only calls with a key count (health
checks and reflection never do), each from the moment its request message has arrived until it ends;
a stream that never finishes sending its message holds none.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from coordinator.api.auth import ApiKeys, Unauthenticated
from specdec.rpc.aio_handlers import responses

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
    its message is read; gives every call's request message ``message_timeout_s`` seconds to arrive
    (:func:`request_within`); counts a call with a key in ``calls`` while its handler runs, refusing
    it with RESOURCE_EXHAUSTED (naming ``--max-concurrent-rpcs``) when ``calls`` are at their limit."""

    def __init__(self, keys: ApiKeys, calls: CallsInProgress, message_timeout_s: float):
        self.keys, self.calls, self.message_timeout_s = keys, calls, message_timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        keyed = service_of(handler_call_details.method) not in OPEN_SERVICES
        if keyed:
            try:
                self.keys.check(dict(handler_call_details.invocation_metadata or ()).get("authorization"))
            except Unauthenticated as err:
                return refusal(grpc.StatusCode.UNAUTHENTICATED, str(err))
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:  # server reflection (the public API's calls are unary-request)
            return self._streaming_requests(handler)
        return self._unary_request(handler, self.calls if keyed else None)

    def _streaming_requests(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` reading its requests through :func:`requests_within`."""
        timeout_s = self.message_timeout_s
        if handler.response_streaming:
            stream_stream = handler.stream_stream

            async def stream_behavior(requests, context):
                async for response in responses(stream_stream(requests_within(requests, context, timeout_s), context)):
                    yield response

            return handler._replace(stream_stream=stream_behavior)
        stream_unary = handler.stream_unary

        async def unary_behavior(requests, context):
            return await stream_unary(requests_within(requests, context, timeout_s), context)

        return handler._replace(stream_unary=unary_behavior)

    def _unary_request(self, handler: grpc.RpcMethodHandler, calls: CallsInProgress | None) -> grpc.RpcMethodHandler:
        """``handler``, a unary-request one, made request-streaming: it reads the request message
        itself (:func:`request_within`), then takes a place in ``calls`` (None: counted nowhere) and
        runs the original behaviour with it."""
        timeout_s = self.message_timeout_s
        if handler.response_streaming:
            unary_stream = handler.unary_stream

            async def stream_behavior(requests, context):
                request = await request_within(requests, context, timeout_s)
                async with place(calls, context):
                    async for response in responses(unary_stream(request, context)):
                        yield response

            return grpc.stream_stream_rpc_method_handler(
                stream_behavior, handler.request_deserializer, handler.response_serializer
            )
        unary_unary = handler.unary_unary

        async def unary_behavior(requests, context):
            request = await request_within(requests, context, timeout_s)
            async with place(calls, context):
                return await unary_unary(request, context)

        return grpc.stream_unary_rpc_method_handler(
            unary_behavior, handler.request_deserializer, handler.response_serializer
        )


@contextlib.asynccontextmanager
async def place(calls: CallsInProgress | None, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """One of ``calls``' places while the block runs (None: no count); the call aborted with
    RESOURCE_EXHAUSTED, naming ``--max-concurrent-rpcs``, when none is free."""
    if calls is None:
        yield
        return
    if not calls.take():
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, calls.refused())
    try:
        yield
    finally:
        calls.give()


async def request_within(requests: AsyncIterable, context: grpc.aio.ServicerContext, timeout_s: float):
    """The request message of a unary-request call (``requests``: its request iterator), once it
    has arrived whole (:func:`next_request`); the call aborted with INVALID_ARGUMENT when its client
    ended it without one."""
    request = await next_request(aiter(requests), context, timeout_s)
    if request is None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message: send one before ending it"
        )
    return request


async def requests_within(
    requests: AsyncIterable, context: grpc.aio.ServicerContext, timeout_s: float
) -> AsyncIterator:
    """The request messages of a request-streaming call, each read by :func:`next_request`."""
    iterator = aiter(requests)
    while (request := await next_request(iterator, context, timeout_s)) is not None:
        yield request


async def next_request(iterator: AsyncIterator, context: grpc.aio.ServicerContext, timeout_s: float):
    """The next message of a call's request ``iterator``, None when the client sent no more. gRPC
    takes a message whole before it hands it over, keeping what has arrived of it meanwhile: one
    that has not arrived within ``timeout_s`` seconds (0: no bound) of the call's start or of the
    previous message aborts the call with DEADLINE_EXCEEDED, naming
    ``--grpc-request-message-timeout-s``, and what it sent is freed."""
    try:
        return await asyncio.wait_for(anext(iterator), timeout_s or None)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request message did not arrive within {timeout_s:g} s of the call's start (or of the previous "
            "message), its limit: send each message whole at once, or raise --grpc-request-message-timeout-s",
        )

"""Requests that do not parse get INVALID_ARGUMENT.

gRPC answers a request its deserializer cannot parse (garbage bytes, a truncated message, a string
field that is not UTF-8) with INTERNAL, "Exception deserializing request!", which tells the client
nothing. These interceptors, one for the threaded and one for the asyncio server, parse the
request themselves and answer such a call with INVALID_ARGUMENT naming the message type and what
is wrong with it; a request stream (the Step streams) that sends one ends with INVALID_ARGUMENT.
The asyncio server's streaming requests (server reflection) are left to gRPC.
"""

import grpc
from google.protobuf.message import DecodeError

from specdec.rpc.aio_handlers import responses


class _Undecodable:
    """What the deserializer hands the method in place of a request it could not parse."""

    def __init__(self, message: str):
        self.message = message


def _tolerant(deserializer):
    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except DecodeError as err:
            return _Undecodable(
                f"the request is not a valid protobuf message ({err}): send a serialized request of "
                "this method's type, strings as UTF-8"
            )

    return deserialize


def _parses(handler: grpc.RpcMethodHandler | None) -> bool:
    return handler is not None and not handler.request_streaming and handler.request_deserializer is not None


def _decoded(requests, context: grpc.ServicerContext):
    """The requests of a stream, aborting it with INVALID_ARGUMENT at the first undecodable one."""
    for request in requests:
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


class RejectUndecodable(grpc.ServerInterceptor):
    """The threaded server's interceptor (see the module docstring)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is not None and handler.stream_stream is not None and handler.request_deserializer is not None:
            method = handler.stream_stream
            return handler._replace(
                request_deserializer=_tolerant(handler.request_deserializer),
                stream_stream=lambda requests, context: method(_decoded(requests, context), context),
            )
        if not _parses(handler):
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        method = getattr(handler, kind)

        def behavior(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return method(request, context)

        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **{kind: behavior})


class AioRejectUndecodable(grpc.aio.ServerInterceptor):
    """The asyncio server's interceptor (see the module docstring)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not _parses(handler):
            return handler
        if handler.response_streaming:
            method = handler.unary_stream

            async def stream_behavior(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for response in responses(method(request, context)):
                    yield response

            replaced = {"unary_stream": stream_behavior}
        else:
            method = handler.unary_unary

            async def unary_behavior(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await method(request, context)

            replaced = {"unary_unary": unary_behavior}
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **replaced)

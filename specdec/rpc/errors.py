"""Errors that map one-to-one onto gRPC status codes.

Service code raises these; the servicer wrappers turn them into the matching status with the
message unchanged, so every message must say what the caller should change.
"""

import functools
from collections.abc import Callable
from typing import TypeVar

import grpc


class SpecdecError(Exception):
    """Base class; ``code`` is the gRPC status the client receives."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


F = TypeVar("F", bound=Callable)


def grpc_errors(method: F) -> F:
    """Decorates a sync servicer method: a SpecdecError aborts the call with its status code, any
    other exception fails it as UNKNOWN (grpc's answer). Each failure is counted in the servicer's
    ``metrics.rpc_errors`` (a :class:`specdec.observability.prometheus.ServiceMetrics`) under its status code."""

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        try:
            return method(self, request, context)
        except SpecdecError as err:
            self.metrics.rpc_errors.labels(method.__name__, err.code.name).inc()
            context.abort(err.code, str(err))
        except Exception:
            self.metrics.rpc_errors.labels(method.__name__, grpc.StatusCode.UNKNOWN.name).inc()
            raise

    return wrapper  # type: ignore[return-value]


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted, FailedPrecondition, Unavailable)
}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status code with number ``number`` (as a CallError carries it); UNKNOWN for none."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def from_status(code: grpc.StatusCode, details: str, where: str) -> SpecdecError:
    """The SpecdecError for a call to another service that failed with ``code`` and ``details``
    (a unary RPC's status, or a Step stream's CallError); ``where`` names that service. A missed
    deadline becomes UNAVAILABLE, and so does CANCELLED: a call this process cancels ends in
    asyncio.CancelledError, so a CANCELLED status was the service's own doing (a server stopping
    cancels the calls in flight), and the call is retried elsewhere like any other on a service
    that went away."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"{where} did not answer within its deadline")
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(f"{where} cancelled the call (the service is stopping): {details}")
    return _BY_CODE.get(code, SpecdecError)(f"{where}: {details}")


def from_rpc_error(err: grpc.RpcError, where: str) -> SpecdecError:
    """The SpecdecError for a failed call to another service; ``where`` names that service.
    A missed deadline or a call the service cancelled becomes UNAVAILABLE."""
    return from_status(err.code(), err.details(), where)

"""The coordinator's end of a Step stream (``VerifyService.Step``, ``DraftService.Step``; the
service's end is :mod:`specdec.rpc.step_server`): every request's per-round call to one service goes
over one long-lived stream, and the calls its requests make at about the same time travel in one
message (docs/architecture.md#the-serving-path-step-streams).

A call (:meth:`StepStream.call`) is queued and sent with the others queued in the same turn of
the event loop; its result comes back matched by call id. Each call keeps its own deadline (sent
along, so the service drops work whose caller gave up, and enforced here: a missed one raises
UNAVAILABLE, as a unary call's DEADLINE_EXCEEDED does), its own error (the CallError the service
sent, raised as the matching :class:`specdec.rpc.errors.SpecdecError`) and its own span (a client
span whose context travels in the call's header). When the stream fails (the service went away)
every call in flight on it raises UNAVAILABLE, and the next call opens a new stream. A call that
gave up at its deadline may still be answered later: its caller can learn the real round trip
from that (``on_late``), as the Propose deadline does.
"""

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from opentelemetry import propagate, trace

from specdec.observability.telemetry import current_span
from specdec.rpc.errors import SpecdecError, Unavailable, from_rpc_error, from_status, status_code
from specdec.rpc.step_server import CallResult, oneof_kinds
from specdec.v1 import common_pb2, draft_pb2, verify_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
MAX_LATE = 4096  # calls past their deadline whose late answer a stream still waits for

# A Step stream's call message, of its service: VerifyCall (verify, decode) or DraftCall (propose).
CallT = TypeVar("CallT", verify_pb2.VerifyCall, draft_pb2.DraftCall)
CallT_contra = TypeVar("CallT_contra", verify_pb2.VerifyCall, draft_pb2.DraftCall, contravariant=True)


class StepRequestClass(Protocol[CallT_contra]):
    """A Step stream's request message class (``VerifyStepRequest``, ``DraftStepRequest``): built
    from the calls one message carries."""

    def __call__(self, *, calls: Iterable[CallT_contra]) -> Message: ...


class MissedDeadline(Unavailable):
    """A call gave up at its deadline; the service may still run it and answer late (``on_late``)."""


class StepStream(Generic[CallT]):
    """Calls over a Step stream that ``open_stream()`` opens (the stub's ``Step``, unary-free).

    Args:
        open_stream: opens the stream (``stub.Step``), called again after a failure.
        request_cls, call_cls: the stream's request message (with ``calls``) and call message
            (``header`` and a ``oneof call``), e.g. ``VerifyStepRequest`` and ``VerifyCall``.
        service: the full gRPC service name, for span names; ``where`` names the service in errors.
        on_load: called with the service's load report (``common.ServiceLoad``) of every message
            that carries one.

    The kinds of call are the call message's ``oneof call`` fields (``kinds``, from the proto);
    :meth:`call` refuses any other, or a request of another type, with TypeError (a bug here, not
    the service's).
    """

    def __init__(
        self,
        open_stream: Callable[[], grpc.aio.StreamStreamCall],
        request_cls: StepRequestClass[CallT],
        call_cls: type[CallT],
        service: str,
        where: str,
        on_load: Callable[[common_pb2.ServiceLoad], None] | None = None,
    ):
        self.open_stream = open_stream
        self.request_cls: StepRequestClass[CallT] = request_cls
        self.call_cls: type[CallT] = call_cls
        self.kinds = oneof_kinds(call_cls, "call")
        self.service, self.where, self.on_load = service, where, on_load
        self._ids = itertools.count(1)
        self._open: _OpenStream[CallT] | None = None

    async def call(
        self, kind: str, request: Message, timeout_s: float, on_late: Callable[[float], None] | None = None
    ) -> Any:
        """Sends ``request`` as the call's ``kind`` field (``verify``, ``decode``, ``propose``) and
        returns the response. Raises the SpecdecError the service answered with, or Unavailable:
        the deadline of ``timeout_s`` seconds passed, or the stream failed. ``on_late(seconds)``:
        called with the round trip when a call that missed its deadline is answered after all
        (successfully, while the stream lasts; up to MAX_LATE such calls are remembered). Raises
        TypeError for a ``kind`` the call message lacks or a ``request`` not of its type."""
        if not isinstance(request, self.kinds.get(kind, ())):
            raise TypeError(f"a {kind!r} call of {self.call_cls.__name__} takes one of {sorted(self.kinds)}, typed")
        span_name = f"/{self.service}/{kind.capitalize()}"
        with current_span(tracer, span_name, kind=trace.SpanKind.CLIENT) as span:
            call = self.call_cls(header=common_pb2.CallHeader(call_id=next(self._ids), timeout_ms=timeout_s * 1000))
            if span.is_recording():  # tracing on: the service's span joins this trace
                propagate.inject(call.header.trace_context)
            getattr(call, kind).CopyFrom(request)
            if self._open is None or self._open.failed:
                self._open = _OpenStream(self.open_stream(), self.request_cls, self.where, self.on_load)
            result = await self._open.send(call, timeout_s, on_late)
            outcome = result.WhichOneof("result")
            if outcome == "error":
                raise from_status(status_code(result.error.code), result.error.message, self.where)
            if outcome != kind:  # the service answered another kind of call under this call id
                raise Unavailable(f"{self.where} answered a {kind} call with {outcome or 'nothing'}")
            return getattr(result, outcome)

    async def close(self) -> None:
        """Ends the stream; calls in flight raise UNAVAILABLE."""
        if self._open is not None:
            await self._open.close()


class _OpenStream(Generic[CallT]):
    """One opened stream: the calls waiting to go out, the calls in flight, and the tasks that
    write and read it."""

    def __init__(
        self,
        stream: grpc.aio.StreamStreamCall,
        request_cls: StepRequestClass[CallT],
        where: str,
        on_load: Callable[[common_pb2.ServiceLoad], None] | None,
    ):
        self.stream, self.where, self.on_load = stream, where, on_load
        self.request_cls: StepRequestClass[CallT] = request_cls
        self.failed = False
        self._outbox: list[CallT] = []
        self._pending: dict[int, asyncio.Future[CallResult]] = {}
        self._late: collections.OrderedDict[int, tuple[float, Callable[[float], None]]] = collections.OrderedDict()
        self._wake = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def send(self, call: CallT, timeout_s: float, on_late: Callable[[float], None] | None) -> CallResult:
        call_id = call.header.call_id
        loop = asyncio.get_running_loop()
        future, start = loop.create_future(), loop.time()
        self._pending[call_id] = future
        self._outbox.append(call)
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            if on_late is not None:
                self._late[call_id] = (start, on_late)
                while len(self._late) > MAX_LATE:
                    self._late.popitem(last=False)
            raise MissedDeadline(f"{self.where} did not answer within its deadline") from None
        finally:
            self._pending.pop(call_id, None)

    async def _write(self) -> None:
        """Sends the queued calls, one message per turn of the event loop that queued some."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await asyncio.sleep(0)  # the calls of the requests resumed with this one come along
                calls, self._outbox = self._outbox, []
                await self.stream.write(self.request_cls(calls=calls))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            log.debug("the Step stream to %s stopped taking calls: %s", self.where, err)  # _read fails them

    async def _read(self) -> None:
        """Hands each result to its call; on the stream's end, fails every call still in flight."""
        error: SpecdecError = Unavailable(f"{self.where} ended the Step stream: the service is stopping")
        try:
            async for message in self.stream:
                if self.on_load is not None and message.HasField("load"):
                    self.on_load(message.load)
                for result in message.results:
                    future = self._pending.get(result.call_id)
                    if future is not None and not future.done():
                        future.set_result(result)
                    elif (late := self._late.pop(result.call_id, None)) and result.WhichOneof("result") != "error":
                        start, on_late = late
                        on_late(asyncio.get_running_loop().time() - start)
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, self.where)
            if not isinstance(error, Unavailable):
                error = Unavailable(str(error))
        except asyncio.CancelledError:
            error = Unavailable(f"the Step stream to {self.where} was closed")
        self.failed = True
        self._tasks[0].cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        self.stream.cancel()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)

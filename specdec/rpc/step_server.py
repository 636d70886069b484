"""The service end of a Step stream (``VerifyService.Step``, ``DraftService.Step``): many sessions'
per-round calls (Verify, Decode, Propose) over one long-lived stream per caller, instead of one
unary RPC per call (docs/profiles.md#step-streams-against-unary-calls says why: the profile).

Each incoming message carries calls; each call is served exactly as its unary RPC would be (the
same handler, its deadline from ``CallHeader.timeout_ms``, 0 for none, its span a child of the
caller's from ``CallHeader.trace_context``), and its result or error (``CallError``, the status
code and message the unary RPC would fail with) goes back in the next outgoing message. Every kind
of call is served by a *starter* (the verify service's Verify and Decode, the draft service's
Propose): it starts on the thread that reads the stream, queues its work on the engine and
returns, and the reading thread goes on; the engine's thread replies when the work is done, so no
thread waits per call (a model-free drafter's Propose, which needs no forward, replies at once).
The engine hands one step's outcomes together (:mod:`specdec.handoff`), so a step's results for
one stream go out in one message; a message also takes any other results ready when it is sent.
The stream ends when the caller closes its side and every call it sent has been answered, or at
once when the caller goes away.
"""

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from opentelemetry import propagate, trace

from specdec.handoff import Outbox
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.errors import InvalidArgument, SpecdecError, status_code
from specdec.v1 import common_pb2, draft_pb2, verify_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# What a call's starter is given to reply with, once: the response, or the error the call fails with.
Reply = Callable[[Message | BaseException], None]
# A starter: (request, timeout in seconds or None, abandoned() -> the caller went away, reply);
# returns at once and replies later, from any thread, or raises the error the call fails with.
Starter = Callable[[Any, float | None, Callable[[], bool], Reply], None]
# A Step stream's result message, of its service: one per call, its response or its error.
CallResult = verify_pb2.VerifyCallResult | draft_pb2.DraftCallResult
_END = object()  # the caller closed its side of the stream
POLL_S = 1.0  # how often a stream waiting for results checks that its caller is still there, seconds


def oneof_kinds(message_cls: type[Message], oneof: str) -> dict[str, type[Message]]:
    """The fields of ``message_cls``'s ``oneof`` by name, with their message types, read from the
    proto's descriptors: the kinds of call a Step call message carries (``oneof call``:
    ``verify``, ``decode``; ``propose``) and of result a result message (``oneof result``: the same
    and ``error``), so that a table keyed by kind can be checked against the proto."""
    kinds = {}
    for field in message_cls.DESCRIPTOR.oneofs_by_name[oneof].fields:
        assert isinstance(field.message_type, Descriptor), f"{field.name}: a Step oneof holds messages only"
        kinds[field.name] = message_factory.GetMessageClass(field.message_type)
    return kinds


class StepCalls:
    """Serves the Step streams of one service.

    Args:
        service: the full gRPC service name (``specdec.v1.VerifyService``), for span names.
        handlers: by the name of a call's ``oneof call`` field (``verify``, ``decode``,
            ``propose``): the :data:`Starter` that serves it, the same one its unary RPC calls
            (started on the stream's reading thread, see the module docstring).
        result_cls: the result message (``VerifyCallResult``, ``DraftCallResult``), whose ``oneof
            result`` has one field per handler, named alike, and ``error``.
        metrics: failed calls are counted in ``rpc_errors`` under the unary RPC's name.

    Raises ValueError when ``handlers`` and the result message's kinds (``oneof result`` less
    ``error``) differ: a kind of call without a starter, or a starter for a kind the proto lacks.

    The fault tests' hook, holding chosen calls back, wraps the starters before they come here
    (:func:`specdec.rpc.delay_hook.delayed_starters`).
    """

    def __init__(
        self,
        service: str,
        handlers: Mapping[str, Starter],
        result_cls: type[CallResult],
        metrics: ServiceMetrics,
    ):
        kinds = set(oneof_kinds(result_cls, "result")) - {"error"}
        if set(handlers) != kinds:
            raise ValueError(f"{service} Step starters {sorted(handlers)} differ from its calls {sorted(kinds)}")
        self.service, self.handlers, self.result_cls, self.metrics = service, handlers, result_cls, metrics

    def serve(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[list[Any]]:
        """Starts reading ``requests`` (the stream's incoming messages, each with ``calls``) and
        returns the outgoing messages' results: lists of results, each list one message, until the
        stream ends (see the module docstring)."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        outbox = Outbox(done.put)
        in_flight = _Counter()
        abandoned = lambda: not context.is_active()  # noqa: E731

        def read() -> None:
            try:
                for message in requests:
                    in_flight.add(len(message.calls))
                    for call in message.calls:
                        self._start(call, time.monotonic(), abandoned, outbox.put)
            except Exception:  # the caller went away (cancelled, connection lost)
                log.debug("a Step stream ended on the caller's side", exc_info=True)
            done.put([_END])

        threading.Thread(target=read, name="step-stream-reader", daemon=True).start()
        return _answers(done, in_flight, context)

    def _start(self, call: Any, received: float, abandoned: Callable[[], bool], put: Callable[[Message], None]) -> None:
        """Starts serving one call read at ``received`` (time.monotonic()); its result (or
        ``error``) is ``put`` once, now or from the thread that finishes it; never raises."""
        header, kind = call.header, call.WhichOneof("call")
        name = (kind or "unknown").capitalize()
        parent = propagate.extract(dict(header.trace_context)) if header.trace_context else None
        span = tracer.start_span(f"/{self.service}/{name}", context=parent, kind=trace.SpanKind.SERVER)

        def reply(outcome: Message | BaseException) -> None:
            put(self._result(header.call_id, kind, name, outcome))
            span.end()

        try:
            handler = self.handlers.get(kind or "")
            if handler is None:
                kinds = ", ".join(self.handlers)
                raise InvalidArgument(f"a Step call must set one of {kinds}; it set {kind or 'none'}")
            request = getattr(call, kind)

            timeout_s = _timeout_s(header.timeout_ms, received)
            if not span.is_recording():  # tracing off: no context to make current
                handler(request, timeout_s, abandoned, reply)
                return
            with trace.use_span(span):
                handler(request, timeout_s, abandoned, reply)
        except Exception as err:  # any failure is the call's result
            reply(err)

    def _result(self, call_id: int, kind: str | None, name: str, outcome: Message | BaseException) -> CallResult:
        """The result message of a call: its response, or the CallError its error maps to."""
        if isinstance(outcome, Message):
            result = self.result_cls(call_id=call_id)
            getattr(result, kind or "").CopyFrom(outcome)
            return result
        if isinstance(outcome, SpecdecError):
            error = common_pb2.CallError(code=outcome.code.value[0], message=str(outcome))
        else:  # a bug: the caller gets INTERNAL, the log the traceback
            log.error("a %s call of a Step stream failed", name, exc_info=outcome)
            error = common_pb2.CallError(code=grpc.StatusCode.INTERNAL.value[0], message=f"{name} failed: {outcome}")
        self.metrics.rpc_errors.labels(name, status_code(error.code).name).inc()
        return self.result_cls(call_id=call_id, error=error)


def wait_for_reply(start: Callable[[Callable[[Any], None]], None]) -> Any:
    """Runs a starter (``start(reply)``: a :data:`Starter` given its call, or any function that
    replies once the same way) and waits for its reply, from whichever thread: the response, or
    raises the error."""
    outcome: Future = Future()

    def reply(answer: Any) -> None:
        if isinstance(answer, BaseException):
            outcome.set_exception(answer)
        else:
            outcome.set_result(answer)

    start(reply)
    return outcome.result()


def _timeout_s(timeout_ms: float, received: float) -> float | None:
    """The seconds left of a call's deadline, its header's ``timeout_ms`` counted from
    ``received`` (time.monotonic() when the stream read it; the call may have waited for a thread
    of the pool since): 0 (unset) is none, as for a unary RPC without a deadline. Raises
    InvalidArgument for a negative or non-finite value."""
    if not math.isfinite(timeout_ms) or timeout_ms < 0:
        raise InvalidArgument(f"timeout_ms is {timeout_ms}: set the call's deadline in ms (> 0), or 0 for none")
    if timeout_ms == 0:
        return None
    return max(0.0, timeout_ms / 1000 - (time.monotonic() - received))


def _answers(done: queue.SimpleQueue, in_flight: "_Counter", context: grpc.ServicerContext) -> Iterator[list]:
    """Every result ready when the last message went out (``done`` holds lists of them, one per
    hand-off), as the next message, until the caller has closed its side and every call is
    answered, or the caller is gone."""
    ended = False
    while context.is_active() and not (ended and in_flight.value == 0):
        try:
            first = done.get(timeout=POLL_S)
        except queue.Empty:
            continue
        results = []
        for item in (item for handed in (first, *_drain(done)) for item in handed):
            if item is _END:
                ended = True
            else:
                results.append(item)
        in_flight.add(-len(results))
        if results:
            yield results


def _drain(items: queue.SimpleQueue) -> Iterator:
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return


class _Counter:
    """A thread-safe count (calls of a stream not yet answered)."""

    def __init__(self):
        self.value, self._lock = 0, threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n

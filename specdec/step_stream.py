"""The service end of a Step stream (``VerifyService.Step``, ``DraftService.Step``): many sessions'
per-round calls (Verify, Decode, Propose) over one long-lived stream per caller, instead of one
unary RPC per call (docs/architecture.md#the-serving-path-step-streams says why: the profile).

Each incoming message carries calls; each call runs in a thread of the service's call pool,
exactly as its unary RPC would (the same handler, its deadline from ``CallHeader.timeout_ms``, 0 for
none, its
span a child of the caller's from ``CallHeader.trace_context``), and its result or error
(``CallError``, the status code and message the unary RPC would fail with) goes back in the next
outgoing message. Outgoing messages take every result ready when one is sent: the calls of one
engine step finish together, so they usually travel together. The stream ends when the caller
closes its side and every call it sent has been answered, or at once when the caller goes away.
"""

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import propagate, trace

from specdec.errors import InvalidArgument, SpecdecError, status_code
from specdec.prom import ServiceMetrics
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# A handler: (request, timeout in seconds or None, abandoned() -> the caller went away) -> response.
Handler = Callable[[Any, float | None, Callable[[], bool]], Message]
_END = object()  # the caller closed its side of the stream
POLL_S = 1.0  # how often a stream waiting for results checks that its caller is still there, seconds


class StepCalls:
    """Serves the Step streams of one service.

    Args:
        service: the full gRPC service name (``specdec.v1.VerifyService``), for span names.
        handlers: by the name of a call's ``oneof call`` field (``verify``, ``decode``,
            ``propose``): the function that serves it, the same one its unary RPC calls.
        result_cls: the result message (``VerifyCallResult``, ``DraftCallResult``), whose ``oneof
            result`` has one field per handler, named alike, and ``error``.
        metrics: failed calls are counted in ``rpc_errors`` under the unary RPC's name.
        max_workers: calls served at once, over every stream of the service (a call holds a
            thread while it waits for its engine step).

    ``delays_s``: the fault tests' hook (:mod:`specdec.delay_hook`), set by the service: seconds
    each call of an RPC (by its name, ``Propose``) waits before it is handled; empty in production.
    """

    def __init__(
        self,
        service: str,
        handlers: Mapping[str, Handler],
        result_cls: type[Message],
        metrics: ServiceMetrics,
        max_workers: int,
    ):
        self.service, self.handlers, self.result_cls, self.metrics = service, handlers, result_cls, metrics
        self.delays_s: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="step-call")

    def serve(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[list[Any]]:
        """Starts reading ``requests`` (the stream's incoming messages, each with ``calls``) and
        returns the outgoing messages' results: lists of results, each list one message, until the
        stream ends (see the module docstring)."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        in_flight = _Counter()
        abandoned = lambda: not context.is_active()  # noqa: E731

        def answer(call: Any, received: float) -> None:
            done.put(self._run(call, received, abandoned))

        def read() -> None:
            try:
                for message in requests:
                    for call in message.calls:
                        in_flight.add(1)
                        self._pool.submit(answer, call, time.monotonic())
            except Exception:  # the caller went away (cancelled, connection lost)
                log.debug("a Step stream ended on the caller's side", exc_info=True)
            done.put(_END)

        threading.Thread(target=read, name="step-stream-reader", daemon=True).start()
        return _answers(done, in_flight, context)

    def _run(self, call: Any, received: float, abandoned: Callable[[], bool]) -> Message:
        """Serves one call read at ``received`` (time.monotonic()); never raises (a failure is the
        result's ``error``)."""
        header, kind = call.header, call.WhichOneof("call")
        name = (kind or "unknown").capitalize()
        parent = propagate.extract(dict(header.trace_context)) if header.trace_context else None
        with tracer.start_as_current_span(f"/{self.service}/{name}", context=parent, kind=trace.SpanKind.SERVER):
            try:
                handler = self.handlers.get(kind or "")
                if handler is None:
                    kinds = ", ".join(self.handlers)
                    raise InvalidArgument(f"a Step call must set one of {kinds}; it set {kind or 'none'}")
                timeout_s = _timeout_s(header.timeout_ms, received)
                if delay_s := self.delays_s.get(name):
                    time.sleep(delay_s)
                response = handler(getattr(call, kind), timeout_s, abandoned)
                return self.result_cls(call_id=header.call_id, **{kind: response})
            except SpecdecError as err:
                error = common_pb2.CallError(code=err.code.value[0], message=str(err))
            except Exception as err:  # a bug: the caller gets INTERNAL, the log the traceback
                log.exception("a %s call of a Step stream failed", name)
                error = common_pb2.CallError(code=grpc.StatusCode.INTERNAL.value[0], message=f"{name} failed: {err}")
        self.metrics.rpc_errors.labels(name, status_code(error.code).name).inc()
        return self.result_cls(call_id=header.call_id, error=error)


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
    """Every result ready when the last message went out, as the next message, until the caller
    has closed its side and every call is answered, or the caller is gone."""
    ended = False
    while context.is_active() and not (ended and in_flight.value == 0):
        try:
            first = done.get(timeout=POLL_S)
        except queue.Empty:
            continue
        results = []
        for item in (first, *_drain(done)):
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

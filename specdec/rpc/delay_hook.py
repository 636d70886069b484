"""A test hook for fault tests: hold chosen RPCs of a draft or verify service for a fixed time
before they are handled (unary calls: :class:`DelayCalls`; the calls of a Step stream:
:func:`delayed_starters`), so that a fault (a real SIGKILL or SIGSTOP of the process) finds those
calls in flight. Set by ``--debug-rpc-delay-ms METHOD=MS[,METHOD=MS]`` (for example
``Prefill=1000``); empty, the default, installs nothing. Not for production: it only slows a
service down."""

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import context as otel_context

from specdec.rpc.step_server import Starter


def parse_delays(pairs: list[str]) -> dict[str, float]:
    """``["Prefill=1000"]`` -> ``{"Prefill": 1.0}`` (seconds). Raises ValueError naming a pair
    that is not METHOD=MS with MS >= 0."""
    delays = {}
    for pair in pairs:
        method, _, ms = pair.partition("=")
        try:
            seconds = float(ms) / 1000
        except ValueError:
            seconds = -1.0
        if not method or seconds < 0:
            raise ValueError(f"debug_rpc_delay_ms: {pair!r} is not METHOD=MS with MS >= 0 (for example Prefill=1000)")
        delays[method] = seconds
    return delays


class DelayCalls(grpc.ServerInterceptor):
    """Sleeps ``delays[method]`` seconds in the handler thread before a unary call of ``method``
    (its short name, such as ``Prefill``) is handled."""

    def __init__(self, delays: dict[str, float]):
        self.delays = delays

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        delay_s = self.delays.get(handler_call_details.method.rsplit("/", 1)[-1])
        if handler is None or delay_s is None or handler.unary_unary is None:
            return handler
        method = handler.unary_unary

        def delayed(request, context):
            time.sleep(delay_s)
            return method(request, context)

        return handler._replace(unary_unary=delayed)


def delayed_starters(
    starters: Mapping[str, Starter], delays_s: dict[str, float], max_workers: int
) -> dict[str, Starter]:
    """``starters`` (a service's Step call starters, by the call's ``oneof`` field: ``propose``)
    with each call of an RPC in ``delays_s`` (by its name, ``Propose``; read at every call, so a
    test may change it) started ``delays_s[name]`` seconds later in a thread of a pool of
    ``max_workers``, its deadline still counted from its arrival and its trace context kept.
    ``delays_s`` empty: the starters as they are (production)."""
    if not delays_s:
        return dict(starters)
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix="step-call")

    def delayed(name: str, start: Starter) -> Starter:
        def starter(request, timeout_s, abandoned, reply) -> None:
            delay_s = delays_s.get(name)
            if delay_s is None:
                start(request, timeout_s, abandoned, reply)
                return
            context = otel_context.get_current()
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            pool.submit(_start_held, start, delay_s, deadline, context, (request, abandoned, reply))

        return starter

    return {kind: delayed(kind.capitalize(), start) for kind, start in starters.items()}


def _start_held(start: Starter, delay_s: float, deadline: float | None, context, call: tuple) -> None:
    """Starts a held call after ``delay_s``, in the trace ``context`` it arrived in."""
    request, abandoned, reply = call
    token = otel_context.attach(context)
    try:
        time.sleep(delay_s)
        start(request, None if deadline is None else max(0.0, deadline - time.monotonic()), abandoned, reply)
    except Exception as err:  # any failure is the call's result
        reply(err)
    finally:
        otel_context.detach(token)

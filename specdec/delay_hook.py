"""A test hook for fault tests: hold chosen RPCs of a draft or verify service for a fixed time
before they are handled (unary calls here; the calls of a Step stream in
:class:`specdec.step_stream.StepCalls`), so that a fault (a real SIGKILL or SIGSTOP of the process) finds those
calls in flight. Set by ``--debug-rpc-delay-ms METHOD=MS[,METHOD=MS]`` (for example
``Prefill=1000``); empty, the default, installs nothing. Not for production: it only slows a
service down."""

import time

import grpc


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

"""specdec/rpc/server.py: a server's port is its own, and calls past its bound on calls in progress
fail at once with RESOURCE_EXHAUSTED (the services' calls themselves: the service and end-to-end
tests; the coordinator's bound, kept by its interceptor, and every server's HTTP/2 connection
limits: tests/test_grpc_edge.py; a service whose engine loop dies: tests/test_liveness.py)."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.rpc.server import QUEUED_RPCS, service_max_concurrent_rpcs, start_aio_server, start_server


def no_services(server) -> list[str]:
    return []


def test_a_second_server_on_a_port_in_use_fails_to_start():
    first, port = start_server(no_services, "127.0.0.1", 0, max_workers=1)
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: another process holds the port"):
            start_server(no_services, "127.0.0.1", port, max_workers=1)

        async def start_coordinator_like():
            await start_aio_server(no_services, "127.0.0.1", port)

        with pytest.raises(OSError, match="choose another --port"):
            asyncio.run(start_coordinator_like())
        # a server with gRPC's default options (SO_REUSEPORT) cannot share it either
        other = grpc.server(ThreadPoolExecutor(max_workers=1))
        with pytest.raises(RuntimeError, match="Failed to bind"):
            other.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        first.stop(None)


WAIT = "/test.Blocking/Wait"


def blocking_service(handler):
    """A register function adding one unary method, ``WAIT``, served by ``handler``."""

    def register(server) -> list[str]:
        method = grpc.unary_unary_rpc_method_handler(handler)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Blocking", {"Wait": method})])
        return []

    return register


def refused_past(
    channel: grpc.Channel, held: int, in_handler: threading.Semaphore, wanted: int
) -> tuple[grpc.RpcError, list[grpc.Future]]:
    """Starts ``held`` calls that stay in progress (``wanted`` of them reach the handler, which
    releases ``in_handler``), then one more; returns its error and the calls held."""
    wait = channel.unary_unary(WAIT)
    pending = [wait.future(b"", timeout=20) for _ in range(held)]
    for _ in range(wanted):
        assert in_handler.acquire(timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        wait(b"", timeout=5)
    return refused.value, pending


def test_calls_past_the_bound_fail_at_once_with_resource_exhausted():
    """One handler thread and a bound of two: the first call runs, the second waits for the thread,
    the third is refused at once; then the first two finish. The draft and verify services' bound:
    their handler threads and QUEUED_RPCS."""
    release, in_handler = threading.Event(), threading.Semaphore(0)

    def handler(request, context):
        in_handler.release()
        release.wait(20)
        return b""

    server, port = start_server(blocking_service(handler), "127.0.0.1", 0, max_workers=1, maximum_concurrent_rpcs=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            error, pending = refused_past(channel, 2, in_handler, 1)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            assert [call.result() for call in pending] == [b"", b""]
    finally:
        server.stop(None)
    assert service_max_concurrent_rpcs(24) == 24 + QUEUED_RPCS

"""specdec/server.py: a server's port is its own (the services' calls themselves: the service and
end-to-end tests)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.server import start_aio_server, start_server


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

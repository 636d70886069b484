"""gRPC server plumbing shared by the three services: message limits, INVALID_ARGUMENT for
requests that do not parse (:mod:`specdec.decoding`), the standard health service, server
reflection (so grpcurl works), TLS from the ``tls_*`` settings (see :mod:`specdec.tls`) and
graceful shutdown on SIGTERM / SIGINT."""

import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import tls
from specdec.decoding import AioRejectUndecodable, RejectUndecodable
from specdec.delay_hook import DelayCalls, parse_delays
from specdec.prom import ServiceMetrics

log = logging.getLogger(__name__)

# The default of the services' max_message_bytes setting: sampling proposals carry K draft
# distributions over the vocabulary (up to K * V * 8 bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    """Options of every server and channel: messages up to ``max_message_bytes`` each way, or up to
    ``max_receive_bytes`` received when given (a larger one fails with RESOURCE_EXHAUSTED); gRPC's
    own default receive limit is 4 MiB."""
    receive = max_message_bytes if max_receive_bytes is None else max_receive_bytes
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", receive)]


def server_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None
) -> list[tuple[str, int]]:
    """A server's options: :func:`grpc_options`, and its port its own. gRPC servers set
    SO_REUSEPORT by default, so a second server on a port in use bound it too and took a share of
    its connections, silently; without it, the second fails to start (:func:`_add_port`)."""
    return [*grpc_options(max_message_bytes, max_receive_bytes), ("grpc.so_reuseport", 0)]


GRPC_OPTIONS = grpc_options()  # for clients that do not know the server's setting: its default
SHUTDOWN_GRACE_S = 10.0


def _serving_health(server, service_names: list[str], servicer_cls=health.HealthServicer):
    servicer = servicer_cls()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def server_credentials(settings) -> grpc.ServerCredentials | None:
    """TLS credentials from a :class:`specdec.settings.ServiceSettings`' ``tls_*`` files (mutual
    TLS with ``tls_client_ca_file``), re-read when they change; None (plaintext) when unset.
    Raises TLSFileError naming the setting of an unusable file."""
    if not settings.tls_cert_file:
        return None
    return tls.server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)


def _add_port(server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``host:port`` (port 0: any free one); returns the port. Raises OSError when the port
    is in use or the host is not an address of this machine."""
    address = f"{host}:{port}"
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as err:  # grpcio's "Failed to bind to address ..."
        raise OSError(
            f"cannot listen on {address}: another process holds the port, or {host} is not an address of "
            "this machine; choose another --port or --host"
        ) from err


def start_server(
    register: Callable[[grpc.Server], list[str]],
    host: str,
    port: int,
    max_workers: int,
    credentials: grpc.ServerCredentials | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    rpc_delays_s: dict[str, float] | None = None,
) -> tuple[grpc.Server, int]:
    """Starts a threaded gRPC server with health and reflection.

    ``register`` adds the servicers and returns their full service names; ``credentials`` (see
    :func:`server_credentials`): TLS, None for plaintext; ``rpc_delays_s``: the fault tests' hook
    (:mod:`specdec.delay_hook`). Returns the started server and its bound port (useful when
    ``port`` is 0). Every service reports SERVING.
    """
    interceptors: list[grpc.ServerInterceptor] = [RejectUndecodable()]
    if rpc_delays_s:
        interceptors.append(DelayCalls(rpc_delays_s))
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers),
        options=server_options(max_message_bytes),
        interceptors=interceptors,
    )
    names = register(server)
    health_servicer = _serving_health(server, names)
    bound = _add_port(server, host, port, credentials)
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(names), host, bound, "TLS" if credentials else "plaintext")
    return server, bound


class _Servicer(Protocol):
    metrics: ServiceMetrics


@dataclass
class RunningService:
    """A started draft or verify service: its server, bound port, servicer and janitor."""

    server: grpc.Server
    port: int
    servicer: _Servicer  # the DraftServicer or VerifyServicer
    janitor: threading.Event

    def stop(self, grace_s: float | None = None) -> None:
        self.janitor.set()
        self.server.stop(grace_s).wait()
        self.servicer.metrics.close()

    def serve_until_signal(self) -> None:
        """Blocks until SIGTERM or SIGINT, then stops accepting calls and lets in-flight ones
        finish (up to SHUTDOWN_GRACE_S seconds)."""

        def on_signal(signum, _frame):
            log.info("signal %d: shutting down", signum)
            self.janitor.set()
            self.server.stop(SHUTDOWN_GRACE_S)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.server.wait_for_termination()


async def start_aio_server(
    register: Callable[[grpc.aio.Server], list[str]],
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Asyncio twin of :func:`start_server`; requests up to ``max_receive_bytes`` when given."""
    server = grpc.aio.server(
        options=server_options(max_message_bytes, max_receive_bytes), interceptors=[AioRejectUndecodable()]
    )
    names = register(server)
    health_servicer = _serving_health(server, names, health.aio.HealthServicer)
    bound = _add_port(server, host, port, credentials)
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(names), host, bound, "TLS" if credentials else "plaintext")
    return server, bound


def start_service(servicer, add_to_server, service_name: str, sessions, settings) -> RunningService:
    """Starts a session-holding service (draft or verify), its idle-session janitor and its
    Prometheus endpoint.

    ``add_to_server`` is the generated ``add_<Service>Servicer_to_server``; ``service_name`` the
    full name reflection and health report; ``sessions`` the servicer's
    :class:`specdec.sessions.SessionRegistry`, exported by ``servicer.metrics`` (a
    :class:`specdec.prom.ServiceMetrics`) on ``settings.metrics_port``; ``settings`` a
    :class:`specdec.settings.SessionServiceSettings`.
    """

    def register(server):
        add_to_server(servicer, server)
        return [service_name]

    server, port = start_server(
        register,
        settings.host,
        settings.port,
        settings.max_workers,
        server_credentials(settings),
        settings.max_message_bytes,
        parse_delays(settings.debug_rpc_delay_ms),
    )
    janitor = sessions.start_janitor(max(1.0, settings.session_idle_timeout_s / 10))
    servicer.metrics.track_sessions(sessions)
    servicer.metrics.serve(settings.host, settings.metrics_port)
    return RunningService(server, port, servicer, janitor)

"""gRPC server plumbing shared by the three services: message limits, INVALID_ARGUMENT for
requests that do not parse (:mod:`specdec.rpc.decoding`), the standard health service, server
reflection (so grpcurl works), TLS from the ``tls_*`` settings (see :mod:`specdec.rpc.tls`), HTTP/2
connection limits from the ``grpc_*`` settings (:func:`connection_options`), for the draft and verify
services a bound on the calls in progress (``maximum_concurrent_rpcs``: one more fails at once with
RESOURCE_EXHAUSTED, gRPC's own behaviour, instead of queueing without bound; the coordinator bounds
its own: :mod:`coordinator.api.grpc_auth`), graceful shutdown on SIGTERM / SIGINT, and, for the
draft and verify services, NOT_SERVING and an exit with :data:`EXIT_FATAL` when a thread they depend
on dies (:class:`Liveness`)."""

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import startup_heap
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc import tls
from specdec.rpc.decoding import AioRejectUndecodable, RejectUndecodable
from specdec.rpc.delay_hook import DelayCalls, parse_delays

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
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
    connection: Iterable[tuple[str, int]] = (),
) -> list[tuple[str, int]]:
    """A server's options: :func:`grpc_options`, its ``connection`` limits
    (:func:`connection_options`), and its port its own. gRPC servers set SO_REUSEPORT by default, so
    a second server on a port in use bound it too and took a share of its connections, silently;
    without it, the second fails to start (:func:`_add_port`)."""
    return [*grpc_options(max_message_bytes, max_receive_bytes), *connection, ("grpc.so_reuseport", 0)]


def connection_options(settings) -> list[tuple[str, int]]:
    """The HTTP/2 connection limits of a service's gRPC server, from a
    :class:`specdec.settings.ServiceSettings`' ``grpc_*`` settings (seconds; gRPC takes ms): streams
    per connection, how long a connection may stay idle and live, how often the server pings an
    idle one to find a dead peer, and how often a client may ping (docs/limits.md#grpc-connections)."""

    def ms(seconds: float) -> int:
        return round(seconds * 1000)

    options = [
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.keepalive_time_ms", ms(settings.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(settings.grpc_keepalive_timeout_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(settings.grpc_min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", settings.grpc_max_ping_strikes),
    ]
    if settings.grpc_max_connection_idle_s:
        options.append(("grpc.max_connection_idle_ms", ms(settings.grpc_max_connection_idle_s)))
    if settings.grpc_max_connection_age_s:
        options.append(("grpc.max_connection_age_ms", ms(settings.grpc_max_connection_age_s)))
        options.append(("grpc.max_connection_age_grace_ms", ms(settings.grpc_max_connection_age_grace_s)))
    return options


GRPC_OPTIONS = grpc_options()  # for clients that do not know the server's setting: its default
SHUTDOWN_GRACE_S = 10.0
# Calls a draft or verify service takes beyond its max_workers handler threads, waiting for one:
# health checks and Releases (quick) wait for a thread rather than fail while every thread is busy.
QUEUED_RPCS = 16
EXIT_FATAL = 70  # a service's exit code when a thread it depends on died (BSD's EX_SOFTWARE)
FATAL_GRACE_S = 1.0  # in-flight calls' time to finish before such a service exits


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
    maximum_concurrent_rpcs: int | None = None,
    connection: Iterable[tuple[str, int]] = (),
) -> tuple[grpc.Server, int]:
    """Starts a threaded gRPC server with health and reflection.

    ``register`` adds the servicers and returns their full service names; ``credentials`` (see
    :func:`server_credentials`): TLS, None for plaintext; ``rpc_delays_s``: the fault tests' hook
    (:mod:`specdec.rpc.delay_hook`); ``maximum_concurrent_rpcs``: calls in progress at most (served
    by the ``max_workers`` handler threads or waiting for one; None: no bound), one more fails at
    once with RESOURCE_EXHAUSTED; ``connection``: HTTP/2 connection limits (:func:`connection_options`).
    Returns the started server and its bound port (useful when ``port`` is 0). Every service reports
    SERVING.
    """
    server, bound, _ = _start_server(
        register,
        host,
        port,
        max_workers,
        credentials,
        max_message_bytes,
        rpc_delays_s,
        maximum_concurrent_rpcs,
        connection,
    )
    return server, bound


def _start_server(
    register: Callable[[grpc.Server], list[str]],
    host: str,
    port: int,
    max_workers: int,
    credentials: grpc.ServerCredentials | None,
    max_message_bytes: int,
    rpc_delays_s: dict[str, float] | None,
    maximum_concurrent_rpcs: int | None,
    connection: Iterable[tuple[str, int]],
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """:func:`start_server`, returning its health servicer too."""
    interceptors: list[grpc.ServerInterceptor] = [RejectUndecodable()]
    if rpc_delays_s:
        interceptors.append(DelayCalls(rpc_delays_s))
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers),
        options=server_options(max_message_bytes, connection=connection),
        interceptors=interceptors,
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    names = register(server)
    health_servicer = _serving_health(server, names)
    bound = _add_port(server, host, port, credentials)
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(names), host, bound, "TLS" if credentials else "plaintext")
    return server, bound, health_servicer


class _Servicer(Protocol):
    metrics: ServiceMetrics


class _Watched(Protocol):
    """A thread the service cannot go on without: an engine loop (:meth:`specdec.engine.engine.Engine.watch`)."""

    def watch(self, on_fatal: Callable[[str, BaseException], None], step_timeout_s: float = 0.0) -> None: ...


class Liveness:
    """Whether a draft or verify service may go on. A thread it depends on (an engine loop, the
    idle-session janitor) that dies, or an engine step that runs past ``engine_step_timeout_s``,
    calls :meth:`fatal`: the service then reports NOT_SERVING on
    the gRPC health service (a kubelet's probe, ``specdec up``'s readiness check) and its process
    exits with :data:`EXIT_FATAL` (:meth:`RunningService.serve_until_signal`), so that its
    supervisor (``specdec up``, the kubelet) restarts it; the coordinator meanwhile rebuilds its
    sessions from the committed logs (verify) or goes on without the draft."""

    def __init__(self, health_servicer: health.HealthServicer):
        self._health = health_servicer
        self.failed = threading.Event()
        self.failure = ""  # what died, once it did

    def fatal(self, what: str, err: BaseException) -> None:
        """``what`` ("the verify engine loop") died of ``err`` (its traceback logged by its thread)."""
        log.critical(
            "%s died (%r): the service reports NOT_SERVING and exits with code %d, for its supervisor to restart it",
            what,
            err,
            EXIT_FATAL,
        )
        self.failure = f"{what} died: {err!r}"
        self._health.enter_graceful_shutdown()
        self.failed.set()


@dataclass
class RunningService:
    """A started draft or verify service: its server, bound port, servicer, janitor and liveness."""

    server: grpc.Server
    port: int
    servicer: _Servicer  # the DraftServicer or VerifyServicer
    janitor: threading.Event
    liveness: Liveness

    def stop(self, grace_s: float | None = None) -> None:
        self.janitor.set()
        self.server.stop(grace_s).wait()
        self.servicer.metrics.close()

    def serve_until_signal(self) -> None:
        """The service's process from the end of its start-up: freezes the start-up heap
        (:mod:`specdec.startup_heap`), then blocks until SIGTERM or SIGINT, then stops accepting
        calls and lets in-flight ones finish (up to SHUTDOWN_GRACE_S seconds). Should a thread the
        service depends on die (:class:`Liveness`), stops within FATAL_GRACE_S instead and ends the
        process with EXIT_FATAL (``os._exit``: a handler thread left waiting on a dead engine must
        not keep it)."""
        startup_heap.freeze()

        def on_signal(signum, _frame):
            log.info("signal %d: shutting down", signum)
            self.janitor.set()
            self.server.stop(SHUTDOWN_GRACE_S)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while self.server.wait_for_termination(timeout=0.5):  # True: still serving
            if self.liveness.failed.is_set():
                self.janitor.set()
                self.server.stop(FATAL_GRACE_S).wait()
                log.critical("exiting with code %d: %s", EXIT_FATAL, self.liveness.failure)
                logging.shutdown()
                os._exit(EXIT_FATAL)


async def start_aio_server(
    register: Callable[[grpc.aio.Server], list[str]],
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    connection: Iterable[tuple[str, int]] = (),
) -> tuple[grpc.aio.Server, int]:
    """Asyncio twin of :func:`start_server`, for the coordinator's public server: requests up to
    ``max_receive_bytes`` when given; ``interceptors`` run first, before the one that answers an
    undecodable request (the coordinator's checks API keys and bounds its calls:
    :mod:`coordinator.api.grpc_auth`); ``connection``: HTTP/2 connection limits
    (:func:`connection_options`)."""
    server = grpc.aio.server(
        options=server_options(max_message_bytes, max_receive_bytes, connection),
        interceptors=[*interceptors, AioRejectUndecodable()],
    )
    names = register(server)
    health_servicer = _serving_health(server, names, health.aio.HealthServicer)
    bound = _add_port(server, host, port, credentials)
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(names), host, bound, "TLS" if credentials else "plaintext")
    return server, bound


def service_max_concurrent_rpcs(max_workers: int) -> int:
    """A draft or verify service's ``maximum_concurrent_rpcs``: its handler threads
    (``max_workers``: a thread per session and a few for GetInfo, Release, health checks and Step
    streams) and :data:`QUEUED_RPCS` calls waiting for one; past that, RESOURCE_EXHAUSTED at once."""
    return max_workers + QUEUED_RPCS


def start_service(
    servicer, add_to_server, service_name: str, sessions, settings, engines: Iterable[_Watched] = ()
) -> RunningService:
    """Starts a session-holding service (draft or verify), its idle-session janitor and its
    Prometheus endpoint, and watches its ``engines`` (their loops, and their steps against
    ``settings.engine_step_timeout_s``) and janitor (:class:`Liveness`).

    ``add_to_server`` is the generated ``add_<Service>Servicer_to_server``; ``service_name`` the
    full name reflection and health report; ``sessions`` the servicer's
    :class:`specdec.rpc.sessions.SessionRegistry`, exported by ``servicer.metrics`` (a
    :class:`specdec.observability.prometheus.ServiceMetrics`) on ``settings.metrics_port``; ``settings`` a
    :class:`specdec.settings.SessionServiceSettings` (its ``max_workers`` also bounds the calls in
    progress: :func:`service_max_concurrent_rpcs`).
    """

    def register(server):
        add_to_server(servicer, server)
        return [service_name]

    server, port, health_servicer = _start_server(
        register,
        settings.host,
        settings.port,
        settings.max_workers,
        server_credentials(settings),
        settings.max_message_bytes,
        parse_delays(settings.debug_rpc_delay_ms),
        service_max_concurrent_rpcs(settings.max_workers),
        connection_options(settings),
    )
    liveness = Liveness(health_servicer)
    janitor = sessions.start_janitor(max(1.0, settings.session_idle_timeout_s / 10), liveness.fatal)
    for engine in engines:
        engine.watch(liveness.fatal, settings.engine_step_timeout_s)
    servicer.metrics.track_sessions(sessions)
    servicer.metrics.serve(settings.host, settings.metrics_port)
    return RunningService(server, port, servicer, janitor, liveness)

"""Starts the verify, draft and coordinator services as separate OS processes on this machine
and waits until each reports SERVING on the standard gRPC health service (``specdec up``); with
certificates (:mod:`specdec_app.local_ca`), mutual TLS between them and TLS on the public APIs,
and ``--insecure`` where a service would otherwise refuse to start (:attr:`LocalCluster.insecure`).
:class:`Supervisor` then restarts a service that exits, while the others keep serving."""

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from specdec.rpc.health_check import SERVING, health_status
from specdec.rpc.tls import channel_credentials

if TYPE_CHECKING:  # imported for the annotation only: cryptography takes a tenth of a second to load
    from specdec_app.local_ca import LocalCertificates

log = logging.getLogger(__name__)


_handed_out: set[int] = set()  # every port free_port returned in this process
_handed_out_lock = threading.Lock()
PORT_BLOCK = 64  # SPECDEC_PORT_PARTITION shares ports out in blocks of this many (free_port)


def free_port() -> int:
    """A TCP port that is free on localhost right now and that no earlier call in this process
    returned. The kernel may give a port it just released again, and the processes given ports are
    started only later: a test fleet once got the same port for a coordinator and its draft
    service, both bound it (gRPC's default SO_REUSEPORT), and the coordinator's draft calls went
    half to the other coordinator ("Method not found"). Servers now refuse a port in use
    (:func:`specdec.rpc.server.server_options`), so such a collision fails to start instead.

    Several processes handing out ports at once (the test suite's workers, tests/conftest.py) set
    ``SPECDEC_PORT_PARTITION`` to ``i/n``: this process (and its children, which inherit it) then
    takes only ports in blocks of 64 whose number is i modulo n (blocks, not the port's own
    residue: a kernel may give ``bind`` ports of one parity only, as this project's hosts do), so
    it never hands out a port another took and has not bound yet. Raises ValueError for a
    malformed partition."""
    index, count = _port_partition(os.environ.get("SPECDEC_PORT_PARTITION", ""))
    with _handed_out_lock:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if (port // PORT_BLOCK) % count == index and port not in _handed_out:
                _handed_out.add(port)
                return port


def _port_partition(value: str) -> tuple[int, int]:
    """``(i, n)`` of a ``SPECDEC_PORT_PARTITION`` value ``"i/n"`` (0 <= i < n); ``(0, 1)`` for ""."""
    if not value:
        return 0, 1
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"SPECDEC_PORT_PARTITION={value!r}: give i/n with 0 <= i < n, as 1/2")
    return int(index), int(count)


def is_serving(address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True if ``address`` answers the gRPC health check with SERVING (over TLS with ``credentials``)."""
    try:
        return health_status(address, timeout_s=timeout_s, credentials=credentials) == SERVING
    except grpc.RpcError:
        return False


# Environment a service gets unless this process's sets the variable. The draft: llama.cpp's (and
# torch's) OpenMP workers sleep between forwards instead of spinning (libgomp's default spins
# about 300,000 times first): on one machine they share the target's cores, which the spinning took.
SERVICE_ENV = {"draft": {"OMP_WAIT_POLICY": "PASSIVE"}}


def service_env(service: str) -> dict[str, str]:
    """The variables of :data:`SERVICE_ENV` that ``service`` gets: those this process's
    environment does not set."""
    return {name: value for name, value in SERVICE_ENV.get(service, {}).items() if name not in os.environ}


def configured_api_key() -> str | None:
    """The first API key a coordinator started from this environment requires (its
    ``SPECDEC_API_KEYS``, ``SPECDEC_COORDINATOR_API_KEYS`` or ``SPECDEC_COORDINATOR_API_KEY_FILE``);
    None when it requires none. Raises ValueError when the key file cannot be read."""
    from coordinator.settings import CoordinatorSettings

    keys = CoordinatorSettings(insecure=True).api_keys  # insecure: read the keys, even none
    return keys[0] if keys else None


def coordinator_has_keys() -> bool:
    """Whether a coordinator started from this environment requires API keys; also True when its
    key file cannot be read: that coordinator refuses to start, saying why."""
    try:
        return configured_api_key() is not None
    except ValueError:
        return True


@dataclass
class ServiceProcess:
    """One service (``coordinator``, ``draft`` or ``verify``) as an OS process: ``specdec serve
    <service> --host <host> --port <port> [--metrics-port <metrics_port>] <args>`` in this
    process's environment plus ``env``, logging to ``log_file`` (None: this terminal), on the
    CPUs ``cpus`` (empty: every CPU this process may use). A coordinator also gets
    ``--http-port <http_port>`` (0: its HTTP API off). ``credentials``: TLS for the health check
    (None: plaintext)."""

    service: str
    port: int
    host: str = "127.0.0.1"
    args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    log_file: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    http_port: int = 0
    cpus: frozenset[int] = frozenset()
    credentials: grpc.ChannelCredentials | None = None
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def started(self) -> subprocess.Popen:
        """The process; raises RuntimeError before :meth:`start`."""
        if self.process is None:
            raise RuntimeError(f"the {self.service} service was never started")
        return self.process

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint, None when off."""
        return f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else None

    def start(self) -> None:
        """Starts (or restarts) the process."""
        out = None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_file, "ab")  # noqa: SIM115 (owned by the child)
        args = ["--host", self.host, "--port", str(self.port)]
        if self.service == "coordinator":
            args += ["--http-port", str(self.http_port)]
        args += self.args
        if self.metrics_port:
            args += ["--metrics-port", str(self.metrics_port)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdec_app", "serve", self.service, *args],
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**os.environ, **self.env},
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )

    def wait_serving(self, deadline: float) -> None:
        """Waits until SERVING. Raises RuntimeError if the process exits or time.monotonic()
        passes ``deadline`` first."""
        hint = f" (see {self.log_file})" if self.log_file else ""
        while not is_serving(self.address, credentials=self.credentials):
            if self.started.poll() is not None:
                raise RuntimeError(f"the {self.service} service exited with code {self.started.returncode}{hint}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.service} service at {self.address} was not SERVING in time{hint}")
            time.sleep(0.5)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, as a node failure would: no shutdown, no draining."""
        self.signal(signal.SIGKILL)
        self.started.wait()

    def exit_status(self) -> str | None:
        """None while the process runs (or was never started), else how it ended, e.g. ``exit
        code 1`` or ``killed by SIGKILL``."""
        code = self.process.poll() if self.process is not None else None
        if code is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def wait_stopped(self, deadline: float) -> None:
        """Waits for the process to exit until time.monotonic() passes ``deadline``, then kills it."""
        try:
            self.started.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class LocalCluster:
    """The three services on ``host``. ``extra_args`` adds flags per service (``verify``, ``draft``,
    ``coordinator``); ``metrics_ports`` their Prometheus ports (absent or 0: off); ``http_port`` the
    coordinator's HTTP API (0: off); ``cpus`` the CPUs a service is pinned to (absent: all); with
    ``log_dir`` each service logs to ``<log_dir>/<service>.log`` instead of this terminal; with
    ``tls`` the draft and verify services take only the coordinator's client certificate, and the
    coordinator serves its public APIs over TLS (every certificate signed by ``tls.ca_file``).
    Services that would otherwise refuse to start get ``--insecure`` (:attr:`insecure`)."""

    coordinator_port: int = 50051
    draft_port: int = 50052
    verify_port: int = 50053
    host: str = "127.0.0.1"
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)
    http_port: int = 0
    cpus: dict[str, frozenset[int]] = field(default_factory=dict)
    tls: "LocalCertificates | None" = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: service.started for name, service in self.services.items()}

    def address(self, service: str) -> str:
        return f"{self.host}:{getattr(self, f'{service}_port')}"

    def metrics_url(self, service: str) -> str | None:
        """The started service's Prometheus endpoint, None when off."""
        return self.services[service].metrics_url

    @property
    def http_url(self) -> str | None:
        """Base URL of the coordinator's OpenAI-compatible API, None when off."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.http_port}/v1" if self.http_port else None

    @property
    def insecure(self) -> list[str]:
        """The services started with ``--insecure``, each of which refuses to start without it
        here: the draft and verify services without ``tls`` (no mutual TLS), the coordinator when
        this environment gives it no API key."""
        internal = [] if self.tls else ["draft", "verify"]
        return internal if coordinator_has_keys() else ["coordinator", *internal]

    def tls_args(self, service: str) -> list[str]:
        """The TLS flags ``service`` starts with (none without ``tls``)."""
        if self.tls is None:
            return []
        args = ["--tls-cert-file", str(self.tls.server_cert_file), "--tls-key-file", str(self.tls.server_key_file)]
        if service == "coordinator":
            return [
                *args,
                "--internal-tls-ca-file",
                str(self.tls.ca_file),
                "--internal-tls-cert-file",
                str(self.tls.client_cert_file),
                "--internal-tls-key-file",
                str(self.tls.client_key_file),
            ]
        return [*args, "--tls-client-ca-file", str(self.tls.ca_file)]

    def service_process(self, service: str) -> ServiceProcess:
        """``service`` as :meth:`start` runs it, not started."""
        args = (
            ["--draft-address", self.address("draft"), "--verify-addresses", self.address("verify")]
            if service == "coordinator"
            else []
        )
        security = [*self.tls_args(service), *(["--insecure"] if service in self.insecure else [])]
        credentials = None
        if self.tls:
            tls = self.tls
            credentials = channel_credentials(str(tls.ca_file), str(tls.client_cert_file), str(tls.client_key_file))
        return ServiceProcess(
            service,
            getattr(self, f"{service}_port"),
            self.host,
            [*args, *security, *self.extra_args.get(service, [])],
            self.metrics_ports.get(service, 0),
            self.log_dir / f"{service}.log" if self.log_dir else None,
            env=service_env(service),
            http_port=self.http_port,
            cpus=self.cpus.get(service, frozenset()),
            credentials=credentials,
        )

    def start(self, service: str) -> None:
        """Starts (or restarts) one service process."""
        self.services[service] = self.service_process(service)
        self.services[service].start()

    def start_all(self, timeout_s: float = 600.0) -> None:
        """Starts all three and waits until every one is SERVING. Raises RuntimeError if one exits
        or ``timeout_s`` (seconds, covering model loading) passes first; then, or when interrupted
        (KeyboardInterrupt), every service started is stopped before it raises."""
        try:
            for service in ("verify", "draft", "coordinator"):
                self.services[service] = self.service_process(service)
            start_all(self.services.values(), timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every service (they drain in-flight calls), SIGKILL after ``grace_s``."""
        stop_all(self.services.values(), grace_s)


def start_all(services: Iterable[ServiceProcess], timeout_s: float) -> None:
    """Starts every service, then waits until each is SERVING (they load their models side by
    side). Raises RuntimeError when one exits or is not SERVING within ``timeout_s`` seconds; the
    caller stops them (:func:`stop_all`)."""
    services = list(services)
    for service in services:
        service.start()
    deadline = time.monotonic() + timeout_s
    for service in services:
        service.wait_serving(deadline)


def stop_all(services: Iterable[ServiceProcess], grace_s: float = 15.0) -> None:
    """SIGTERM to every service (they drain in-flight calls), SIGKILL to those still running
    after ``grace_s`` seconds."""
    services = list(services)
    for service in services:
        service.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in services:
        service.wait_stopped(deadline)


@dataclass
class RestartPolicy:
    """How :class:`Supervisor` restarts a service that exited: after ``backoff_s`` seconds, doubled
    for each restart in a row up to ``max_backoff_s`` (the count starts again once the service
    has run ``healthy_after_s`` seconds); at most ``max_per_minute`` restarts of one service in
    any 60 s, after which the service is left down (as systemd's StartLimitBurst does) and the
    others keep serving."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_per_minute: int = 5
    healthy_after_s: float = 60.0


@dataclass
class _Restarts:
    """One service's restart history."""

    times: list[float] = field(default_factory=list)  # time.monotonic() of each restart
    in_a_row: int = 0
    due_at: float | None = None  # when the next restart is due; None: the service is not down
    started_at: float = field(default_factory=time.monotonic)
    given_up: bool = False
    back: bool = True  # False from a restart until the service is SERVING again


class Supervisor:
    """Keeps a started :class:`LocalCluster`'s services running: a service whose process exits
    (crash, SIGKILL, out of memory) is started again on the same port under ``policy``, and each
    exit, restart and return to SERVING is logged (logger ``specdec_app.launcher``) with the restart
    count and the seconds the service was down. The other services are not touched: the
    coordinator goes on without the draft service (plain decode) and rebuilds sessions on a
    restarted verify service from its committed log. :meth:`run` returns only on Ctrl-C or SIGTERM
    (KeyboardInterrupt); stopping the services is the caller's (:meth:`LocalCluster.stop`)."""

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy | None = None):
        self.cluster, self.policy = cluster, policy or RestartPolicy()
        self._restarts = {name: _Restarts() for name in cluster.services}
        self._down_since: dict[str, float] = {}

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by service."""
        return {name: len(history.times) for name, history in self._restarts.items()}

    def run(self, poll_interval_s: float = 0.5) -> None:
        """Watches the services until KeyboardInterrupt (Ctrl-C, or SIGTERM mapped to it)."""
        while True:
            self.poll()
            time.sleep(poll_interval_s)

    def poll(self) -> None:
        """One pass over the services: notes exits, restarts those whose backoff has passed, and
        logs those back to SERVING."""
        now = time.monotonic()
        for name, service in self.cluster.services.items():
            history = self._restarts[name]
            status = service.exit_status()
            if status is not None and history.due_at is None and not history.given_up:
                self._exited(name, status, history, now)
            elif history.due_at is not None and now >= history.due_at:
                self._restart(name, history, now)
            elif not history.back and status is None and is_serving(service.address, 0.2, service.credentials):
                history.back = True
                log.warning(
                    "%s service SERVING again, %.1f s after it went down", name, now - self._down_since.pop(name)
                )

    def _exited(self, name: str, status: str, history: _Restarts, now: float) -> None:
        self._down_since.setdefault(name, now)
        if now - history.started_at >= self.policy.healthy_after_s:
            history.in_a_row = 0
        recent = [t for t in history.times if now - t < 60.0]
        if len(recent) >= self.policy.max_per_minute:
            history.given_up = True
            log.error(
                "%s service exited (%s); it was restarted %d times in the last minute (the limit): left "
                "down, the other services keep serving",
                name,
                status,
                len(recent),
            )
            return
        delay = min(self.policy.backoff_s * 2**history.in_a_row, self.policy.max_backoff_s)
        history.due_at = now + delay
        log.warning("%s service exited (%s); restarting it in %g s", name, status, delay)

    def _restart(self, name: str, history: _Restarts, now: float) -> None:
        history.times.append(now)
        history.in_a_row += 1
        history.due_at, history.started_at, history.back = None, now, False
        self.cluster.services[name].start()
        log.warning(
            "%s service restarted (restart %d, pid %d)",
            name,
            len(history.times),
            self.cluster.services[name].started.pid,
        )

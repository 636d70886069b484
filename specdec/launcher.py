"""Starts the verify, draft and coordinator services as separate OS processes on this machine
and waits until each reports SERVING on the standard gRPC health service (``specdec up``); with
certificates (:mod:`specdec.local_ca`), mutual TLS between them and TLS on the public APIs."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.local_ca import LocalCertificates
from specdec.server import GRPC_OPTIONS
from specdec.tls import channel_credentials


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_serving(address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True if ``address`` answers the gRPC health check with SERVING (over TLS with ``credentials``)."""
    if credentials:
        channel = grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


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
            [sys.executable, "-m", "specdec", "serve", self.service, *args],
            stdout=out, stderr=subprocess.STDOUT if out else None, env={**os.environ, **self.env},
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )

    def wait_serving(self, deadline: float) -> None:
        """Waits until SERVING. Raises RuntimeError if the process exits or time.monotonic()
        passes ``deadline`` first."""
        hint = f" (see {self.log_file})" if self.log_file else ""
        while not is_serving(self.address, credentials=self.credentials):
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.service} service exited with code {self.process.returncode}{hint}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.service} service at {self.address} was not SERVING in time{hint}")
            time.sleep(0.5)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, as a node failure would: no shutdown, no draining."""
        self.signal(signal.SIGKILL)
        self.process.wait()

    def wait_stopped(self, deadline: float) -> None:
        """Waits for the process to exit until time.monotonic() passes ``deadline``, then kills it."""
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class LocalCluster:
    """The three services on ``host``. ``extra_args`` adds flags per service (``verify``, ``draft``,
    ``coordinator``); ``metrics_ports`` their Prometheus ports (absent or 0: off); ``http_port`` the
    coordinator's HTTP API (0: off); ``cpus`` the CPUs a service is pinned to (absent: all); with
    ``log_dir`` each service logs to ``<log_dir>/<service>.log`` instead of this terminal; with
    ``tls`` the draft and verify services take only the coordinator's client certificate, and the
    coordinator serves its public APIs over TLS (every certificate signed by ``tls.ca_file``)."""

    coordinator_port: int = 50051
    draft_port: int = 50052
    verify_port: int = 50053
    host: str = "127.0.0.1"
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)
    http_port: int = 0
    cpus: dict[str, frozenset[int]] = field(default_factory=dict)
    tls: LocalCertificates | None = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: service.process for name, service in self.services.items()}

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

    def tls_args(self, service: str) -> list[str]:
        """The TLS flags ``service`` starts with (none without ``tls``)."""
        if self.tls is None:
            return []
        args = ["--tls-cert-file", str(self.tls.server_cert_file), "--tls-key-file", str(self.tls.server_key_file)]
        if service == "coordinator":
            return [*args, "--internal-tls-ca-file", str(self.tls.ca_file), "--internal-tls-cert-file",
                    str(self.tls.client_cert_file), "--internal-tls-key-file", str(self.tls.client_key_file)]
        return [*args, "--tls-client-ca-file", str(self.tls.ca_file)]

    def start(self, service: str) -> None:
        """Starts (or restarts) one service process."""
        args = ["--draft-address", self.address("draft"), "--verify-addresses", self.address("verify")] if service == "coordinator" else []
        credentials = None
        if self.tls:
            credentials = channel_credentials(self.tls.ca_file, self.tls.client_cert_file, self.tls.client_key_file)
        self.services[service] = ServiceProcess(
            service, getattr(self, f"{service}_port"), self.host,
            [*args, *self.tls_args(service), *self.extra_args.get(service, [])],
            self.metrics_ports.get(service, 0), self.log_dir / f"{service}.log" if self.log_dir else None,
            http_port=self.http_port, cpus=self.cpus.get(service, frozenset()), credentials=credentials,
        )
        self.services[service].start()

    def start_all(self, timeout_s: float = 600.0) -> None:
        """Starts all three and waits until every one is SERVING. Raises RuntimeError if one exits
        or ``timeout_s`` (seconds, covering model loading) passes first."""
        for service in ("verify", "draft", "coordinator"):
            self.start(service)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for service in self.services.values():
                service.wait_serving(deadline)
        except RuntimeError:
            self.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every service (they drain in-flight calls), SIGKILL after ``grace_s``."""
        stop_all(self.services.values(), grace_s)


def stop_all(services: Iterable[ServiceProcess], grace_s: float = 15.0) -> None:
    """SIGTERM to every service (they drain in-flight calls), SIGKILL to those still running
    after ``grace_s`` seconds."""
    services = list(services)
    for service in services:
        service.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for service in services:
        service.wait_stopped(deadline)

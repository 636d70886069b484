"""Starts the verify, draft and coordinator services as separate OS processes on this machine
and waits until each reports SERVING on the standard gRPC health service (``specdec up``)."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_serving(address: str, timeout_s: float = 1.0) -> bool:
    """True if ``address`` answers the gRPC health check with SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class LocalCluster:
    """The three services on ``host``. ``extra_args`` adds flags per service (``verify``, ``draft``,
    ``coordinator``); ``metrics_ports`` their Prometheus ports (absent or 0: off); with ``log_dir``
    each service logs to ``<log_dir>/<service>.log`` instead of this terminal."""

    coordinator_port: int = 50051
    draft_port: int = 50052
    verify_port: int = 50053
    host: str = "127.0.0.1"
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def address(self, service: str) -> str:
        return f"{self.host}:{getattr(self, f'{service}_port')}"

    def metrics_url(self, service: str) -> str | None:
        """The service's Prometheus endpoint, None when off."""
        port = self.metrics_ports.get(service)
        return f"http://{self.host}:{port}/metrics" if port else None

    def _args(self, service: str) -> list[str]:
        args = ["--host", self.host, "--port", str(getattr(self, f"{service}_port"))]
        if service in self.metrics_ports:
            args += ["--metrics-port", str(self.metrics_ports[service])]
        if service == "coordinator":
            args += ["--draft-address", self.address("draft"), "--verify-address", self.address("verify")]
        return args + self.extra_args.get(service, [])

    def start(self, service: str) -> None:
        """Starts (or restarts) one service process."""
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{service}.log", "ab")  # noqa: SIM115 (owned by the child)
        self.processes[service] = subprocess.Popen(
            [sys.executable, "-m", "specdec", "serve", service, *self._args(service)],
            stdout=out, stderr=subprocess.STDOUT if out else None, env=os.environ.copy(),
        )

    def start_all(self, timeout_s: float = 600.0) -> None:
        """Starts all three and waits until every one is SERVING. Raises RuntimeError if one exits
        or ``timeout_s`` (seconds, covering model loading) passes first."""
        for service in ("verify", "draft", "coordinator"):
            self.start(service)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for service, process in self.processes.items():
            while not is_serving(self.address(service)):
                if process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the {service} service exited with code {process.returncode}{self._log_hint(service)}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the {service} service was not SERVING after {timeout_s:g} s{self._log_hint(service)}")
                time.sleep(0.5)

    def _log_hint(self, service: str) -> str:
        return f" (see {self.log_dir / f'{service}.log'})" if self.log_dir else ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every service (they drain in-flight calls), SIGKILL after ``grace_s``."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

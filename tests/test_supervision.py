"""The supervising launcher: under ``specdec up`` (a real subprocess, the tiny models through the
services' SPECDEC_* variables) the draft service is killed with SIGKILL while a request streams.
The request completes with the token ids of plain decoding, the launcher restarts the service,
and the next request speculates again. (A request waiting for the restart of the only verify
replica, in every phase: the fault matrix in tests/test_faults.py; the launcher restarts every
service alike.) The verify service's engine loop dies (injected from outside production code:
tests/fault_injection/sitecustomize.py): the service logs why at CRITICAL, exits with code 70, the
launcher restarts it, and the request in flight completes as plain decoding. The restart policy
(backoff, limit per minute) is tested directly on processes that exit at once."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.api.client import generate
from specdec.rpc.server import EXIT_FATAL
from specdec.v1 import coordinator_pb2
from specdec_app.launcher import LocalCluster, RestartPolicy, ServiceProcess, Supervisor, free_port, start_all
from tests.conftest import SUMMARY, speculates_again, stream_with_fault

pytestmark = pytest.mark.multiprocess

PROMPT = "Tell me a long story about a lighthouse keeper and the ships she guided home."
MAX_NEW, FAULT_AFTER = 200, 12
FAULT_INJECTION = Path(__file__).parent / "fault_injection"  # its sitecustomize.py kills an engine loop on demand


class Output:
    """The lines a process writes, read by a thread (the services inherit the pipe too)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        """The first line matching ``pattern``; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s; last lines:\n{''.join(self.lines[-40:])}")


@pytest.fixture(scope="module")
def engine_fault_file(tmp_path_factory) -> Path:
    """Created, it makes the verify engine's loop die (see tests/fault_injection/sitecustomize.py)."""
    return tmp_path_factory.mktemp("fault") / "kill-verify-engine"


@pytest.fixture(scope="module")
def engine_hang_file(tmp_path_factory) -> Path:
    """Created, it makes the verify engine's next step hang (see tests/fault_injection/sitecustomize.py)."""
    return tmp_path_factory.mktemp("hang") / "hang-verify-engine"


STEP_TIMEOUT_S = 3.0  # the verify service's engine_step_timeout_s here: the tiny model's steps take ms


@pytest.fixture(scope="module")
def specdec_up(tiny_models, engine_fault_file, engine_hang_file):
    """``specdec up`` on free ports with the tiny target as the verify model and as its own
    draft (every draft passes, so lost speculation shows), the engine fault injections armed, the
    verify engine's steps bound to STEP_TIMEOUT_S."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_INJECTION), os.environ.get("PYTHONPATH")])),
        "SPECDEC_TEST_ENGINE_FAULT_FILE": str(engine_fault_file),
        "SPECDEC_TEST_ENGINE_HANG_FILE": str(engine_hang_file),
        "SPECDEC_VERIFY_ENGINE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
        "SPECDEC_VERIFY_MODEL": str(tiny_models.target_dir),
        "SPECDEC_VERIFY_NUM_THREADS": "1",
        "SPECDEC_DRAFT_DRAFTERS": "transformers",
        "SPECDEC_DRAFT_DEFAULT_DRAFTER": "transformers",
        "SPECDEC_DRAFT_TRANSFORMERS_MODEL": str(tiny_models.target_dir),
        "SPECDEC_DRAFT_NUM_THREADS": "1",
        "SPECDEC_COORDINATOR_TOKENIZER": str(tiny_models.target_dir),
        "SPECDEC_COORDINATOR_DRAFT_RETRY_S": "0.5",
    }
    port = free_port()
    args = [
        "--coordinator-port",
        str(port),
        "--draft-port",
        str(free_port()),
        "--verify-port",
        str(free_port()),
        "--http-port",
        "0",
        "--coordinator-metrics-port",
        "0",
        "--draft-metrics-port",
        "0",
        "--verify-metrics-port",
        "0",
        "--restart-backoff-s",
        "0.2",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec", "up", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output = Output(process.stdout)
    try:
        output.wait_for("all services SERVING")
        yield process, output, f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def pid_of(output: Output, service: str, restarts: int) -> int:
    """The pid of ``service`` after ``restarts`` restarts, from ``specdec up``'s output."""
    if restarts == 0:
        return int(output.wait_for(rf"^\s+{service}\s+\S+\s+pid (\d+)").group(1))
    return int(output.wait_for(rf"{service} service restarted \(restart {restarts}, pid (\d+)\)").group(1))


def request(k: int) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        text=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k, drafter="transformers"
    )


def test_killed_service_is_restarted_and_requests_complete(specdec_up):
    process, output, address = specdec_up
    service = "draft"
    plain = generate(address, request(0), timeout_s=180)  # plain decoding: K = 0 on the target
    assert len(plain.token_ids) > 2 * FAULT_AFTER
    killed_pid = pid_of(output, service, 0)

    stream = stream_with_fault(address, request(4), lambda: os.kill(killed_pid, signal.SIGKILL), FAULT_AFTER)
    metrics = stream.completion.metrics
    assert stream.completion.token_ids == plain.token_ids
    assert metrics.num_draft_failures >= 1
    restarted_pid = pid_of(output, service, 1)
    assert restarted_pid != killed_pid
    back = output.wait_for(rf"{service} service SERVING again, ([\d.]+) s after it went down")
    assert process.poll() is None, "specdec up stopped"
    SUMMARY.append(
        f"specdec up, {service} SIGKILLed: {stream.recovery_s * 1000:.0f} ms from the kill to the client's next "
        f"message; the launcher had it SERVING again after {back.group(1)} s"
    )

    assert speculates_again(address, request(4), plain.token_ids), "no request after the restart accepted a draft token"


@pytest.mark.long  # the hung step's test below shows the same exit and restart
def test_a_service_whose_engine_loop_dies_exits_and_is_restarted(specdec_up, engine_fault_file):
    process, output, address = specdec_up
    plain = generate(address, request(0), timeout_s=180)
    killed_pid = pid_of(output, "verify", 0)
    engine_fault_file.touch()  # the verify engine's next scheduling pass raises
    completion = generate(address, request(4), timeout_s=180)  # its session rebuilt on the restarted service
    assert completion.token_ids == plain.token_ids
    output.wait_for(r"CRITICAL.*the verify engine loop died")
    output.wait_for(r"RuntimeError: injected by tests/fault_injection")  # the traceback
    output.wait_for(rf"verify service exited \(exit code {EXIT_FATAL}\)")
    assert pid_of(output, "verify", 1) != killed_pid
    output.wait_for(r"verify service SERVING again")
    assert not engine_fault_file.exists() and process.poll() is None


def test_a_service_whose_engine_step_hangs_exits_and_is_restarted(specdec_up, engine_hang_file):
    process, output, address = specdec_up
    plain = generate(address, request(0), timeout_s=180)
    restarts = sum("verify service restarted" in line for line in output.lines)
    engine_hang_file.touch()  # the verify engine's next step never ends
    completion = generate(address, request(4), timeout_s=180)  # its session rebuilt on the restarted service
    assert completion.token_ids == plain.token_ids
    hung = output.wait_for(r"CRITICAL.*a step of the verify engine has run for ([\d.]+) s.*engine_step_timeout_s")
    assert STEP_TIMEOUT_S <= float(hung.group(1)) < STEP_TIMEOUT_S + 1.0  # the watchdog looks every 0.75 s here
    output.wait_for(r"CRITICAL.*the verify engine died .*reports NOT_SERVING and exits with code 70")
    output.wait_for(rf"verify service exited \(exit code {EXIT_FATAL}\)")
    output.wait_for(rf"verify service restarted \(restart {restarts + 1}, pid \d+\)")
    output.wait_for(r"verify service SERVING again")
    assert not engine_hang_file.exists() and process.poll() is None


class ExitsAtOnce(ServiceProcess):
    """A service process that exits with code 3 as soon as it starts (a crash at start-up)."""

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def test_restarts_back_off_and_stop_at_the_limit_per_minute(caplog):
    cluster = LocalCluster()
    cluster.services["draft"] = ExitsAtOnce("draft", free_port())
    cluster.services["draft"].start()
    supervisor = Supervisor(cluster, RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, max_per_minute=4))
    caplog.set_level("WARNING", logger="specdec_app.launcher")
    deadline = time.monotonic() + 30
    while not any("left down" in r.message for r in caplog.records):
        assert time.monotonic() < deadline, [r.message for r in caplog.records]
        supervisor.poll()
        time.sleep(0.01)
    assert supervisor.restarts == {"draft": 4}
    delays = [float(m.group(1)) for r in caplog.records if (m := re.search(r"restarting it in ([\d.]+) s", r.message))]
    assert delays == [0.05, 0.1, 0.2, 0.2]  # doubled each time, capped at max_backoff_s
    assert "exit code 3" in caplog.records[0].message
    for _ in range(20):  # left down: no more restarts
        supervisor.poll()
    assert supervisor.restarts == {"draft": 4}


def tiny_service(
    service: str, tiny_models, port: int, draft_port: int, verify_port: int, log_file: Path, drafter: str
) -> ServiceProcess:
    """``service`` as a process on the tiny models (the draft: ``drafter``, the transformers one on
    the tiny draft, or llama.cpp's on the default GGUF)."""
    args = {
        "coordinator": [
            "--draft-address",
            f"127.0.0.1:{draft_port}",
            "--verify-addresses",
            f"127.0.0.1:{verify_port}",
            "--tokenizer",
            str(tiny_models.target_dir),
            "--http-port",
            "0",
        ],
        "draft": ["--drafters", drafter, "--default-drafter", drafter, "--num-threads", "1"]
        + (["--transformers-model", str(tiny_models.draft_dir)] if drafter == "transformers" else []),
        "verify": ["--model", str(tiny_models.target_dir), "--num-threads", "1"],
    }[service]
    return ServiceProcess(service, port, args=[*args, "--insecure"], log_file=log_file)


@pytest.mark.parametrize(
    "drafter",
    [pytest.param("transformers", marks=pytest.mark.long), "llama-cpp"],  # llama.cpp's threads aborted
)
def test_sigterm_ends_every_service_cleanly(tiny_models, tmp_path, drafter):
    """SIGTERM to each service, after it served a request: exit code 0, nothing aborted (llama.cpp's
    state torn down at interpreter exit aborted the draft service with "terminate called without an
    active exception", exit 134: draft_service.service.close_engines)."""
    ports = {name: free_port() for name in ("coordinator", "draft", "verify")}
    services = {
        name: tiny_service(name, tiny_models, port, ports["draft"], ports["verify"], tmp_path / f"{name}.log", drafter)
        for name, port in ports.items()
    }
    start_all(services.values(), timeout_s=180)
    try:
        address = f"127.0.0.1:{ports['coordinator']}"
        assert generate(
            address, coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=8), timeout_s=120
        ).token_ids
    finally:
        for name in ("coordinator", "draft", "verify"):  # each alone, so that the others' exits cannot hide it
            services[name].signal(signal.SIGTERM)
            services[name].wait_stopped(time.monotonic() + 30)
    for name, service in services.items():
        log = (tmp_path / f"{name}.log").read_text()
        assert service.exit_status() == "exit code 0", (name, service.exit_status(), log[-2000:])
        assert "terminate called" not in log and "Traceback" not in log, (name, log[-2000:])


def test_sigterm_while_a_service_loads_ends_it_cleanly(tiny_models, tmp_path):
    """SIGTERM while the draft service loads its llama.cpp model (before it serves): exit code 0,
    not a kill by the signal."""
    log_file = tmp_path / "draft.log"
    draft = tiny_service("draft", tiny_models, free_port(), 0, 0, log_file, "llama-cpp")
    draft.start()
    deadline = time.monotonic() + 60
    while "starting the draft service" not in (log_file.read_text() if log_file.exists() else ""):
        assert time.monotonic() < deadline and draft.exit_status() is None, draft.exit_status()
        time.sleep(0.05)
    draft.signal(signal.SIGTERM)
    draft.wait_stopped(time.monotonic() + 60)
    log = log_file.read_text()
    assert draft.exit_status() == "exit code 0", (draft.exit_status(), log[-2000:])
    assert "serving specdec.v1.DraftService" not in log and "terminate called" not in log, log[-2000:]

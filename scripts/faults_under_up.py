"""Measures recovery under `specdec up` with the default models (docs/faults.md#under-specdec-up).

Starts `specdec up` on free ports, then, each during a greedy llama-cpp K = 8 request of 128
tokens (after its 24th token): SIGKILL of the draft service, SIGKILL of the verify service, and
SIGSTOP of the (restarted) draft service. Prints, for each, whether the tokens equal plain
decoding, the client's longest wait for a message after the fault (ms), the time the launcher
took to bring a killed service back to SERVING (s), and the next request's accepted draft tokens.

Then the burst case: 16 concurrent greedy requests (48 new tokens, the default adaptive K, 16
open-ended chat prompts), the draft service, then the verify service, SIGKILLed once some
streams have tokens while others are still in their prefill. Prints, for each, how many
completed, how many equal the same burst at K = 0 (plain decoding through the pipeline), how
many were still prefilling at the kill, and the longest a client waited for a message after it.

    .venv/bin/python scripts/faults_under_up.py
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import grpc

from coordinator.api.client import Completion, generate
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec_app.launcher import free_port

PROMPT = "Write a short story about a lighthouse keeper, in five sentences."
FAULT_AFTER_TOKENS = 24
BURST_PROMPTS = [
    "What makes a good neighbour?",
    "Describe your ideal weekend.",
    "Why do people enjoy music?",
    "Give me advice for a first job interview.",
    "What would you pack for a week in the mountains?",
    "How do bees make honey?",
    "Tell me about the history of bread.",
    "What are the benefits of learning a second language?",
    "How should I start running as a beginner?",
    "Describe a busy market in the morning.",
    "What is the best way to learn to cook?",
    "Why is sleep important?",
    "Write a letter to a friend who moved away.",
    "What do you think cities will look like in fifty years?",
    "How can I keep houseplants alive?",
    "Explain why the sea is salty.",
]
BURST_MAX_NEW = 48


class Up:
    """`specdec up` as a subprocess, its output collected line by line."""

    def __init__(self) -> None:
        self.port = free_port()
        ports = {name: free_port() for name in ("draft", "verify")}
        command = [
            sys.executable,
            "-m",
            "specdec",
            "up",
            "--coordinator-port",
            str(self.port),
            "--http-port",
            "0",
            "--draft-port",
            str(ports["draft"]),
            "--verify-port",
            str(ports["verify"]),
            "--coordinator-metrics-port",
            "0",
            "--draft-metrics-port",
            "0",
            "--verify-metrics-port",
            "0",
        ]
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=root)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def wait_for(self, pattern: str, since: int = 0, timeout_s: float = 600) -> re.Match:
        """The first line from number ``since`` on that matches ``pattern``, waiting for it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.1)
        raise SystemExit(
            f"no line matching {pattern!r} in {timeout_s:.0f} s; the last ones:\n{''.join(self.lines[-30:])}"
        )

    def pid(self, service: str) -> int:
        """The process id of ``service``'s latest start (the table `specdec up` prints, or the
        launcher's line for a restart)."""
        pattern = rf"^\s+{service}\s+\S+\s+pid (\d+)|{service} service restarted \(restart \d+, pid (\d+)\)"
        started = [match for line in list(self.lines) if (match := re.search(pattern, line))]
        return int(next(group for group in started[-1].groups() if group))

    def request(self, k: int) -> Completion:
        return generate(f"127.0.0.1:{self.port}", request(k), timeout_s=600)

    def stream_with_fault(self, fault) -> tuple[list[int], float]:
        """One K = 8 request, ``fault()`` called after FAULT_AFTER_TOKENS tokens; returns its token
        ids and the longest the client then waited for a message, seconds."""
        tokens, arrivals, fault_at = [], [], None
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=GRPC_OPTIONS) as channel:
            for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request(8), timeout=600):
                arrivals.append(time.monotonic())
                tokens.extend(response.token_ids)
                if fault_at is None and len(tokens) >= FAULT_AFTER_TOKENS:
                    fault()
                    fault_at = time.monotonic()
        after = [fault_at, *(t for t in arrivals if t > fault_at)]
        return tokens, max(b - a for a, b in pairwise(after))


class Burst:
    """BURST_PROMPTS sent at once, each stream read by a thread: its token ids, message arrival
    times (time.monotonic()) and the error that ended it, if any."""

    def __init__(self, port: int, k: int | None = None):
        self.tokens: list[list[int]] = [[] for _ in BURST_PROMPTS]
        self.arrivals: list[list[float]] = [[] for _ in BURST_PROMPTS]
        self.errors: list[str | None] = [None for _ in BURST_PROMPTS]
        self.threads = [
            threading.Thread(target=self._read, args=(port, i, k), daemon=True) for i in range(len(BURST_PROMPTS))
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, port: int, i: int, k: int | None) -> None:
        request = coordinator_pb2.GenerateRequest(text=BURST_PROMPTS[i], max_new_tokens=BURST_MAX_NEW)
        if k is not None:
            request.num_speculative_tokens = k
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
                for response in coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=600):
                    self.arrivals[i].append(time.monotonic())
                    self.tokens[i].extend(response.token_ids)
        except grpc.RpcError as err:
            self.errors[i] = f"{err.code().name}: {err.details()}"

    def join(self) -> None:
        for thread in self.threads:
            thread.join()


def burst_with_kill(up: Up, service: str, plain: list[list[int]]) -> None:
    """A burst whose ``service`` is SIGKILLed once some streams have tokens and others none."""
    pid, since = up.pid(service), len(up.lines)
    burst = Burst(up.port)
    while not any(burst.tokens) or all(burst.tokens):
        time.sleep(0.01)
    prefilling = sum(not tokens for tokens in burst.tokens)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    burst.join()
    back_s = up.wait_for(rf"{service} service SERVING again, ([\d.]+) s after", since).group(1)
    after = [[killed_at, *(t for t in times if t > killed_at)] for times in burst.arrivals]
    longest_s = max(b - a for times in after for a, b in pairwise(times))
    completed = sum(error is None for error in burst.errors)
    identical = sum(tokens == expected for tokens, expected in zip(burst.tokens, plain, strict=True))
    failures = sorted({error for error in burst.errors if error})
    print(
        f"burst of {len(BURST_PROMPTS)}, {service} SIGKILL ({prefilling} still prefilling): completed {completed}, "
        f"identical to K = 0 {identical}, longest wait {longest_s:.1f} s, SERVING again after {back_s} s"
        + (f"; failures: {failures}" if failures else ""),
        flush=True,
    )


def request(k: int) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        text=PROMPT, max_new_tokens=128, num_speculative_tokens=k, drafter="llama-cpp"
    )


def main() -> None:
    up = Up()
    try:
        up.wait_for("all services SERVING")
        plain = up.request(0).token_ids
        for service in ("draft", "verify"):
            pid = int(up.wait_for(rf"^\s+{service}\s+\S+\s+pid (\d+)").group(1))
            tokens, longest_s = up.stream_with_fault(lambda pid=pid: os.kill(pid, signal.SIGKILL))
            back_s = up.wait_for(rf"{service} service SERVING again, ([\d.]+) s after").group(1)
            later = up.request(8)
            print(
                f"{service} SIGKILL: identical {tokens == plain}, longest wait {longest_s * 1000:.0f} ms, "
                f"SERVING again after {back_s} s; next request identical {later.token_ids == plain}, "
                f"{later.metrics.num_accepted_draft_tokens} draft tokens accepted",
                flush=True,
            )
        pid = int(up.wait_for(r"draft service restarted \(restart 1, pid (\d+)\)").group(1))
        since = len(up.lines)
        tokens, longest_s = up.stream_with_fault(lambda: os.kill(pid, signal.SIGSTOP))
        os.kill(pid, signal.SIGCONT)
        deadline = up.wait_for(r"Propose deadline (\d+) ms\) did not answer", since).group(1)
        print(
            f"draft SIGSTOP: identical {tokens == plain}, longest wait {longest_s * 1000:.0f} ms "
            f"(Propose deadline {deadline} ms)",
            flush=True,
        )
        reference = Burst(up.port, k=0)
        reference.join()
        for service in ("draft", "verify"):
            burst_with_kill(up, service, reference.tokens)
    finally:
        up.process.send_signal(signal.SIGTERM)
        up.process.wait(60)


if __name__ == "__main__":
    main()

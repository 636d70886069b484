"""Checks that a verify service under more KV than its budget holds stays within budget + model
(docs/profiles.md#what-the-kv-budget-bounds).

Starts a verify service process with the real default model (SmolLM2-135M-Instruct, ``--model
smollm2``) and a small ``--kv-cache-max-bytes``, then runs ``--max-sessions`` clients at once, each
a session of a long prompt (each its own tokens, so that no prefix is shared): a Prefill with the
first token, then plain decode steps. A Prefill refused for the budget (RESOURCE_EXHAUSTED) is
retried every half second; a session preempted (NOT_FOUND) is prefilled again with its whole
committed log, as the coordinator does, and goes on. Prints the outcome of every call (counts by
RPC and status code), the preemptions and refusals the service counted, each session's tokens
against the same prompt decoded alone afterwards, the KV pool's largest allocation during the load
(its metric, read every 0.2 s) against the budget, and the process's peak resident memory during
the load (the kernel's high-water mark, reset before it) against its resident memory when idle
(the model, the runtime, and the buffers of a step: one session of the same prompt length was
served alone before) plus the budget.

    .venv/bin/python scripts/kv_budget_check.py [--kv-cache-max-bytes 134217728] [--max-sessions 8]
"""

import argparse
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import verify_pb2, verify_pb2_grpc
from specdec_app.launcher import ServiceProcess, free_port

MIB = 1024 * 1024


def memory_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak(pid: int) -> None:
    """Resets the process's VmHWM to its current resident size (Linux's clear_refs, value 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class PoolWatch:
    """The largest ``specdec_kv_cache_pool_bytes`` seen, reading ``url`` every 0.2 s until stopped."""

    def __init__(self, url: str):
        self.url, self.largest, self.stop = url, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.2):
            self.largest = max(self.largest, metrics(self.url)["specdec_kv_cache_pool_bytes"])


def metrics(url: str) -> dict[str, float]:
    """The verify engine's KV samples and the Prefill refusals, from its /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    wanted: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "specdec_kv_cache_blocks" and labels["engine"] == "verify":
                wanted[f"kv blocks {labels['state']}"] = sample.value
            elif sample.name in ("specdec_num_preemptions_total", "specdec_kv_cache_pool_bytes"):
                wanted[sample.name] = sample.value
            elif sample.name == "specdec_rpc_errors_total" and labels["method"] == "Prefill":
                wanted[f"Prefill {labels['code']}"] = sample.value
    return wanted


class Client:
    """One client's session: prompt, Prefill (retried while refused), ``decodes`` Decode calls,
    prefilled again with its committed log when preempted; every call's outcome in ``outcomes``."""

    def __init__(self, stub, index: int, prompt_tokens: int, decodes: int, outcomes: Counter, deadline: float):
        self.stub, self.index, self.decodes, self.outcomes, self.deadline = stub, index, decodes, outcomes, deadline
        first = 1000 + index * prompt_tokens  # a prompt of its own: nothing shared through the prefix cache
        self.committed = [first + i for i in range(prompt_tokens)]
        self.prompt_tokens = prompt_tokens
        self.rebuilds = 0
        self.error = ""

    def run(self) -> None:
        try:
            self._prefill()
            while len(self.committed) < self.prompt_tokens + self.decodes:
                try:
                    response = self.stub.Decode(verify_pb2.DecodeRequest(session_id=self._session()), timeout=120)
                except grpc.RpcError as err:
                    self.outcomes["Decode", err.code().name] += 1
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    self.rebuilds += 1
                    self._prefill()
                    continue
                self.outcomes["Decode", "OK"] += 1
                self.committed.append(response.token_id)
            self.stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=self._session()), timeout=30)
        except Exception as err:  # reported, not raised: the other clients go on
            self.error = repr(err)

    def generated(self) -> list[int]:
        return self.committed[self.prompt_tokens :]

    def _session(self) -> str:
        return f"client-{self.index}-{self.rebuilds}"

    def _prefill(self) -> None:
        """Prefills the committed log under a new session id, retrying while the budget is full."""
        request = verify_pb2.VerifyServicePrefillRequest(session_id=self._session(), token_ids=self.committed)
        request.decode = len(self.committed) == self.prompt_tokens  # the first token comes with the prompt
        while True:
            try:
                response = self.stub.Prefill(request, timeout=300)
            except grpc.RpcError as err:
                self.outcomes["Prefill", err.code().name] += 1
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > self.deadline:
                    raise
                time.sleep(0.5)
                continue
            self.outcomes["Prefill", "OK"] += 1
            if response.HasField("next_token_id"):
                self.committed.append(response.next_token_id)
            return


def alone(stub, prompt: list[int], count: int) -> list[int]:
    """``count`` tokens of greedy decoding of ``prompt``, a session alone on the service."""
    response = stub.Prefill(
        verify_pb2.VerifyServicePrefillRequest(session_id="alone", token_ids=prompt, decode=True), timeout=300
    )
    tokens = [response.next_token_id]
    while len(tokens) < count:
        tokens.append(stub.Decode(verify_pb2.DecodeRequest(session_id="alone"), timeout=120).token_id)
    stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id="alone"), timeout=30)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-max-bytes", type=int, default=128 * MIB)
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--decodes", type=int, default=64, help="tokens each session generates")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument(
        "--no-pack-linear-weights",
        action="store_true",
        help="the target's linear layers on aten, not oneDNN: oneDNN keeps buffers for each number of rows a step "
        "has run (its primitive cache), memory outside the KV budget that grows with the load's step sizes",
    )
    args = parser.parse_args()

    logs = Path(f"/tmp/kv-budget-check-{os.getpid()}")
    service = ServiceProcess(
        "verify",
        free_port(),
        args=[
            "--model",
            "smollm2",
            "--kv-cache-max-bytes",
            str(args.kv_cache_max_bytes),
            "--max-sessions",
            str(args.max_sessions),
            "--num-threads",
            str(args.num_threads),
            *(["--no-pack-linear-weights"] if args.no_pack_linear_weights else []),
        ],
        metrics_port=free_port(),
        log_file=logs / "verify.log",
        env={"SPECDEC_VERIFY_INSECURE": "true", "HF_HUB_OFFLINE": "1"},  # loopback only, no client certificates
    )
    service.start()
    try:
        service.wait_serving(time.monotonic() + 600)
        pid, url = service.started.pid, service.metrics_url or ""
        outcomes: Counter = Counter()
        with grpc.insecure_channel(service.address, options=GRPC_OPTIONS) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            alone(stub, [500 + i for i in range(args.prompt_tokens)], 4)  # a step's buffers, within the first pool
            time.sleep(1.0)
            idle_kib = memory_kib(pid, "VmRSS")
            reset_peak(pid)
            watch = PoolWatch(url)
            deadline = time.monotonic() + 900
            clients = [
                Client(stub, i, args.prompt_tokens, args.decodes, outcomes, deadline) for i in range(args.max_sessions)
            ]
            threads = [threading.Thread(target=client.run) for client in clients]
            start = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - start
            peak_kib = memory_kib(pid, "VmHWM")
            watch.stop.set()
            watch.thread.join()
            after = metrics(url)
            same = [
                client.generated() == alone(stub, client.committed[: client.prompt_tokens], args.decodes)
                for client in clients
                if not client.error
            ]
        budget_mib = args.kv_cache_max_bytes / MIB
        print(
            f"verify service, SmolLM2-135M-Instruct (float32), --kv-cache-max-bytes {args.kv_cache_max_bytes} "
            f"({budget_mib:.0f} MiB), {args.max_sessions} clients at once, prompts of {args.prompt_tokens} tokens "
            f"each, {args.decodes} tokens generated each, linear layers on "
            f"{'aten' if args.no_pack_linear_weights else 'oneDNN'}; {elapsed:.1f} s"
        )
        print("calls by outcome:")
        for (rpc, code), count in sorted(outcomes.items()):
            print(f"  {rpc:8} {code:20} {count}")
        print("service metrics after the load:")
        for name, value in sorted(after.items()):
            print(f"  {name:36} {value:.0f}")
        print(f"sessions rebuilt after a preemption: {sum(c.rebuilds for c in clients)}")
        errors = [f"client {c.index}: {c.error}" for c in clients if c.error]
        print(f"clients that failed: {len(errors)}" + "".join(f"\n  {e}" for e in errors))
        print(f"sessions whose tokens equal the same prompt decoded alone afterwards: {sum(same)} of {len(same)}")
        idle_mib, peak_mib = idle_kib / 1024, peak_kib / 1024
        largest = watch.largest / MIB
        print(f"KV pool allocated at most {largest:.1f} MiB during the load (the budget: {budget_mib:.0f} MiB)")
        print(
            f"resident memory: idle {idle_mib:.0f} MiB (the model, the runtime, a step's buffers), peak during "
            f"the load {peak_mib:.0f} MiB; idle + budget = {idle_mib + budget_mib:.0f} MiB; the peak is "
            f"{peak_mib - idle_mib:.0f} MiB above idle ({(peak_mib - idle_mib) / budget_mib:.2f} of the budget)"
        )
    finally:
        service.signal(signal.SIGTERM)
        service.wait_stopped(time.monotonic() + 30)
    print(f"service log: {logs / 'verify.log'}")


if __name__ == "__main__":
    main()

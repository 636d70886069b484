"""Measures what one generated token costs the parts that do not scale with the verify replicas
(docs/scaling.md): the coordinator's CPU, the request store's (Redis) commands and CPU, the bytes
a round puts on the wire and the connections a coordinator holds.

Runs the near-free model of `specdec bench ceiling` (so the model costs almost nothing and what
is measured is the path around it) as one verify and one draft replica (the model drafting for
itself) and one coordinator with a real Redis as its request store (``--store memory``: the
coordinator's own, to tell Redis's share), then, for K = 0 and K = 4,
N closed-loop clients of 128-token requests, and prints per generated token: the coordinator's
CPU ms, Redis's CPU ms and commands (INFO commandstats before and after), and per round the
protobuf bytes both ways (RequestMetrics.round_wire_bytes / rounds).

    .venv/bin/python scripts/scaling_costs.py [--clients 32] [--requests-per-client 2]
"""

import argparse
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from coordinator.api.client import generate
from specdec.v1 import coordinator_pb2
from specdec_app.bench.ceiling import near_free_model
from specdec_app.bench.cpu_time import CpuClock
from specdec_app.launcher import ServiceProcess, free_port, start_all, stop_all

PROMPTS = [
    "Describe a lighthouse at night.",
    "What makes bread rise?",
    "Write a short note to a neighbour.",
    "Explain why the sea is salty.",
]


def redis_server(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


def redis_commands(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(entry["calls"] for name, entry in stats.items() if name != "cmdstat_info")


def run_cell(address: str, clients: int, per_client: int, k: int) -> tuple[int, int, int]:
    """Tokens generated, rounds, and round wire bytes of ``clients`` closed-loop clients."""

    def client(c: int) -> tuple[int, int, int]:
        tokens = rounds = wire = 0
        for r in range(per_client):
            request = coordinator_pb2.GenerateRequest(
                text=f"{PROMPTS[(c + r) % len(PROMPTS)]} (client {c}, request {r})",
                max_new_tokens=128,
                num_speculative_tokens=k,
            )
            metrics = generate(address, request, timeout_s=600).metrics
            tokens += metrics.num_generated_tokens
            rounds += metrics.num_target_forwards
            wire += metrics.round_wire_bytes
        return tokens, rounds, wire

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    return tuple(sum(column) for column in zip(*results, strict=True))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--store", choices=("redis", "memory"), default="redis", help="the request store")
    options = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: run scripts/setup.sh --test")
    model = str(near_free_model())
    folder = Path(tempfile.mkdtemp(prefix="specdec-scaling-"))
    store, url = redis_server(folder)
    # on loopback, without keys or certificates: every service --insecure
    verify_args = ["--insecure", "--model", model]
    verify = ServiceProcess("verify", free_port(), args=verify_args, log_file=folder / "verify.log")
    draft_args = ["--insecure", "--drafters", "transformers", "--default-drafter", "transformers"]
    draft = ServiceProcess(
        "draft", free_port(), args=[*draft_args, "--transformers-model", model], log_file=folder / "draft.log"
    )
    upstream = ["--tokenizer", model, "--verify-addresses", verify.address, "--draft-addresses", draft.address]
    coordinator = ServiceProcess(
        "coordinator",
        free_port(),
        args=["--insecure", *upstream, "--max-streams-per-client", "0"],
        log_file=folder / "coordinator.log",
        env={"SPECDEC_REDIS_URL": url} if options.store == "redis" else {},
    )
    services = [verify, draft, coordinator]
    try:
        start_all(services, 300)
        run_cell(coordinator.address, 4, 1, 4)  # warm-up
        print(f"{options.clients} closed-loop clients x {options.requests_per_client} requests of 128 tokens")
        columns = ["tokens", "tokens/round", "coordinator CPU ms/token", "Redis CPU ms/token", "Redis commands/token"]
        print(" | ".join(["K", *columns, "bytes/round"]))
        for k in (0, 4):
            clock = CpuClock({"coordinator": coordinator.started.pid, "redis": store.pid})
            commands = redis_commands(url)
            clock.start()
            tokens, rounds, wire = run_cell(coordinator.address, options.clients, options.requests_per_client, k)
            cpu = clock.stop()
            used = redis_commands(url) - commands
            print(
                f"{k} | {tokens} | {tokens / rounds:.2f} | {cpu['coordinator'] * 1000 / tokens:.3f} | "
                f"{cpu['redis'] * 1000 / tokens:.4f} | {used / tokens:.3f} | {wire / rounds:.0f}"
            )
    finally:
        stop_all(services)
        store.kill()
        print(f"logs: {folder}")


if __name__ == "__main__":
    main()

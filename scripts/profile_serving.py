"""Where the serving path's CPU time goes (findings in
docs/profiles.md#where-the-cpu-time-goes).

Writes a near-free model (``specdec bench ceiling``'s, :func:`specdec_app.bench.ceiling.near_free_model`:
a random 2-layer Llama, hidden 64, with SmolLM2's tokenizer; a forward costs almost nothing, so what
is measured is the path around it), serves it with the three
services as separate processes (verify: that model; draft: the transformers drafter on the same
folder, so every draft token is accepted; every service with the ``SPECDEC_*`` settings
``specdec bench ceiling`` gives it at N, :func:`specdec_app.bench.ceiling.configure`, where this
environment does not set them: one torch thread each, the draft at niceness 0), sends N
concurrent greedy streams (closed loop) and
samples every process with py-spy (``--idle`` off: only frames that run on a CPU). Prints, per
K and per process, the CPU ms per generated token (user + system time from /proc around the
load) split by the share of py-spy's samples in each part of the path, and the tokens/s.

    .venv/bin/python scripts/profile_serving.py [--concurrency 64] [--max-new-tokens 128] [--seconds 20]
"""

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec_app.bench.ceiling import configure
from specdec_app.bench.concurrency import ConcurrencyConfig, service_settings
from specdec_app.bench.cpu_time import CpuClock, ms_per_token
from specdec_app.launcher import LocalCluster, free_port

# Parts of the path by the frames that belong to them (file or function substrings). A sample
# goes to the part of its innermost frame that belongs to one (torch's functions and C code count
# for their Python caller: a softmax in the acceptance test is acceptance, a Linear module's
# forward is the model).
PARTS = [
    ("acceptance", ("specdec/sampling/acceptance.py", "specdec/sampling/probs.py")),
    ("attention (ragged)", ("_ragged_attention",)),
    ("model forward", ("transformers/models/", "torch/nn/modules/", "transformers/integrations/")),
    ("KV store", ("specdec/engine/kv.py", "specdec/engine/ragged_lm.py")),
    ("engine scheduling", ("specdec/engine/engine.py", "specdec/engine/batching.py")),
    ("protobuf and gRPC", ("google/protobuf", "grpc/", "grpc_")),
    ("detokenization and stream output", ("tokenizers", "coordinator/api/output.py", "transformers/tokenization")),
    ("request store", ("coordinator/request_store/", "redis/")),
    (
        "metrics and tracing",
        (
            "prometheus_client",
            "opentelemetry",
            "coordinator/observability/metrics.py",
            "specdec/observability/prometheus.py",
        ),
    ),
    ("round logic (coordinator)", ("coordinator/",)),
    ("drafter (draft service)", ("draft_service/",)),
    ("service handlers", ("verify_service/", "specdec/")),
    ("asyncio", ("asyncio/",)),
]
RATE_HZ = 200


async def closed_loop(address: str, k: int, concurrency: int, max_new: int, seconds: float) -> int:
    """``concurrency`` clients each sending its next request when the last one ends, for
    ``seconds``; returns the tokens generated."""
    prompts = [f"Tell me about topic number {i}, in detail." for i in range(concurrency)]
    deadline, total = time.monotonic() + seconds, 0

    async def client(prompt: str) -> None:
        nonlocal total
        async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while time.monotonic() < deadline:
                request = coordinator_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new, drafter="transformers")
                if k >= 0:  # else adaptive K
                    request.num_speculative_tokens = k
                async for response in stub.Generate(request):
                    total += len(response.token_ids)

    await asyncio.gather(*(client(p) for p in prompts))
    return total


def part_of(frame: str) -> str | None:
    return next((name for name, marks in PARTS if any(mark in frame for mark in marks)), None)


def parts_of(raw: Path) -> collections.Counter:
    """Samples per part from py-spy's raw output (one line per stack, root first, then its count)."""
    samples: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            frames = reversed(stack.split(";"))
            samples[next((part for frame in frames if (part := part_of(frame))), "other")] += int(count)
    return samples


def profile(cluster: LocalCluster, k: int, args, out: Path) -> None:
    address = cluster.address("coordinator")
    asyncio.run(closed_loop(address, k, args.concurrency, args.max_new_tokens, 3))  # warm-up
    py_spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--rate", str(RATE_HZ), "--format", "raw"]
    py_spy += ["--nonblocking", "--duration", str(int(args.seconds))]
    spies = {
        name: subprocess.Popen(
            [*py_spy, "--pid", str(process.pid), "--output", str(out / f"{name}-k{k}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, process in cluster.processes.items()
    }
    clock = CpuClock({name: process.pid for name, process in cluster.processes.items()})
    clock.start()
    start = time.monotonic()
    tokens = asyncio.run(closed_loop(address, k, args.concurrency, args.max_new_tokens, args.seconds))
    elapsed = time.monotonic() - start
    cpu_ms = {name: ms or 0.0 for name, ms in ms_per_token(clock.stop(), tokens).items()}  # per generated token
    for spy in spies.values():
        spy.wait()
    print(f"\nK = {k}: {tokens} tokens in {elapsed:.1f} s, {tokens / elapsed:.0f} tokens/s")
    print("| process | part | share of samples | CPU ms per generated token |\n|---|---|---:|---:|")
    for name in spies:
        samples = parts_of(out / f"{name}-k{k}.txt")
        total = sum(samples.values()) or 1
        print(f"| {name} | **all** (user + system, /proc) | | **{cpu_ms[name]:.3f}** |")
        for part, count in samples.most_common():
            share = count / total
            print(f"| {name} | {part} | {share:.0%} | {share * cpu_ms[name]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 4], help="Fixed Ks; -1: adaptive K.")
    parser.add_argument("--raw-out", type=Path, help="Keep py-spy's raw stacks here (<process>-k<K>.txt).")
    args = parser.parse_args()
    # the ceiling's config at N, for its service settings and model only: nothing reads its questions
    ceiling = configure(ConcurrencyConfig(questions=Path(), out=Path(), command="", concurrency=[args.concurrency]))
    os.environ.update({k: v for k, v in service_settings(ceiling).items() if k not in os.environ})
    with tempfile.TemporaryDirectory() as tmp:
        model, out = ceiling.target, args.raw_out or Path(tmp) / "profiles"
        out.mkdir(parents=True, exist_ok=True)
        drafter = ["--drafters", "transformers", "--default-drafter", "transformers"]
        # room for every stream's sessions (one handler thread per call in flight)
        limits = ["--max-sessions", str(2 * args.concurrency + 8)]
        limits += ["--max-workers", str(2 * args.concurrency + 8)]
        cluster = LocalCluster(
            free_port(),
            free_port(),
            free_port(),
            extra_args={
                "verify": ["--model", str(model), *limits],
                "draft": [*drafter, "--transformers-model", str(model), *limits],
                # every stream comes from this one client: its per-client limit (32) off
                "coordinator": ["--tokenizer", str(model), "--max-streams-per-client", "0"],
            },
            log_dir=Path(tmp) / "logs",
        )
        cluster.start_all(timeout_s=300)
        try:
            for k in args.k:
                profile(cluster, k, args, out)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()

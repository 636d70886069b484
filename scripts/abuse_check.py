"""Tries the many-tenant abuse cases against `specdec up`'s stack with the default models (the three
services as processes, API keys ka and kb) and prints what each got (docs/security.md#tenants):

1. key kb resumes, and reuses, the request id of key ka's request;
2. a chat completion with one 1 MB stop string, and one with 10,000 stop strings, while /health is
   probed every 20 ms;
3. key ka opens 40 streams at once (its limit: 32) while key kb asks for a completion;
4. a gRPC stream whose client stops reading (the coordinator started with a 5 s stall bound);
5. an 8 MiB body without a key, sent as headers only; a request header that never ends;
6. a token-id prompt against the same text; JSON nested 100,000 deep;
7. key ka sends 1,100 bodies that never end; 8. four bodies of 200,000 chat messages at once;
9. 2,000 requests naming unknown models; 10. a 1 MB request header, and one of 10,000 fields;
   each while /health is probed every 20 ms and key kb asks for a completion;
11. key ka sends a system prompt of about 1,000 tokens no one sent before (then again with another
    question, and a second turn), then key kb sends it: the prompt tokens each finds cached and its
    time to first token, kb's against a prompt of the same length that no one sent (a coordinator
    with `--shared-caches` gives kb ka's);
12. 1,100 gRPC streams without a key (11 connections), each sending 7 bytes of a Generate request
    that declares 64 KiB, then nothing; the same against the open health check; meanwhile a health
    check and a Generate of key kb;
13. five rounds of 100 health checks (one connection each round, kept open), each sending 1 MiB of
    its message but not its last bytes: the coordinator's resident memory after each round's bytes
    are in and once --grpc-request-message-timeout-s (default 10 s) has ended them.
    SPECDEC_COORDINATOR_GRPC_REQUEST_MESSAGE_TIMEOUT_S=0 shows it without the bound.

Then, on a second stack with a Redis request store (``redis-server`` on this machine) and a small
verify KV budget:

14. key ka sends request after request with the largest records it may, into a Redis with room for
    2 MB more (its 8 ended and 16 running records take about 200 KB, its connections the rest), while
    key kb starts and resumes its own;
15. key ka's long requests put the verify KV budget under pressure while key kb's short ones run.

    .venv/bin/python scripts/abuse_check.py
"""

import collections
import concurrent.futures
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import psutil
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.api.auth import owner_hash
from coordinator.api.client import generate
from specdec.engine.model_files import DEFAULT_MODEL, load_tokenizer
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec_app.launcher import LocalCluster, free_port

KEYS = ("ka", "kb")
STALL_S = 5.0


def post(port: int, path: str, body: bytes, key: str | None) -> tuple[int, dict, dict]:
    """Status, JSON body (the first event of a stream) and headers of one POST."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        streamed = response.getheader("content-type", "").startswith("text/event-stream")
        raw = response.readline() if streamed else response.read()  # readline: chunked decoding
        try:
            body = json.loads(raw.removeprefix(b"data: "))
        except json.JSONDecodeError:
            body = {"error": {"message": f"not JSON: {raw[:200]!r}"}}
        return response.status, body, dict(response.getheaders())
    finally:
        connection.close()


def chat(message: str, **fields) -> bytes:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": message}], "max_tokens": 8} | fields
    return json.dumps(body).encode()


class HealthProbe:
    """GET /health every 20 ms in a thread; the slowest answer while it ran, seconds."""

    def __init__(self, port: int):
        self.port, self.slowest, self.running = port, 0.0, True
        self.thread = threading.Thread(target=self._probe, daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        while self.running:
            started = time.perf_counter()
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=60).read()
            self.slowest = max(self.slowest, time.perf_counter() - started)
            time.sleep(0.02)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return self.slowest


def tenants(grpc_address: str) -> None:
    secret = coordinator_pb2.GenerateRequest(
        text="My bank PIN is 4821. Repeat my PIN back to me.", max_new_tokens=32, request_id="secret-42"
    )
    owner = generate(grpc_address, secret, timeout_s=300, api_key="ka")
    try:
        resume = coordinator_pb2.GenerateRequest(request_id="secret-42", resume_from=0)
        leaked = generate(grpc_address, resume, timeout_s=300, api_key="kb")
        print(f"1. kb resumes ka's secret-42: got {len(leaked.token_ids)} tokens: LEAK")
    except grpc.RpcError as err:
        print(f"1. kb resumes ka's secret-42: {err.code().name}: {err.details()}")
    mine = coordinator_pb2.GenerateRequest(text="Hello.", max_new_tokens=8, request_id="secret-42")
    theirs = generate(grpc_address, mine, timeout_s=300, api_key="kb")
    again = generate(grpc_address, coordinator_pb2.GenerateRequest(request_id="secret-42", resume_from=0), 300, "ka")
    print(
        f"   kb starts its own secret-42: {len(theirs.token_ids)} tokens; ka resumes its own: "
        f"{'identical' if again.token_ids == owner.token_ids else 'DIFFERENT'} ({len(again.token_ids)} tokens)"
    )


def stop_strings(http_port: int) -> None:
    for name, stop in (
        ("one 1 MB stop string", ["x" * 1_000_000]),
        ("10,000 stop strings", [f"s{i}" for i in range(10_000)]),
    ):
        probe = HealthProbe(http_port)
        started = time.perf_counter()
        status, body, _ = post(http_port, "/v1/chat/completions", chat("Hi", stop=stop), "ka")
        took = time.perf_counter() - started
        time.sleep(0.1)
        print(
            f"2. {name}: {status} in {took * 1000:.0f} ms ({body.get('error', {}).get('message', '')[:90]}); "
            f"slowest /health meanwhile {probe.stop() * 1000:.0f} ms"
        )


def one_key_many_streams(http_port: int) -> None:
    def stream(_: int) -> tuple[int, str | None]:
        status, body, headers = post(http_port, "/v1/chat/completions", chat("Count to ten.", stream=True), "ka")
        if status not in (200, 429) or "not JSON" in str(body):
            print(f"   unexpected: {status} {body}")
        return status, headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        streams = pool.map(stream, range(40))
        time.sleep(1.0)
        started = time.perf_counter()
        status, _, _ = post(http_port, "/v1/chat/completions", chat("Say hi."), "kb")
        other = f"{status} in {time.perf_counter() - started:.1f} s"
        results = list(streams)
    refused = [retry for status, retry in results if status == 429]
    print(
        f"3. ka opens 40 streams: {sum(s == 200 for s, _ in results)} got 200, {len(refused)} got 429 "
        f"(Retry-After {sorted(set(refused))}); kb meanwhile: {other}"
    )


def sessions(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdec_num_sessions "))


def stalled_stream(grpc_address: str, verify_metrics_port: int) -> None:
    options = [*GRPC_OPTIONS, ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    request = coordinator_pb2.GenerateRequest(text="Tell me a long story.", max_new_tokens=1024, ignore_eos=True)
    with grpc.insecure_channel(grpc_address, options=options) as channel:
        call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
            request, timeout=600, metadata=[("authorization", "Bearer ka")]
        )
        next(call)
        started = time.monotonic()
        held = sessions(verify_metrics_port)
        while sessions(verify_metrics_port) and time.monotonic() - started < 120:
            time.sleep(0.2)
        released = time.monotonic() - started
        try:
            received = sum(len(r.token_ids) for r in call)
            ending = f"ended normally after {received} more tokens"
        except grpc.RpcError as err:
            ending = f"{err.code().name}: {err.details()}"
    print(f"4. a stream nobody reads: {held:.0f} verify session(s) held, released after {released:.1f} s; {ending}")


def before_the_body(http_port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
    started = time.perf_counter()
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(8 * 1024 * 1024))
    connection.endheaders()
    response = connection.getresponse()
    took_ms = (time.perf_counter() - started) * 1000
    print(f"5. 8 MiB body without a key, headers only: {response.status} in {took_ms:.0f} ms")
    connection.close()
    with socket.create_connection(("127.0.0.1", http_port), timeout=60) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.perf_counter()
        outcome = "closed" if slow.recv(1024) == b"" else "answered"
        print(f"   a header that never ends: {outcome} after {time.perf_counter() - started:.1f} s")


def prompts(http_port: int) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    text = "The capital of France is"
    body = {"model": "smollm2", "max_tokens": 16, "temperature": 0}
    _, by_text, _ = post(http_port, "/v1/completions", json.dumps(body | {"prompt": text}).encode(), "ka")
    ids = tokenizer(text).input_ids
    _, by_ids, _ = post(http_port, "/v1/completions", json.dumps(body | {"prompt": ids}).encode(), "ka")
    same = by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    print(f"6. token-id prompt ({len(ids)} ids): {'same text as' if same else 'DIFFERS from'} the text prompt's")
    deep = b'{"model": "smollm2", "prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body, _ = post(http_port, "/v1/completions", deep, "ka")
    print(f"   JSON nested 100,000 deep: {status} ({body['error']['message']})")


def store_fill(grpc_address: str, store: redis.Redis) -> None:
    kept = coordinator_pb2.GenerateRequest(request_id="kb-kept", text="Hello.", max_new_tokens=16, ignore_eos=True)
    kept_tokens = generate(grpc_address, kept, timeout_s=300, api_key="kb").token_ids
    store.config_set("maxmemory", store.info("memory")["used_memory"] + 2_000_000)
    largest = coordinator_pb2.GenerateRequest(
        text="word " * 100, max_new_tokens=48, ignore_eos=True, logprobs=True, top_logprobs=20
    )

    def send(_: int) -> str:
        try:
            generate(grpc_address, largest, timeout_s=300, api_key="ka")
            return "OK"
        except grpc.RpcError as err:
            return f"{err.code().name} ({err.details()[:60]})"

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(send, range(80)))
    took = time.perf_counter() - started
    kept_by_ka = store.keys(f"specdec:request:{{{owner_hash('ka')}/*}}")
    memory = store.info("memory")
    resume = coordinator_pb2.GenerateRequest(request_id="kb-kept", resume_from=4)
    resumed = generate(grpc_address, resume, timeout_s=300, api_key="kb").token_ids == kept_tokens[4:]
    new = len(
        generate(grpc_address, coordinator_pb2.GenerateRequest(text="Hi.", max_new_tokens=8), 300, "kb").token_ids
    )
    print(
        f"14. ka sends 80 requests of its largest records in {took:.0f} s: {outcomes.count('OK')} served, "
        f"refused: {dict(collections.Counter(o for o in outcomes if o != 'OK'))}; ka keeps {len(kept_by_ka)} "
        "records; Redis uses "
        f"{memory['used_memory']} of {memory['maxmemory']} bytes; kb's resume "
        f"{'identical' if resumed else 'DIFFERENT'}, kb's new request {new} tokens"
    )


def kv_pressure(grpc_address: str) -> None:
    done = threading.Event()
    longs: list[int] = []

    def keep_sending(i: int) -> None:
        request = coordinator_pb2.GenerateRequest(
            text=f"Write a long essay about topic {i}.", max_new_tokens=160, ignore_eos=True, num_speculative_tokens=0
        )
        while not done.is_set():
            longs.append(generate(grpc_address, request, timeout_s=600, api_key="ka").metrics.num_verify_rebuilds)

    senders = [threading.Thread(target=keep_sending, args=(i,)) for i in range(3)]
    for sender in senders:
        sender.start()
    time.sleep(5)
    shorts, started = [], time.perf_counter()
    for i in range(4):
        request = coordinator_pb2.GenerateRequest(
            text=f"Name a colour ({i}).", max_new_tokens=24, ignore_eos=True, num_speculative_tokens=0
        )
        shorts.append(generate(grpc_address, request, timeout_s=600, api_key="kb").metrics.num_verify_rebuilds)
    took = time.perf_counter() - started
    done.set()
    for sender in senders:
        sender.join(600)
    print(
        f"15. under ka's KV pressure ({len(longs)} long requests, rebuilds {longs}): kb's 4 short requests took "
        f"{took:.0f} s, rebuilds {shorts}"
    )


def pressure_checks() -> None:
    """Checks 7 and 8, on a stack with a Redis request store and a verify KV budget of 24 blocks of
    SmolLM2 (16 tokens x 46,080 bytes each), drafting with n-gram lookup only (the KV under test is
    the target's); ka keeps at most 8 ended requests (a sized deployment)."""
    if shutil.which("redis-server") is None:
        print("7-8. skipped: redis-server is not installed (scripts/setup.sh --test installs it)")
        return
    redis_port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "noeviction",
        ],
        stdout=subprocess.DEVNULL,
    )
    os.environ["SPECDEC_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    cluster = LocalCluster(
        coordinator_port=free_port(),
        draft_port=free_port(),
        verify_port=free_port(),
        extra_args={
            "coordinator": ["--max-finished-requests-per-client", "8"],
            "verify": ["--kv-cache-max-bytes", str(24 * 16 * 46_080)],
            "draft": ["--drafters", "ngram", "--default-drafter", "ngram"],
        },
    )
    cluster.start_all()
    try:
        store_fill(cluster.address("coordinator"), redis.Redis(port=redis_port))
        kv_pressure(cluster.address("coordinator"))
    finally:
        cluster.stop()
        del os.environ["SPECDEC_REDIS_URL"]
        server.kill()
        server.wait()


def other_key_completion(http_port: int) -> str:
    """Key kb's chat completion: its status and time."""
    started = time.perf_counter()
    status, _, _ = post(http_port, "/v1/chat/completions", chat("Say hi."), "kb")
    return f"{status} in {time.perf_counter() - started:.2f} s"


def first_error(sockets: list[socket.socket]) -> tuple[list[int], str]:
    """The status of each socket's response (0: none yet) and the first error message."""
    statuses, message = [], ""
    for sock in sockets:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, ConnectionResetError):
            data = b""
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
        statuses.append(status)
        if status and not message:
            message = json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"]
    return statuses, message


def never_ending_bodies(http_port: int, count: int = 1100) -> None:
    """Key ka opens ``count`` connections, each sending a header that declares a 1,000-byte body
    and 10 bytes of it, then nothing."""
    probe = HealthProbe(http_port)
    started = time.perf_counter()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Authorization: Bearer ka\r\nContent-Length: 1000\r\n\r\n{"model": '
    )
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", http_port), timeout=5)
        sock.sendall(head)
        sockets.append(sock)
    opened = time.perf_counter() - started
    time.sleep(1.0)
    for sock in sockets:
        sock.setblocking(False)
    statuses, message = first_error(sockets)
    other = other_key_completion(http_port)
    parked = [sock for sock, status in zip(sockets, statuses, strict=True) if not status]
    for sock in parked:
        sock.setblocking(True)
        sock.settimeout(60)
    waited = time.perf_counter()
    late, _ = first_error(parked)  # each blocks until its answer: the body deadline's
    print(
        f"7. ka: {count} bodies that never end (opened in {opened:.1f} s): {statuses.count(429)} got 429 at once "
        f"({message[:110]}); {len(parked)} parked, then {late.count(408)} got 408 after "
        f"{time.perf_counter() - waited + 1.0:.0f} s more; kb meanwhile: {other}; slowest /health "
        f"{probe.stop() * 1000:.0f} ms"
    )
    for sock in sockets:
        sock.close()


def many_chat_messages(http_port: int, bodies: int = 4, messages: int = 200_000) -> None:
    """Key ka sends ``bodies`` chat completions of ``messages`` empty messages each, at once."""
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": ""}] * messages}).encode()
    probe = HealthProbe(http_port)

    def send(_: int) -> tuple[int, float, str]:
        started = time.perf_counter()
        status, answer, _ = post(http_port, "/v1/chat/completions", body, "ka")
        return status, time.perf_counter() - started, answer.get("error", {}).get("message", "")

    with concurrent.futures.ThreadPoolExecutor(bodies) as pool:
        sent = pool.map(send, range(bodies))
        other = other_key_completion(http_port)
        results = list(sent)
    print(
        f"8. ka: {bodies} bodies of {messages:,} chat messages ({len(body) / 1e6:.1f} MB) at once: "
        f"{sorted({status for status, _, _ in results})} in {max(took for _, took, _ in results) * 1000:.0f} ms at "
        f"most ({results[0][2][:100]}); kb meanwhile: {other}; slowest /health {probe.stop() * 1000:.0f} ms"
    )


def unknown_models(http_port: int, count: int = 2000) -> None:
    """Key ka asks for ``count`` completions, 16 at a time, each naming a model no one serves."""
    probe = HealthProbe(http_port)

    def send(i: int) -> int:
        body = json.dumps({"model": f"no-such-model-{i}", "prompt": "hi", "max_tokens": 1}).encode()
        return post(http_port, "/v1/completions", body, "ka")[0]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        sent = pool.map(send, range(count))
        other = other_key_completion(http_port)
        statuses = list(sent)
    took = time.perf_counter() - started
    _, answer, _ = post(http_port, "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), "ka")
    print(
        f"9. ka: {count} requests naming unknown models in {took:.1f} s ({took / count * 1000:.2f} ms each): "
        f"{sorted(set(statuses))} ({answer['error']['message'][:90]}); kb meanwhile: {other}; slowest /health "
        f"{probe.stop() * 1000:.0f} ms"
    )


def huge_headers(http_port: int) -> None:
    """A request header of 1 MB, and one of 10,000 fields, from key ka."""
    for name, fields in (
        ("a 1 MB header", [f"X-Pad: {'a' * 1_000_000}"]),
        ("10,000 header fields", [f"X-{i}: v" for i in range(10_000)]),
    ):
        data = "\r\n".join(["GET /v1/models HTTP/1.1", "Host: x", "Authorization: Bearer ka", *fields, "", ""])
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", http_port), timeout=30) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered and closed before its end
                sock.sendall(data.encode())
            statuses, message = first_error([sock])
        took = (time.perf_counter() - started) * 1000
        print(f"10. {name}: {statuses[0]} in {took:.0f} ms ({message[:100]})")


def cross_tenant_prefix(grpc_address: str) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    text = (Path(__file__).parents[1] / "benchmarks/conversation/system_prompt.txt").read_text()

    def system_prompt() -> str:  # about 1,000 tokens that no one sent before
        return tokenizer.decode(tokenizer(f"Session {uuid.uuid4().hex}. {text} {text}").input_ids[:1000])

    def ask(key: str, *messages: tuple[str, str]) -> tuple[str, int, float]:
        request = coordinator_pb2.GenerateRequest(
            chat=coordinator_pb2.ChatMessages(
                messages=[coordinator_pb2.ChatMessage(role=role, content=content) for role, content in messages]
            ),
            max_new_tokens=16,
            temperature=0,
        )
        completion = generate(grpc_address, request, timeout_s=300, api_key=key)
        return completion.text, completion.metrics.num_cached_prompt_tokens, completion.metrics.time_to_first_token_ms

    theirs, fresh = ("system", system_prompt()), ("system", system_prompt())
    question = ("user", "What is our refund policy?")
    answer, *first = ask("ka", theirs, question)
    again = ask("ka", theirs, ("user", "How do I reset my password?"))[1:]
    turn = ask("ka", theirs, question, ("assistant", answer), ("user", "And for digital goods?"))[1:]
    other, control = ask("kb", theirs, question)[1:], ask("kb", fresh, question)[1:]
    print(
        "11. ka's ~1,000-token system prompt (cached prompt tokens, TTFT): "
        f"ka first {first[0]}, {first[1]:.0f} ms; ka again (another question) {again[0]}, {again[1]:.0f} ms; "
        f"ka's second turn {turn[0]}, {turn[1]:.0f} ms;\n    kb with ka's {other[0]}, {other[1]:.0f} ms; "
        f"kb with one no one sent {control[0]}, {control[1]:.0f} ms"
    )


def main() -> None:
    os.environ["SPECDEC_API_KEYS"] = ",".join(KEYS)
    os.environ["SPECDEC_COORDINATOR_ALLOW_SHORT_API_KEYS"] = "true"  # ka and kb: short on purpose
    metrics_port = free_port()
    cluster = LocalCluster(
        coordinator_port=free_port(),
        draft_port=free_port(),
        verify_port=free_port(),
        http_port=free_port(),
        metrics_ports={"verify": metrics_port},
        extra_args={"coordinator": ["--stream-stall-timeout-s", str(STALL_S)]},
    )
    cluster.start_all()
    try:
        grpc_address = cluster.address("coordinator")
        tenants(grpc_address)
        stop_strings(cluster.http_port)
        one_key_many_streams(cluster.http_port)
        stalled_stream(grpc_address, metrics_port)
        before_the_body(cluster.http_port)
        prompts(cluster.http_port)
        never_ending_bodies(cluster.http_port)
        many_chat_messages(cluster.http_port)
        unknown_models(cluster.http_port)
        huge_headers(cluster.http_port)
        cross_tenant_prefix(grpc_address)
        stalled_streams(cluster.host, cluster.coordinator_port, cluster.services["coordinator"].started.pid)
        stalled_messages(cluster.host, cluster.coordinator_port, cluster.services["coordinator"].started.pid)
    finally:
        cluster.stop()
    pressure_checks()


class StalledStreams:
    """A raw HTTP/2 client (the ``h2`` package) that opens ``count`` gRPC calls to ``path`` at
    ``host:port`` over plaintext, ``per_connection`` per connection: each sends its headers
    (``metadata`` added) and the first ``len(sent)`` bytes of a message whose length prefix
    declares ``declared`` bytes (as fast as the server's flow-control windows let it), then nothing.
    A thread per connection reads what the server answers: :meth:`statuses` counts the calls by
    outcome (their ``grpc-status``, ``reset <code>`` for RST_STREAM, ``open`` for none yet), and
    :attr:`details` holds the ``grpc-message`` of each that had one."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        count: int,
        per_connection: int = 100,
        declared: int = 65536,
        sent: bytes = b"\x0a\x05hello",
        metadata: tuple[tuple[str, str], ...] = (),
    ):
        self.outcomes: dict[tuple[int, int], str] = {}
        self.details: dict[tuple[int, int], str] = {}
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.readers: list[threading.Thread] = []
        self.unsent: dict[tuple[int, int], bytes] = {}  # what each call has still to send, by (connection, stream)
        self.sent = 0  # message bytes sent, every call together
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{host}:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        prefix = b"\x00" + declared.to_bytes(4, "big")
        for first in range(0, count, per_connection):
            connection = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
            connection.initiate_connection()
            sock = socket.create_connection((host, port), timeout=None)
            for _ in range(min(per_connection, count - first)):
                stream_id = connection.get_next_available_stream_id()
                connection.send_headers(stream_id, headers)
                self.outcomes[(len(self.sockets), stream_id)] = "open"
                self.unsent[(len(self.sockets), stream_id)] = prefix + sent
            self._send(len(self.sockets), connection)
            sock.sendall(connection.data_to_send())
            reader = threading.Thread(target=self._read, args=(len(self.sockets), sock, connection), daemon=True)
            self.sockets.append(sock)
            self.readers.append(reader)
            reader.start()

    def _read(self, index: int, sock: socket.socket, connection: h2.connection.H2Connection) -> None:
        try:
            while data := sock.recv(65536):
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        headers = dict(event.headers)
                        if "grpc-status" in headers:
                            self._outcome(index, event.stream_id, grpc_status_name(headers["grpc-status"]))
                            self.details[(index, event.stream_id)] = urllib.parse.unquote(
                                headers.get("grpc-message", "")
                            )
                    elif isinstance(event, h2.events.StreamReset):
                        self._outcome(index, event.stream_id, f"reset {event.error_code!s}")
                self._send(index, connection)
                sock.sendall(connection.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            return

    def _send(self, index: int, connection: h2.connection.H2Connection) -> None:
        """Queues what the flow-control windows let the calls of connection ``index`` send."""
        for key in [key for key in self.unsent if key[0] == index]:
            stream_id = key[1]
            if connection.state_machine.state is h2.connection.ConnectionState.CLOSED or not self.unsent[key]:
                del self.unsent[key]
                continue
            try:
                size = min(connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size)
            except h2.exceptions.StreamClosedError:
                del self.unsent[key]
                continue
            while size > 0 and self.unsent[key]:
                chunk, self.unsent[key] = self.unsent[key][:size], self.unsent[key][size:]
                connection.send_data(stream_id, chunk)
                self.sent += len(chunk)
                size = min(connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size)

    def _outcome(self, index: int, stream_id: int, outcome: str) -> None:
        with self.lock:
            if self.outcomes.get((index, stream_id)) == "open":
                self.outcomes[(index, stream_id)] = outcome

    def statuses(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.outcomes.values())

    def wait_sent(self, timeout_s: float) -> None:
        """Waits until every call has sent what it was to, or the server's flow control has let no
        more through for a second, ``timeout_s`` seconds at most."""
        deadline, last = time.monotonic() + timeout_s, (-1, 0.0)
        while self.unsent and time.monotonic() < deadline:
            if self.sent != last[0]:
                last = (self.sent, time.monotonic())
            elif time.monotonic() - last[1] > 1.0:
                return
            time.sleep(0.02)

    def wait_answered(self, timeout_s: float) -> bool:
        """Whether every call had an answer within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.statuses()["open"] and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.statuses()["open"]

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for reader in self.readers:
            reader.join()


def grpc_status_name(code: str) -> str:
    """``"16"`` -> ``"UNAUTHENTICATED"``."""
    return next((status.name for status in grpc.StatusCode if status.value[0] == int(code)), code)


STALLED = 1100
GENERATE = "/specdec.v1.CoordinatorService/Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def timed(call) -> tuple[float, str]:
    """Milliseconds ``call()`` took and what it answered (or the status it failed with)."""
    started = time.perf_counter()
    try:
        outcome = str(call())
    except grpc.RpcError as err:
        outcome = err.code().name
    return (time.perf_counter() - started) * 1000, outcome


def open_connections(pid: int, port: int) -> int:
    """TCP connections of process ``pid`` on its port ``port``."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.laddr.port == port and c.raddr)


def stalled_streams(host: str, port: int, pid: int) -> None:
    address = f"{host}:{port}"
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def check() -> str:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(
                health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
            )

        def keyed() -> str:
            request = coordinator_pb2.GenerateRequest(text="Hello.", max_new_tokens=8)
            return f"{len(generate(address, request, timeout_s=60, api_key='kb').token_ids)} tokens"

        for number, path in (("12.", GENERATE), ("   ", HEALTH_CHECK)):
            started = time.perf_counter()
            streams = StalledStreams(host, port, path, STALLED)
            opened_ms = (time.perf_counter() - started) * 1000
            streams.wait_answered(2.0)
            answered_ms = (time.perf_counter() - started) * 1000
            health_ms, health_status = timed(check)
            keyed_ms, keyed_outcome = timed(keyed)
            statuses = dict(streams.statuses())
            connections = open_connections(pid, port)
            streams.close()
            time.sleep(1.0)
            print(
                f"{number} {STALLED} stalled keyless streams to {path} ({len(streams.sockets)} connections, "
                f"opened in {opened_ms:.0f} ms): {statuses} after {answered_ms:.0f} ms; meanwhile Health/Check "
                f"{health_status} in {health_ms:.0f} ms, kb's Generate {keyed_outcome} in {keyed_ms:.0f} ms; "
                f"coordinator connections {connections} during, {open_connections(pid, port)} after"
            )


def stalled_messages(host: str, port: int, pid: int, rounds: int = 5, calls: int = 100) -> None:
    process = psutil.Process(pid)
    timeout_s = float(os.environ.get("SPECDEC_COORDINATOR_GRPC_REQUEST_MESSAGE_TIMEOUT_S", "10"))
    before = process.memory_info().rss
    opened = []
    try:
        for round_number in range(1, rounds + 1):
            started = time.perf_counter()
            streams = StalledStreams(host, port, HEALTH_CHECK, calls, declared=1 << 20, sent=b"\x0a" * ((1 << 20) - 16))
            opened.append(streams)
            streams.wait_sent(timeout_s / 2 if timeout_s else 10.0)
            sent = f"{streams.sent / 2**20:.0f} MiB sent in {time.perf_counter() - started:.1f} s"
            sent_mb = (process.memory_info().rss - before) / 1e6
            streams.wait_answered(timeout_s + 5.0 if timeout_s else 2.0)
            print(
                f"{'13.' if round_number == 1 else '   '} round {round_number}: {calls} health checks sending 1 MiB "
                f"each ({sent}): coordinator RSS +{sent_mb:.0f} MB; then {dict(streams.statuses())} after "
                f"{time.perf_counter() - started:.1f} s, RSS +{(process.memory_info().rss - before) / 1e6:.0f} MB "
                "(connections kept open)"
            )
    finally:
        for streams in opened:
            streams.close()


if __name__ == "__main__":
    main()

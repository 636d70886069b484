"""`specdec bench batch1|concurrency --network-rtt-ms`: the delaying proxy on real ports in front of a real echo
server (round-trip times, large payloads, many connections, closes both ways, jitter without
reordering), the network settings and their refusals, and the reports' network figures from
hand-made records. Both modes through the proxies on the tiny models are smoke runs, long checks
(scripts/long_checks.sh)."""

import os
import socket
import socketserver
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specdec_app.bench.network import (
    DelayedLinks,
    NetworkSetting,
    network_settings,
    parse_rtts,
    parse_topologies,
    split_setting,
)
from specdec_app.launcher import free_port


class _Echo(socketserver.BaseRequestHandler):
    """Echoes every byte back until the client closes, or closes itself after reading ``bye``;
    notes when it saw the client's close."""

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(65536):
            if data == b"bye":
                self.server.closed_by_server.set()  # type: ignore[attr-defined]
                return
            self.request.sendall(data)
        self.server.client_closed_at = time.monotonic()  # type: ignore[attr-defined]
        self.server.client_closed.set()  # type: ignore[attr-defined]


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: 64 connections at once

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Echo)
        self.client_closed, self.closed_by_server = threading.Event(), threading.Event()
        self.client_closed_at = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def start_links(upstream: str, setting: NetworkSetting) -> DelayedLinks:
    """A proxy on a free port in front of ``upstream`` (as the verify link), delayed as ``setting``."""
    links = DelayedLinks({"verify": upstream}, {"verify": f"127.0.0.1:{free_port()}"})
    links.start()
    links.apply(setting)
    return links


@pytest.fixture
def proxied(echo) -> Iterator[tuple[EchoServer, DelayedLinks]]:
    links = start_links(echo.address, NetworkSetting(40.0))
    yield echo, links
    links.stop()


def connect(links: DelayedLinks) -> socket.socket:
    host, _, port = links.addresses()["verify"].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def receive(sock: socket.socket, size: int) -> bytes:
    chunks, received = [], 0
    while received < size:
        chunk = sock.recv(min(65536, size - received))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def round_trip_ms(sock: socket.socket, payload: bytes = b"x") -> float:
    start = time.perf_counter()
    sock.sendall(payload)
    assert receive(sock, len(payload)) == payload
    return (time.perf_counter() - start) * 1000


def test_a_round_trip_takes_the_rtt_and_not_much_more(proxied):
    _, links = proxied
    with connect(links) as sock:
        times = [round_trip_ms(sock) for _ in range(8)]
    assert min(times) >= 40.0  # each direction waited 20 ms after the proxy read it
    assert statistics.median(times) < 40.0 + 15.0, times  # a few ms of asyncio timers and a loaded CPU at most
    links.apply(NetworkSetting(10.0))  # a new setting applies to an open proxy's next connection and bytes
    with connect(links) as sock:
        assert 10.0 <= statistics.median([round_trip_ms(sock) for _ in range(8)]) < 10.0 + 15.0


def test_the_topology_delays_only_its_links(echo):
    """beside-verify delays the draft link only; at RTT 0 no link is delayed."""
    links = DelayedLinks(
        {"draft": echo.address, "verify": echo.address},
        {"draft": f"127.0.0.1:{free_port()}", "verify": f"127.0.0.1:{free_port()}"},
    )
    links.start()
    try:
        links.apply(NetworkSetting(60.0, "beside-verify"))
        assert links.proxies["draft"].delay_s == (0.03, 0.0) and links.proxies["verify"].delay_s == (0.0, 0.0)
        host, _, port = links.addresses()["verify"].rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert round_trip_ms(sock) < 30.0
        links.apply(NetworkSetting(0.0))
        assert {proxy.delay_s for proxy in links.proxies.values()} == {(0.0, 0.0)}
    finally:
        links.stop()


def test_large_payloads_arrive_intact_and_in_order(echo):
    """8 MiB each way through a 10 ms RTT, written while the echo comes back."""
    links = start_links(echo.address, NetworkSetting(10.0))
    payload = os.urandom(8 * 2**20)
    try:
        with connect(links) as sock:
            writer = threading.Thread(target=sock.sendall, args=(payload,))
            writer.start()
            echoed = receive(sock, len(payload))
            writer.join()
        assert echoed == payload
    finally:
        links.stop()


def test_many_concurrent_connections(proxied):
    """64 connections at once, each its own bytes back, side by side: in well under the 64 RTTs
    one after another would take."""
    _, links = proxied
    results: dict[int, bytes] = {}

    def client(i: int) -> None:
        with connect(links) as sock:
            message = f"connection {i} ".encode() * 100
            sock.sendall(message)
            results[i] = receive(sock, len(message))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_ms = (time.perf_counter() - start) * 1000
    assert results == {i: f"connection {i} ".encode() * 100 for i in range(64)}
    # served side by side: serially it would take 64 RTTs (2,560 ms); under the other test
    # worker's load 64 threads took 791 ms once, so the bound is half the serial time
    assert elapsed_ms < 64 * 40.0 / 2, elapsed_ms


def test_a_client_close_closes_the_upstream_connection(proxied):
    echo, links = proxied
    sock = connect(links)
    round_trip_ms(sock)
    sock.close()
    closed_at = time.monotonic()
    assert echo.client_closed.wait(5)  # the upstream connection saw the close...
    assert echo.client_closed_at - closed_at >= 0.02 - 0.002  # ...after the link's one-way delay, like data


def test_a_server_close_closes_the_client_connection(proxied):
    echo, links = proxied
    with connect(links) as sock:
        round_trip_ms(sock)
        sock.sendall(b"bye")
        assert echo.closed_by_server.wait(5)
        sock.settimeout(5)
        assert sock.recv(1) == b""  # EOF: the proxy closed the client's side too


def test_an_unreachable_upstream_closes_the_client_connection():
    links = start_links(f"127.0.0.1:{free_port()}", NetworkSetting(0.0))  # nothing listens there
    try:
        with connect(links) as sock:
            sock.settimeout(5)
            assert sock.recv(1) == b""
    finally:
        links.stop()


def test_stopping_the_links_closes_open_connections(echo):
    links = start_links(echo.address, NetworkSetting(0.0))
    sock = connect(links)
    round_trip_ms(sock)
    links.stop()
    sock.settimeout(5)
    assert sock.recv(1) == b""
    sock.close()


def test_jitter_never_reorders_bytes(echo):
    """20 ms +- 10 ms each way: 400 numbered messages sent 0.2 ms apart come back in order."""
    links = start_links(echo.address, NetworkSetting(20.0, jitter_ms=20.0))
    messages = [f"<{i}>".encode() for i in range(400)]
    expected = b"".join(messages)
    try:
        assert links.proxies["verify"].delay_s == (0.01, 0.02)
        with connect(links) as sock:

            def send() -> None:
                for message in messages:
                    sock.sendall(message)
                    time.sleep(0.0002)

            writer = threading.Thread(target=send)
            writer.start()
            echoed = receive(sock, len(expected))
            writer.join()
        assert echoed == expected
        with connect(links) as sock:
            times = [round_trip_ms(sock) for _ in range(20)]
        assert min(times) >= 0.0 and max(times) - min(times) > 2.0, times  # the delay does vary
    finally:
        links.stop()


def test_settings_and_their_refusals():
    assert parse_rtts("20,0,5,5") == [0.0, 5.0, 20.0]
    for bad in ("", "a", "-1,5"):
        with pytest.raises(ValueError, match="--network-rtt-ms"):
            parse_rtts(bad)
    assert parse_topologies("beside-verify,apart") == ["apart", "beside-verify"]
    with pytest.raises(ValueError, match="--network-topology 'next-door'"):
        parse_topologies("next-door")
    settings = network_settings([0.0, 5.0, 20.0], ["apart", "beside-verify"], jitter_ms=2.0)
    assert [s.suffix for s in settings] == [
        "@rtt0ms",
        "@rtt5ms-apart",
        "@rtt5ms-beside-verify",
        "@rtt20ms-apart",
        "@rtt20ms-beside-verify",
    ]
    assert settings[0].one_way_ms("draft") == (0.0, 0.0)  # no jitter at RTT 0
    assert settings[1].one_way_ms("verify") == (2.5, 2.0) and settings[2].one_way_ms("verify") == (0.0, 0.0)
    assert NetworkSetting(2.5, "beside-draft").one_way_ms("verify") == (1.25, 0.0)
    with pytest.raises(ValueError, match="--network-jitter-ms 6: use 0 up to the smallest RTT above 0 \\(5 ms\\)"):
        network_settings([0.0, 5.0], ["apart"], jitter_ms=6.0)
    assert split_setting("llama-cpp/K=8@split@rtt2.5ms-beside-draft") == (
        "llama-cpp/K=8@split",
        NetworkSetting(2.5, "beside-draft"),
    )
    assert split_setting("pipeline/K=0@rtt0ms") == ("pipeline/K=0", NetworkSetting(0.0))
    assert split_setting("llama-cpp/K=8@split") == ("llama-cpp/K=8@split", None)


# ---- options, report assembly, and the cluster's wiring ----


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["batch1", "--network-rtt-ms", "5,x"], "--network-rtt-ms '5,x': use comma-separated round-trip times"),
        (["batch1", "--network-rtt-ms", "0,5", "--network-topology", "mars"], "--network-topology 'mars': use a"),
        (["batch1", "--network-rtt-ms", "0,5", "--network-jitter-ms", "8"], "--network-jitter-ms 8: use 0 up to"),
        (["batch1", "--network-jitter-ms", "1"], "--network-jitter-ms and --network-topology need --network-rtt-ms"),
        (["concurrency", "--network-topology", "apart"], "--network-jitter-ms and --network-topology need"),
        (["concurrency", "--network-rtt-ms", "1,2", "--network-jitter-ms", "3"], "--network-jitter-ms 3: use"),
        (
            ["concurrency", "--arrivals", "closed", "--network-rtt-ms", "5", "--load-generator", "guidellm"],
            "--load-generator runs without a network between the services",
        ),
    ],
)
def test_bad_network_option_is_a_clear_error(tmp_path, args, message):
    """Each a bad value (the modes without a network refuse its options: tests/test_bench_cli.py)."""
    from typer.testing import CliRunner

    from specdec_app.cli import app
    from tests.conftest import write_questions

    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a"]})
    result = CliRunner().invoke(
        app, ["bench", args[0], "--questions", str(path), "--out", str(tmp_path / "o"), *args[1:]]
    )
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


def test_the_network_options_reach_both_modes(monkeypatch, tmp_path):
    """The CLI hands the batch-1 run and the load run the same settings (the runs stubbed)."""
    from typer.testing import CliRunner

    from specdec_app.bench import concurrency, run
    from specdec_app.cli import app
    from tests.conftest import write_questions

    seen = []

    def stop(config, console):
        seen.append(config)
        raise RuntimeError("stubbed")

    monkeypatch.setattr(run, "run_bench", stop)
    monkeypatch.setattr(concurrency, "run_concurrency", stop)
    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a"]})
    network = ["--network-rtt-ms", "20,0,5", "--network-jitter-ms", "2", "--network-topology", "beside-verify,apart"]
    for mode in (["batch1"], ["concurrency", "--concurrency", "1"]):
        result = CliRunner().invoke(app, ["bench", mode[0], "--questions", str(path), *mode[1:], *network])
        assert "stubbed" in result.output
        config = seen[-1]
        assert (config.network_rtts_ms, config.network_jitter_ms) == ([0.0, 5.0, 20.0], 2.0)
        assert config.network_topologies == ["apart", "beside-verify"] and len(config.network()) == 5
    assert seen[1].reference == "pipeline/K=0@rtt0ms"  # the identity reference: K = 0 at the first setting
    CliRunner().invoke(app, ["bench", "batch1", "--questions", str(path)])
    assert seen[-1].network_rtts_ms == [] and seen[-1].network() == []


def measurement(method: str, tokens: int, wall_ms: float, rounds: int, coordination_ms: float):
    from specdec_app.bench.measurement import Measurement

    pipeline = method != "plain"
    return Measurement(
        method=method,
        question_id=1,
        category="qa",
        token_ids=list(range(tokens)),
        wall_ms=wall_ms,
        ttft_ms=100.0,
        num_target_forwards=rounds + 1,
        num_spec_steps=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
        acceptance_histogram=[],
        draft_ms=2.0 * rounds if pipeline else 0.0,
        verify_ms=10.0 * rounds,
        num_verify_rounds=rounds,
        coordination_ms=coordination_ms if pipeline else None,
        wire_bytes=300 * rounds if pipeline else None,
    )


def test_batch1_network_rows_from_synthetic_measurements():
    """Speedup over plain in process, the ratio to K = 0 at the same RTT and placement,
    coordination per round and what the RTT added to it, bytes per round."""
    from specdec_app.bench.report import network_rows, network_table, summarize, to_markdown

    runs = [
        measurement("plain", 100, 5000.0, 99, 0.0),  # 20 tokens/s
        # adaptive: 10 rounds; coordination 1 ms a round at RTT 0, 12 ms at 10 ms
        measurement("llama-cpp/adaptive@split@rtt0ms", 100, 1000.0, 10, 10.0),
        measurement("llama-cpp/adaptive@split@rtt10ms-apart", 100, 2000.0, 10, 120.0),
        measurement("pipeline/K=0@split@rtt0ms", 100, 4000.0, 99, 99.0),
        measurement("pipeline/K=0@split@rtt10ms-apart", 100, 5000.0, 99, 1089.0),
    ]
    names = [m.method for m in runs]
    report = {"summary": summarize(runs, dict.fromkeys(names, 0)), "methods": names}
    rows = {(r["method"], r["rtt_ms"]): r for r in network_rows(report)}
    assert set(rows) == {(m, rtt) for m in ("llama-cpp/adaptive@split", "pipeline/K=0@split") for rtt in (0.0, 10.0)}
    slow = rows[("llama-cpp/adaptive@split", 10.0)]
    assert slow["topology"] == "apart" and slow["tokens_per_second"] == pytest.approx(50.0)
    assert slow["speedup"] == pytest.approx(2.5)  # over plain decoding in process
    assert slow["k0_ratio"] == pytest.approx(50.0 / 20.0)  # over pipeline/K=0 at the same RTT and placement
    assert slow["coordination_ms_per_round"] == pytest.approx(12.0)
    assert slow["coordination_over_rtt0_ms"] == pytest.approx(11.0)
    assert slow["coordination_over_rtt0_rtts"] == pytest.approx(1.1)
    assert slow["wire_bytes_per_round"] == pytest.approx(300.0)
    assert slow["round_ms"] == pytest.approx(2.0 + 10.0 + 12.0) and slow["draft_wait_ms_per_round"] == 2.0
    zero = rows[("llama-cpp/adaptive@split", 0.0)]
    assert zero["topology"] is None and zero["coordination_over_rtt0_ms"] == 0.0
    assert zero["coordination_over_rtt0_rtts"] is None
    assert rows[("pipeline/K=0@split", 10.0)]["coordination_over_rtt0_ms"] == pytest.approx(10.0)
    report |= {
        "network": {"rtts_ms": [0.0, 10.0], "jitter_ms": 0.0, "topologies": ["apart"], "rows": network_rows(report)},
        "categories": ["qa"],
        "config": {"command": "c", "target": "t", "draft_model": "d", "max_new_tokens": 8, "placements": ["split"]},
        "machine": {"cpu": "cpu", "cpu_count": 2, "device": "cpu", "torch": "x", "transformers": "y"},
        "num_questions": 1,
        "peak_rss_bytes": {},
        "mismatches": [],
    }
    table = network_table(report)
    assert table[0].startswith("| method | RTT ms | topology | tokens/s | vs K=0 | coordination ms/round |")
    row = "| llama-cpp/adaptive@split | 10 | apart | 50.0 | 2.50x | 12.0 | +11.0 | 1.10 | 300 | 2.50x | 100 |"
    assert any(line.startswith(row) and line.endswith("| 24.0 | 2.0 |") for line in table)
    markdown = to_markdown(report)
    assert "## A network between the services" in markdown and "RTTs 0, 10 ms; topologies apart." in markdown


def test_load_network_rows_ratios_and_tables_from_synthetic_cells():
    from specdec_app.bench.load_methods import ratio_pairs
    from specdec_app.bench.network import NetworkOptions
    from specdec_app.bench.report import comparison_table, concurrency_network_rows, concurrency_network_table

    options = NetworkOptions(network_rtts_ms=[0.0, 20.0])
    suffixes = [s.suffix for s in options.network()]
    names = [f"{m}{s}" for s in suffixes for m in ("pipeline/adaptive", "pipeline/K=0")] + ["transformers-serve"]
    assert ratio_pairs(names) == [
        ["pipeline/adaptive@rtt0ms", "pipeline/K=0@rtt0ms"],
        ["pipeline/adaptive@rtt20ms-apart", "pipeline/K=0@rtt20ms-apart"],
        ["pipeline/adaptive@rtt0ms", "transformers-serve"],
        ["pipeline/adaptive@rtt20ms-apart", "transformers-serve"],
        ["pipeline/K=0@rtt0ms", "transformers-serve"],
        ["pipeline/K=0@rtt20ms-apart", "transformers-serve"],
    ]
    assert ratio_pairs(["pipeline/adaptive", "pipeline/K=0"]) == [["pipeline/adaptive", "pipeline/K=0"]]
    figures = {  # tokens/s, coordination ms/round, bytes/round
        "pipeline/adaptive@rtt0ms": (80.0, 2.0, 500.0),
        "pipeline/K=0@rtt0ms": (40.0, 1.0, 100.0),
        "pipeline/adaptive@rtt20ms-apart": (30.0, 34.0, 500.0),
        "pipeline/K=0@rtt20ms-apart": (20.0, 21.0, 100.0),
        "transformers-serve": (50.0, None, None),
    }
    cells = [
        {
            "arrivals": "burst",
            "method": method,
            "concurrency": 16,
            "stats": {
                "tokens_per_second": tps,
                "coordination_ms_per_round": coordination,
                "wire_bytes_per_round": wire,
                "ttft_ms_p50": 300.0,
                "itl_ms_p50": 40.0,
                "identical_rate": 1.0,
            },
        }
        for method, (tps, coordination, wire) in figures.items()
    ]
    report = {"methods": names, "ratios": ratio_pairs(names), "cells": cells, "network": options.network_json()}
    report["network"]["rows"] = rows = concurrency_network_rows(report)
    assert [(r["method"], r["rtt_ms"]) for r in rows] == [
        ("pipeline/adaptive", 0.0),
        ("pipeline/K=0", 0.0),
        ("pipeline/adaptive", 20.0),
        ("pipeline/K=0", 20.0),
    ]
    slow = rows[2]
    assert slow["k0_ratio"] == pytest.approx(1.5) and slow["coordination_over_rtt0_ms"] == pytest.approx(32.0)
    assert slow["coordination_over_rtt0_rtts"] == pytest.approx(1.6) and slow["wire_bytes_per_round"] == 500.0
    row = "| burst | 16 | pipeline/adaptive | 20 | apart | 30.0 | 1.50x | 34.0 | +32.0 | 1.60 | 500 | 300 | 40.0 |"
    assert row in concurrency_network_table(report)
    # one comparison table per setting: its methods and transformers serve, the ratios within the setting
    table = comparison_table(report, "burst", "@rtt20ms-apart")
    assert table[0] == (
        "| N | pipeline/adaptive tokens/s | pipeline/K=0 tokens/s | transformers-serve tokens/s | adaptive TTFT p50 ms "
        "| K=0 TTFT p50 ms | serve TTFT p50 ms | adaptive / K=0 | adaptive / serve | K=0 / serve | adaptive identical "
        "| K=0 identical | serve identical |"
    )
    assert table[2].startswith("| 16 | 30.0 | 20.0 | 50.0 | 300 | 300 | 300 | 1.50x | 0.60x | 0.40x |")


def test_the_coordinator_is_given_the_proxies_and_on_network_applies_the_setting(tmp_path):
    """The proxied cluster's coordinator command line names the proxies, not the services; the
    other services' are unchanged. A method under a setting applies it before each run."""
    from specdec_app.bench.pipeline_method import OnNetwork, ProxiedCluster

    cluster = ProxiedCluster(free_port(), free_port(), free_port())
    cluster.links = DelayedLinks(
        {link: cluster.address(link) for link in ("draft", "verify")},
        {"draft": "127.0.0.1:1001", "verify": "127.0.0.1:1002"},
    )
    args = cluster.service_process("coordinator").args
    assert args[args.index("--draft-address") + 1] == "127.0.0.1:1001"
    assert args[args.index("--verify-addresses") + 1] == "127.0.0.1:1002"
    assert cluster.address("verify") not in args and cluster.address("draft") not in args
    assert cluster.service_process("verify").port == cluster.verify_port

    class Method:
        name, k = "ngram/K=2@rtt10ms-apart", 2

        def run(self, question):
            return {link: proxy.delay_s for link, proxy in cluster.links.proxies.items()}  # type: ignore[union-attr]

    wrapped = OnNetwork(Method(), cluster.links, NetworkSetting(10.0, "beside-draft"))
    assert wrapped.name == "ngram/K=2@rtt10ms-apart" and wrapped.k == 2
    assert wrapped.run("q") == {"draft": (0.0, 0.0), "verify": (0.005, 0.0)}


# ---- whole runs on tiny models: real services behind real proxies ----


def run_specdec_bench(tmp_path, tiny_models, mode, *args, categories=("qa", "math")) -> tuple[str, Path]:
    """``specdec bench MODE`` on the tiny target with ``args``, 8 new tokens, a prompt per category of
    ``categories`` (of qa and math); returns its stdout and the output folder."""
    import subprocess
    import sys

    from tests.conftest import write_questions

    prompts = {"qa": ["What is the capital of France?"], "math": ["Count to three."]}
    questions = write_questions(tmp_path / "q.jsonl", {category: prompts[category] for category in categories})
    out = tmp_path / "out"
    command = [sys.executable, "-m", "specdec", "bench", mode, *args, "--questions", str(questions), "--out", str(out)]
    command += ["--max-new-tokens", "8", "--target", str(tiny_models.target_dir), "--dtype", "float32"]
    command += ["--draft-model", str(tiny_models.draft_dir)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, out


@pytest.mark.multiprocess
@pytest.mark.long  # a smoke run of the bench: scripts/long_checks.sh
def test_batch1_through_the_proxies_on_tiny_models(tmp_path, tiny_models):
    """Every pipeline and pipeline/K=0 under RTT 0 and 20 ms in two topologies, on one set of
    services: identical to plain decoding; the speculative rounds' Verify calls each cross the
    verify link, so 20 ms apart adds a round trip to each; K = 0's Decodes cross it two at a time
    (decode ahead), each round still waiting for part of a round trip that outlasts the tiny
    model's step, and beside the verify service no round trip."""
    import json

    stdout, out = run_specdec_bench(
        tmp_path,
        tiny_models,
        "batch1",
        *("--pipeline", "ngram:2", "--limit", "1", "--hf-k", "2"),
        *("--network-rtt-ms", "0,20", "--network-topology", "apart,beside-verify"),
        categories=("qa",),
    )
    report = json.loads((out / "report.json").read_text())
    settings = ["@rtt0ms", "@rtt20ms-apart", "@rtt20ms-beside-verify"]
    pipelines = [f"{m}{s}" for s in settings for m in ("ngram/K=2", "pipeline/K=0")]
    assert report["methods"] == ["plain", "hf-prompt-lookup/K=2", *pipelines]
    assert report["mismatches"] == []
    rows = {(r["method"], r["rtt_ms"], r["topology"]): r for r in report["network"]["rows"]}
    assert len(rows) == 6 and [s["suffix"] for s in report["network"]["settings"]] == settings
    apart, beside = rows[("pipeline/K=0", 20.0, "apart")], rows[("pipeline/K=0", 20.0, "beside-verify")]
    speculative = rows[("ngram/K=2", 20.0, "apart")]
    assert speculative["coordination_over_rtt0_ms"] >= 0.9 * 20.0, speculative
    assert 0.25 * 20.0 < apart["coordination_over_rtt0_ms"] < speculative["coordination_over_rtt0_ms"], apart
    assert beside["coordination_over_rtt0_ms"] < 20.0 / 2, beside
    for row in rows.values():
        assert row["speedup"] > 0 and row["wire_bytes_per_round"] > 0 and row["k0_ratio"] > 0
    assert "## A network between the services" in (out / "report.md").read_text()
    assert "| pipeline/K=0 | 20 | beside-verify |" in stdout


@pytest.mark.multiprocess
@pytest.mark.long  # a smoke run of the bench: scripts/long_checks.sh
def test_load_cells_through_the_proxies_on_tiny_models(tmp_path, tiny_models):
    """The load mode under RTT 0 and 10 ms: a cell per method and setting, every output identical
    to the reference (K = 0 at RTT 0), a comparison table per setting and the network rows."""
    import json

    stdout, out = run_specdec_bench(
        tmp_path,
        tiny_models,
        "concurrency",
        *("--concurrency", "2", "--arrivals", "closed", "--requests-per-client", "1", "--drafter", "ngram"),
        *("--methods", "pipeline/adaptive,pipeline/K=0,pipeline/K=2", "--network-rtt-ms", "0,10"),
    )
    report = json.loads((out / "report-concurrency.json").read_text())
    assert report["reference"]["method"] == "pipeline/K=0@rtt0ms"
    methods = [f"pipeline/{m}{s}" for m in ("adaptive", "K=0", "K=2") for s in ("@rtt0ms", "@rtt10ms-apart")]
    assert report["methods"] == methods
    assert {(c["method"], c["concurrency"]) for c in report["cells"]} == {(m, 2) for m in methods}
    for cell in report["cells"]:
        assert cell["errors"] == [] and cell["stats"]["identical_rate"] == 1.0
        assert cell["stats"]["coordination_ms_per_round"] > 0 and cell["stats"]["itl_ms_p50"] is not None
    rows = report["network"]["rows"]
    assert len(rows) == 6 and all(r["k0_ratio"] for r in rows)
    k2 = [r for r in rows if r["method"] == "pipeline/K=2" and r["rtt_ms"] == 10.0 and r["concurrency"] == 2]
    assert k2[0]["coordination_over_rtt0_ms"] >= 0.9 * 10.0  # its Verify calls cross the link (K = 0 decodes ahead)
    assert {(b["network"], b["concurrency"]) for b in report["best_fixed_k"]} == {
        (s, 2) for s in ("@rtt0ms", "@rtt10ms-apart")
    }
    markdown = (out / "report-concurrency.md").read_text()
    assert "### RTT 10 ms, apart (on the draft and verify links)" in markdown
    assert "| N | pipeline/adaptive tokens/s | pipeline/K=0 tokens/s | pipeline/K=2 tokens/s |" in markdown
    assert "best fixed K | adaptive / best fixed K |" in markdown and "## A network between the services" in markdown
    assert "arrivals: closed" in stdout and "### RTT 10 ms, apart" in stdout
    assert "| closed | 2 | pipeline/K=2 | 10 | apart |" in stdout

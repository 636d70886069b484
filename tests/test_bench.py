"""`specdec bench`: the report's arithmetic from known inputs, and a whole run on tiny random models
(real services as subprocesses) that writes the JSON, Markdown and PNG reports."""

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from specdec_app.bench.cpu_pinning import cpu_pinning, pinned
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.questions import load_questions
from specdec_app.bench.report import OVERALL, expected_tokens_per_round, machine_line, predicted_speedup, summarize
from specdec_app.bench.run import cpu_isa, machine_info, parse_pipeline
from specdec_app.bench.transformers_methods import ForwardRecord, rounds_from_forwards
from specdec_app.cli import app
from tests.conftest import write_questions

pytestmark = pytest.mark.multiprocess


def measurement(
    method,
    category,
    tokens,
    wall_ms,
    forwards,
    histogram=(),
    drafted=0,
    draft_ms=0.0,
    verify_ms=0.0,
    rounds=None,
    pipeline=False,
    same=True,
) -> Measurement:
    accepted = sum(j * count for j, count in enumerate(histogram))
    m = Measurement(
        method=method,
        question_id=1,
        category=category,
        token_ids=list(range(tokens)),
        wall_ms=wall_ms,
        ttft_ms=wall_ms / 10,
        num_target_forwards=forwards,
        num_spec_steps=sum(histogram),
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        acceptance_histogram=list(histogram),
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        num_verify_rounds=forwards - 1 if rounds is None else rounds,
        coordination_ms=2.0 * (forwards - 1) if pipeline else None,
        wire_bytes=100 * (forwards - 1) if pipeline else None,
    )
    m.compare_to(list(range(tokens)) if same else [0] * tokens)
    return m


def test_expected_tokens_and_predicted_speedup():
    assert expected_tokens_per_round(0.5, 4) == pytest.approx((1 - 0.5**5) / 0.5)
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.0, 4) == 1.0
    # K = 4 drafts at 0.1 plain steps each, verify costs 1.2 plain steps
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx((1 - 0.8**5) / 0.2 / (4 * 0.1 + 1.2))


def test_summary_arithmetic():
    runs = [
        # plain: 100 tokens in 10 s and 50 tokens in 10 s; 10 ms per decode step
        measurement("plain", "qa", 100, 10_000, 100, verify_ms=990.0),
        measurement("plain", "rag", 50, 10_000, 50, verify_ms=490.0),
        # the pipeline, K = 4: qa 100 tokens in 4 s over 20 verify rounds (+ prefill);
        # histogram 20 spec rounds with 80 accepted of 80 drafted... and rag with mixed acceptance
        measurement(
            "ngram/K=4",
            "qa",
            100,
            4_000,
            21,
            histogram=[0, 0, 0, 0, 20],
            drafted=80,
            draft_ms=40.0,
            verify_ms=240.0,
            pipeline=True,
        ),
        measurement(
            "ngram/K=4",
            "rag",
            50,
            12_500,
            31,
            histogram=[10, 5, 0, 5],
            drafted=60,
            draft_ms=30.0,
            verify_ms=360.0,
            pipeline=True,
            same=False,
        ),
    ]
    summary = summarize(runs, {"plain": 0, "ngram/K=4": 4})
    assert list(summary) == ["qa", "rag", OVERALL]
    qa, rag, overall = (summary[g]["ngram/K=4"] for g in ("qa", "rag", OVERALL))
    assert summary["qa"]["plain"]["tokens_per_second"] == pytest.approx(10.0)
    assert qa["tokens_per_second"] == pytest.approx(25.0) and qa["speedup"] == pytest.approx(2.5)
    assert rag["speedup"] == pytest.approx((50 / 12.5) / 5.0)
    assert overall["speedup"] == pytest.approx((150 / 16.5) / (150 / 20.0))  # ratio of sums, not mean of ratios
    assert qa["tokens_per_target_forward"] == pytest.approx(100 / 21)
    assert qa["draft_acceptance_rate"] == 1.0 and qa["mean_acceptance_length"] == 5.0
    assert rag["draft_acceptance_rate"] == pytest.approx(20 / 60)
    assert rag["mean_acceptance_length"] == pytest.approx(1 + 20 / 20)
    assert overall["acceptance_histogram"] == [10, 5, 0, 5, 20]
    assert (qa["identical_rate"], rag["identical_rate"], overall["identical_rate"]) == (1.0, 0.0, 0.5)
    assert summary["qa"]["plain"]["draft_acceptance_rate"] is None
    assert summary["qa"]["plain"]["predicted_speedup"] is None
    assert overall["verify_ms_per_round"] == pytest.approx(600 / 50)
    assert overall["coordination_ms_per_round"] == 2.0 and overall["wire_bytes_per_round"] == 100.0
    assert summary["qa"]["plain"]["coordination_ms_per_round"] is None
    # qa: step 10 ms, a draft token 0.5 ms (c = 0.05), a verify round 12 ms (v = 1.2), a = 1
    assert qa["predicted_speedup"] == pytest.approx(5 / (4 * 0.05 + 1.2))
    # the bound: qa's 99 decode-phase tokens in 20 rounds of 12 ms, against plain's 10 ms step
    assert qa["speedup_bound"] == pytest.approx(99 / 20 * 10 / 12)
    assert qa["share_of_bound"] == pytest.approx(2.5 / (99 / 20 * 10 / 12))
    assert summary["qa"]["plain"]["speedup_bound"] == pytest.approx(1.0)


def test_rounds_from_generate_forwards():
    """Prompt of 10: the prefill verifies 3 candidates and keeps 2 (+1 target token: 13 committed),
    then a plain step (14), then 4 candidates of which all pass (19), then the last round keeps 1 of 2."""
    forwards = [ForwardRecord(0, 13), ForwardRecord(12, 1), ForwardRecord(13, 5), ForwardRecord(18, 3)]
    assert rounds_from_forwards(forwards, prompt_len=10, num_generated=11) == [(3, 2), (0, 0), (4, 4), (2, 1)]


def test_first_mismatch():
    m = measurement("x", "qa", 3, 1.0, 3)
    m.compare_to([0, 1, 5])
    assert m.first_mismatch == 2
    m.compare_to([0, 1, 2, 3])
    assert m.first_mismatch == 3
    m.compare_to([0, 1, 2])
    assert m.first_mismatch is None


def test_questions_grouped_and_limited(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a", "b", "c"], "rag": ["d", "e"]})
    assert [q.prompt for q in load_questions(path, limit=2)] == ["a", "b", "d", "e"]
    assert [q.prompt for q in load_questions(path, ["rag", "qa"], limit=1)] == ["d", "a"]
    with pytest.raises(ValueError, match=r"categories \['code'\] are not in .* it has \['qa', 'rag'\]"):
        load_questions(path, ["code"])
    with pytest.raises(ValueError, match="not found: pass --questions"):
        load_questions(tmp_path / "missing.jsonl")


def test_pipeline_spec():
    assert parse_pipeline("llama-cpp:8") == ("llama-cpp", 8)
    assert parse_pipeline("ngram:auto") == ("ngram", None)


@pytest.mark.parametrize("spec", ["medusa:4", "ngram", "ngram:0", "ngram:17", "ngram:x", "ngram:adaptive"])
def test_bad_pipeline_spec(spec):
    with pytest.raises(ValueError, match="use DRAFTER:K"):
        parse_pipeline(spec)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline", "eagle:4"], "--pipeline 'eagle:4': use DRAFTER:K"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--categories", "code"], "categories ['code'] are not in"),
        (["--placement", "everywhere"], "--placement 'everywhere': use one of shared, split"),
        (["--placement", "split", "--placement", "split"], "--placement: name each placement once"),
    ],
)
def test_bench_bad_option_is_a_clear_error(tmp_path, args, message):
    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a"]})
    result = CliRunner().invoke(app, ["bench", "batch1", "--questions", str(path), *args])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


def test_split_pins_one_cpu_each_and_shared_tells_the_coordinator():
    split = cpu_pinning("split")
    assert split.cpus["draft"].isdisjoint(split.cpus["verify"]) and len(split.cpus["verify"]) == 1
    assert split.service_args["verify"] == ["--num-threads", "1"] and cpu_pinning("shared").cpus == {}
    assert cpu_pinning("shared").service_args == {"coordinator": ["--draft-shares-target-cores"]}
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pinned(split.cpus["verify"]):
        assert os.sched_getaffinity(0) == split.cpus["verify"] and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


@pytest.mark.long  # a smoke run of the bench's processes: scripts/long_checks.sh
def test_bench_tiny_run_writes_all_reports(tmp_path, tiny_models):
    """Both placements in one run: the services of each (split: pinned one CPU each), every
    pipeline on each, plain also pinned to the split verify CPU."""
    questions = write_questions(
        tmp_path / "q.jsonl",
        {
            "qa": ["What is the capital of France?", "unused: --limit 1"],
            "summarization": ["Summarize: the cat sat on the mat. The cat sat on the mat. The cat sat."],
        },
    )
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec",
            "bench",
            "batch1",
            "--questions",
            str(questions),
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--target",
            str(tiny_models.target_dir),
            "--draft-model",
            str(tiny_models.draft_dir),
            "--pipeline",
            "ngram:2",
            "--pipeline",
            "transformers:3",
            "--pipeline",
            "transformers:auto",
            "--hf-k",
            "3",
            "--placement",
            "shared",
            "--placement",
            "split",
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    report = json.loads((out / "report.json").read_text())
    pipelines = ["ngram/K=2", "transformers/K=3", "transformers/adaptive"]
    methods = [
        "plain",
        "plain/verify-cpu",
        "hf-prompt-lookup/K=3",
        "hf-assisted/K=3",
        *(f"{name}@{where}" for where in ("shared", "split") for name in pipelines),
    ]
    assert report["methods"] == methods
    assert report["categories"] == ["qa", "summarization"] and report["num_questions"] == 2
    assert len(report["measurements"]) == 2 * len(methods)
    assert report["mismatches"] == []
    for group in ("qa", "summarization", OVERALL):
        for method in methods:
            stats = report["summary"][group][method]
            assert stats["identical_rate"] == 1.0 and stats["tokens_per_second"] > 0
    overall = report["summary"][OVERALL]
    assert overall["plain"]["speedup"] == 1.0 and overall["plain"]["tokens_per_target_forward"] == 1.0
    assert list(overall["plain"]["verify_costs"]) == ["1"] and overall["plain"]["verify_costs"]["1"]["rounds"] == 14
    assert overall["hf-assisted/K=3"]["num_draft_tokens"] > 0 and overall["plain"]["rounds_per_drafter"] is None
    for where in ("shared", "split"):
        fixed = overall[f"transformers/K=3@{where}"]
        assert fixed["num_draft_tokens"] > 0 and fixed["wire_bytes_per_round"] > 0
        assert fixed["rounds_per_drafter"]["transformers"] > 0 and fixed["draft_ahead_hit_rate"] is not None
        assert overall[f"ngram/K=2@{where}"]["draft_ahead_hit_rate"] is None
        costs = fixed["verify_costs"]  # per tokens per forward, from the verify service's responses
        assert costs["4"]["rounds"] > 0 and 0 < costs["4"]["forward_ms"] <= costs["4"]["call_ms"]
        assert set(overall[f"transformers/adaptive@{where}"]["rounds_per_drafter"]) <= {
            "plain",
            "ngram",
            "suffix",
            "transformers",
        }
        assert {f"coordinator@{where}", f"draft@{where}", f"verify@{where}"} <= set(report["peak_rss_bytes"])
    assert all(value > 0 for value in report["peak_rss_bytes"].values())
    assert {"cpu", "cpu_count", "device", "torch", "transformers"} <= set(report["machine"])
    markdown = (out / "report.md").read_text()
    assert "| method | qa | summarization | overall |" in markdown and "transformers/K=3@split" in markdown
    assert "shared: every process on every core; split: draft service on one CPU, verify service on another" in markdown
    # Its columns are the token counts common in some method's rounds: adaptive K may add 2 or 3.
    cost_header = markdown.split("## Verify cost by tokens per forward", 1)[1].split("| method |", 1)[1].split("\n")[0]
    assert {"1 token", "4 tokens"} <= {cell.strip() for cell in cost_header.split("|")}
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigterm_stops_a_bench_run_through_its_finally_blocks():
    """SIGTERM during any mode's run raises SystemExit where it runs, so the ``finally`` blocks
    that stop its services run (as on Ctrl-C), and the handler before it is put back. A sentinel
    handler stands in for the default one, which would kill the test process."""
    import os
    import signal
    import time

    from specdec_app import bench_cli

    class Sentinel(Exception):
        pass

    def sentinel(signum, frame):
        raise Sentinel

    stopped = []

    def run() -> dict:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            stopped.append(True)
        return {}

    previous = signal.signal(signal.SIGTERM, sentinel)
    try:
        with pytest.raises(SystemExit) as exit_info:
            bench_cli._run_mode(run)
        assert exit_info.value.code == 128 + signal.SIGTERM and stopped == [True]
        assert signal.getsignal(signal.SIGTERM) is sentinel
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_every_report_names_the_instruction_sets_its_kernels_ran_on():
    """The same code reads different ratios on an AVX2-only and an AVX-512 + AMX CPU: the line
    every report starts with names them, and what ATen and oneDNN use here."""
    isa = cpu_isa({"fpu", "avx2", "avx512f", "amx_tile"})
    assert isa["flags"] == ["AVX2", "AVX-512", "AMX"]
    assert isa["aten"] == torch.backends.cpu.get_cpu_capability()
    machine = machine_info() | {"cpu": "Some CPU (family 23 model 49)", "cpu_count": 2, "isa": isa}
    line = machine_line(machine)
    assert line.startswith("Some CPU (family 23 model 49), 2 cores, AVX2 AVX-512 AMX (ATen ")
    assert "oneDNN bfloat16: " in line
    assert "AVX" not in machine_line({key: value for key, value in machine.items() if key != "isa"})  # older reports

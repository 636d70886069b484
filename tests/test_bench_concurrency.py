"""`specdec bench concurrency`: the load report's arithmetic from hand-made records, the prompt
assignment and identity helpers, and one quick closed-loop run on tiny random models (the pipeline
as real subprocess services) that writes the JSON, Markdown and PNG reports."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_app.bench.arrivals import ClosedLoop
from specdec_app.bench.concurrency import (
    RequestRecord,
    first_mismatch,
    interleave_categories,
    parse_concurrency,
    token_at_char,
)
from specdec_app.bench.load_methods import METHODS, best_fixed_k, method_order, parse_methods, requested_k
from specdec_app.bench.questions import Question
from specdec_app.bench.report import (
    Slo,
    concurrency_cell_stats,
    mean_k,
    merge_rounds_per_k,
    percentile,
    weighted_mean,
)
from specdec_app.cli import app
from tests.conftest import write_questions

pytestmark = pytest.mark.multiprocess


def record(
    tokens,
    ttft_ms,
    latency_ms,
    rounds=None,
    batch=None,
    batched=None,
    queue=None,
    drafted=None,
    accepted=None,
    rounds_per_k=None,
    identical=None,
    error=None,
    itl=(),
    coordination=None,
    wire=None,
) -> dict:
    return RequestRecord(
        method="m",
        question_id=1,
        category="qa",
        ttft_ms=ttft_ms,
        latency_ms=latency_ms,
        num_tokens=tokens,
        num_rounds=rounds,
        mean_batch_size=batch,
        mean_batched_tokens=batched,
        queue_time_ms=queue,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        rounds_per_k=rounds_per_k,
        identical=identical,
        error=error,
        itl_ms=list(itl),
        coordination_ms=coordination,
        wire_bytes=wire,
    ).to_json()


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0


def test_weighted_means_and_k():
    assert weighted_mean([(2.0, 10), (4.0, 30)]) == pytest.approx(3.5)
    assert weighted_mean([(None, 10), (4.0, 30)]) == 4.0
    assert weighted_mean([(None, 10)]) is None and weighted_mean([(5.0, 0)]) is None
    assert merge_rounds_per_k([[1, 0, 2], None, [0, 3]]) == [1, 3, 2]
    # 2 plain rounds, 4 rounds of K = 2, 4 rounds of K = 4: (0 + 8 + 16) / 10
    assert mean_k([2, 0, 4, 0, 4]) == pytest.approx(2.4)
    assert mean_k([]) is None and mean_k([0, 0]) is None


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    r = RequestRecord(method="m", question_id=1, category="qa", ttft_ms=100.0, latency_ms=1100.0, num_tokens=11)
    assert r.tpot_ms == pytest.approx(100.0)
    assert (
        RequestRecord(method="m", question_id=1, category="qa", ttft_ms=5.0, latency_ms=5.0, num_tokens=1).tpot_ms
        is None
    )
    assert "token_ids" not in r.to_json() and r.to_json()["tpot_ms"] == pytest.approx(100.0)


def test_cell_stats_from_records():
    records = [
        # 11 tokens: TTFT 100, TPOT (1100 - 100) / 10 = 100; 10 rounds at batch 2, 20 queue ms
        record(
            11,
            100.0,
            1100.0,
            rounds=10,
            batch=2.0,
            batched=10.0,
            queue=20.0,
            drafted=20,
            accepted=10,
            rounds_per_k=[2, 0, 0, 0, 8],
            identical=True,
        ),
        # 21 tokens: TTFT 300, TPOT (2300 - 300) / 20 = 100... 30 rounds at batch 4
        record(
            21,
            300.0,
            2300.0,
            rounds=30,
            batch=4.0,
            batched=30.0,
            queue=60.0,
            drafted=40,
            accepted=30,
            rounds_per_k=[10, 0, 20],
            identical=False,
        ),
        record(0, None, 50.0, error="UNAVAILABLE: gone"),
    ]
    s = concurrency_cell_stats(records, wall_ms=4000.0)
    assert (s["num_requests"], s["num_failed"], s["num_tokens"]) == (3, 1, 32)
    assert s["tokens_per_second"] == pytest.approx(32 / 4.0)  # all tokens / the cell's wall time
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["ttft_ms_p99"] == pytest.approx(298.0)
    assert s["tpot_ms_p50"] == pytest.approx(100.0)
    assert s["mean_batch_size"] == pytest.approx((2.0 * 10 + 4.0 * 30) / 40)  # weighted by rounds
    assert s["mean_batched_tokens"] == pytest.approx((10.0 * 10 + 30.0 * 30) / 40)
    assert s["queue_ms_per_round"] == pytest.approx(80.0 / 40)
    assert s["acceptance_rate"] == pytest.approx(40 / 60)
    assert s["rounds_per_k"] == [12, 0, 20, 0, 8]
    assert s["mean_k"] == pytest.approx((2 * 20 + 4 * 8) / 40)
    assert (s["num_compared"], s["identical_rate"]) == (2, 0.5)


def test_cell_stats_without_pipeline_metrics():
    """transformers serve reports no rounds, drafts or batches: those stay None ("-")."""
    s = concurrency_cell_stats([record(8, 50.0, 750.0), record(4, 70.0, 370.0)], wall_ms=1000.0)
    assert s["tokens_per_second"] == pytest.approx(12.0)
    assert s["mean_batch_size"] is None and s["queue_ms_per_round"] is None
    assert s["acceptance_rate"] is None and s["mean_k"] is None and s["rounds_per_k"] is None
    assert s["identical_rate"] is None and s["tpot_ms_p50"] == pytest.approx(100.0)


def test_itl_is_one_gap_per_message_after_the_first():
    """vLLM's ITL: the first message sets TTFT, each later one adds the gap since the one before,
    once however many tokens it carries."""
    r = RequestRecord(method="m", question_id=1, category="qa")
    for at_ms in (120.0, 150.0, 190.0, 200.0):  # 4 messages, say of 1, 4, 2 and 1 tokens
        r.message_arrived(at_ms)
    assert r.ttft_ms == 120.0 and r.itl_ms == pytest.approx([30.0, 40.0, 10.0])
    assert r.to_json()["itl_ms"] == pytest.approx([30.0, 40.0, 10.0])


def test_itl_goodput_and_round_costs_from_records():
    records = [
        # TTFT 100, TPOT (1100 - 100) / 10 = 100: meets TTFT <= 2000 and TPOT <= 200
        record(11, 100.0, 1100.0, rounds=4, itl=[10.0, 20.0, 30.0], coordination=8.0, wire=400),
        # TTFT 2500: misses the TTFT objective
        record(21, 2500.0, 3500.0, rounds=6, itl=[40.0], coordination=12.0, wire=600),
        # TPOT (1000 - 100) / 3 = 300: misses the TPOT objective
        record(4, 100.0, 1000.0, rounds=2, itl=[50.0, 60.0], coordination=0.0, wire=200),
        # one token: TPOT counts as 0 (vLLM), TTFT 1500: good
        record(1, 1500.0, 1500.0, rounds=0),
        record(0, None, 50.0, error="UNAVAILABLE: gone", itl=[1000.0]),
    ]
    s = concurrency_cell_stats(records, wall_ms=4000.0)
    assert s["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0}
    # the gaps of the completed requests, pooled: 10, 20, 30, 40, 50, 60
    assert s["itl_ms_p50"] == pytest.approx(35.0) and s["itl_ms_p99"] == pytest.approx(59.5)
    assert s["requests_per_second"] == pytest.approx(4 / 4.0)
    assert s["num_good"] == 2
    assert s["goodput_requests_per_second"] == pytest.approx(2 / 4.0)
    assert s["goodput_tokens_per_second"] == pytest.approx((11 + 1) / 4.0)
    assert s["coordination_ms_per_round"] == pytest.approx(20.0 / 12)
    assert s["wire_bytes_per_round"] == pytest.approx(1200 / 12)
    strict = concurrency_cell_stats(records, wall_ms=4000.0, slo=Slo(ttft_ms=3000.0, tpot_ms=50.0))
    # TPOT 100 and 300 miss 50; the second request's (3500 - 2500) / 20 = 50 meets it, its TTFT 2500 too
    assert strict["num_good"] == 2 and strict["goodput_tokens_per_second"] == pytest.approx((21 + 1) / 4.0)
    assert strict["slo"] == {"ttft_ms": 3000.0, "tpot_ms": 50.0}
    assert Slo().met_by(record(5, 2000.0, 2800.0)) and not Slo().met_by(record(5, 2000.1, 2000.1))


def test_prompts_round_robin_over_categories_and_clients():
    questions = [Question(i, c, f"{c}{i}") for i, c in enumerate(["qa", "qa", "qa", "rag", "rag", "math"])]
    sequence = interleave_categories(questions)
    assert [q.prompt for q in sequence] == ["qa0", "rag3", "math5", "qa1", "rag4", "qa2"]
    # 4 closed-loop clients, 2 requests each: the first wave takes prompts 0..3, the second 4..7 (mod 6)
    schedule = ClosedLoop().schedule(4, 2)
    assigned = [sequence[schedule[c][j].index % len(sequence)].question_id for j in range(2) for c in range(4)]
    assert assigned == [0, 3, 5, 1, 4, 2, 0, 3]


def test_first_mismatch_and_text_position(smollm2_tokenizer):
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 5, 3], [1, 2, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    ids = smollm2_tokenizer("The capital of France is Paris.").input_ids
    text = smollm2_tokenizer.decode(ids)
    assert token_at_char(smollm2_tokenizer, ids, 0) == 0
    assert token_at_char(smollm2_tokenizer, ids, text.index("Paris")) == ids.index(
        smollm2_tokenizer(" Paris").input_ids[0]
    )
    assert token_at_char(smollm2_tokenizer, ids, len(text)) == len(ids)


def test_option_parsing():
    assert parse_concurrency("16,1,4,4") == [1, 4, 16]
    assert parse_methods("transformers-serve,pipeline/K=0") == ["pipeline/K=0", "transformers-serve"]
    for bad in ("", "0,4", "a"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_concurrency(bad)
    with pytest.raises(ValueError, match="--methods"):
        parse_methods("vllm")
    assert set(METHODS) == {"pipeline/adaptive", "pipeline/K=0", "transformers-serve"}


def test_fixed_k_methods():
    """Any pipeline/K=<n> with n in 0..16, in the reports' order (adaptive, the Ks by K, serve)."""
    spec = "transformers-serve,pipeline/K=8,pipeline/adaptive,pipeline/K=2,pipeline/K=0,pipeline/K=4,pipeline/K=2"
    assert parse_methods(spec) == [
        "pipeline/adaptive",
        "pipeline/K=0",
        "pipeline/K=2",
        "pipeline/K=4",
        "pipeline/K=8",
        "transformers-serve",
    ]
    assert parse_methods("pipeline/K=16,pipeline/K=4") == ["pipeline/K=4", "pipeline/K=16"]
    for bad in ("pipeline/K=17", "pipeline/K=-1", "pipeline/K=04", "pipeline/K=x", "pipeline/K=2@rtt5ms"):
        with pytest.raises(ValueError, match=r"pipeline/K=<n> \(n in 0\.\.16\)"):
            parse_methods(bad)
    assert requested_k("pipeline/adaptive") is None and requested_k("pipeline/K=12@rtt5ms-apart") == 12
    assert sorted(["transformers-serve", "pipeline/K=10", "pipeline/K=9"], key=method_order)[0] == "pipeline/K=9"
    # the most tokens/s; the smaller K on a tie; methods without a figure left out
    assert best_fixed_k({"pipeline/adaptive": 90.0, "pipeline/K=0": 50.0, "pipeline/K=4": 70.0}) == "pipeline/K=4"
    assert best_fixed_k({"pipeline/K=8": 70.0, "pipeline/K=2": 70.0, "pipeline/K=4": None}) == "pipeline/K=2"
    assert best_fixed_k({"pipeline/adaptive": 9.0, "transformers-serve": 9.0}) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["concurrency", "--concurrency", "0"], "--concurrency '0': use comma-separated client counts"),
        (["concurrency", "--methods", "vllm"], "--methods 'vllm': use a comma-separated subset"),
        (["concurrency", "--requests-per-client", "0"], "--requests-per-client must be at least 1"),
        (["concurrency", "--repeat", "0"], "--repeat 0: the runs of every cell per method must be at least 1"),
        (["concurrency", "--load-generator", "aiperf"], "--load-generator 'aiperf': use guidellm"),
        (["concurrency", "--arrivals", "trickle"], "--arrivals 'trickle': use a comma-separated subset"),
        (["concurrency", "--concurrency", "4", "--arrivals", "poisson"], "--arrivals poisson needs --request-rate"),
        (["concurrency", "--arrivals", "poisson", "--request-rate", "0"], "--request-rate must be above 0"),
        (["concurrency", "--concurrency", "1"], "3 arrival patterns need at least 3 prompts"),  # the default: all 3
        (["concurrency", "--arrivals", "closed", "--slo-tpot-ms", "0"], "--slo-tpot-ms must be above 0"),
        (["concurrency", "--methods", "pipeline/K=17"], "pipeline/adaptive, pipeline/K=<n> (n in 0..16)"),
    ],
)
def test_bad_concurrency_option_is_a_clear_error(tmp_path, args, message):
    """Each a bad value (an option of another mode: tests/test_bench_cli.py)."""
    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a"]})
    result = CliRunner().invoke(app, ["bench", args[0], "--questions", str(path), *args[1:]])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


def run_bench(out, mode, *args):
    """``specdec bench MODE`` (concurrency or ceiling) with ``args``, writing to ``out``; returns the
    finished process and its JSON report."""
    command = [sys.executable, "-m", "specdec", "bench", mode, *args, "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((out / "report-concurrency.json").read_text())


def run_tiny_bench(tiny_models, questions, out, *args, methods="pipeline/adaptive,pipeline/K=0"):
    """``specdec bench concurrency`` with ``args``, ``methods`` (default both pipeline methods; the ngram
    drafter, which needs no model) on the tiny target, 8 new tokens; returns the finished process
    and its JSON report."""
    return run_bench(
        out,
        "concurrency",
        *args,
        *("--methods", methods, "--drafter", "ngram", "--questions", str(questions), "--max-new-tokens", "8"),
        *("--target", str(tiny_models.target_dir), "--draft-model", str(tiny_models.draft_dir), "--dtype", "float32"),
    )


def test_load_generator_section_and_options(tmp_path):
    """The report's guidellm section from hand-made runs (one failed), and the option's checks."""
    from specdec_app.bench.load_generator import LoadTarget, check_installed, markdown, scenario

    figures = {
        "num_completed": 8,
        "num_errored": 0,
        "num_incomplete": 0,
        "requests_per_second": 0.5,
        "output_tokens_per_second": 40.04,
        "ttft_ms_p50": 812.4,
        "ttft_ms_p99": 1500.0,
        "itl_ms_p50": 60.0,
        "itl_ms_p99": 90.25,
        "tpot_ms_p50": 66.0,
        "tpot_ms_p99": None,
        "errors": [],
    }
    section = {
        "version": "0.8.1",
        "folder": "guidellm",
        "runs": [
            {"method": "pipeline/K=0", "concurrency": 4} | figures,
            {"method": "transformers-serve", "concurrency": 4, "error": "guidellm exited with code 1\nlog"},
        ],
    }
    lines = markdown(section)
    assert lines[0] == "## Load generator: guidellm 0.8.1"
    assert "| pipeline/K=0 | 4 | 8 | 0 | 0 | 0.50 | 40.0 | 812 | 1500 | 60.0 | 90.2 | 66.0 | - |" in lines
    assert any(line.startswith("| transformers-serve | 4 | failed: guidellm exited with code 1 |") for line in lines)
    spec = scenario(
        LoadTarget("m", "http://h:1/v1", "smollm2", "/tok", None, {"temperature": 0}),
        ["p"],
        4,
        8,
        16,
        tmp_path / "r.json",
    )["spec"]
    assert spec["profile"] == {"kind": "concurrent", "streams": [4]} and spec["constraints"][0]["count"] == 8
    assert "api_key" not in spec["backend"] and spec["backend"]["extras"] == {"body": {"temperature": 0}}
    with pytest.raises(ValueError, match="--load-generator 'aiperf': use guidellm"):
        check_installed("aiperf")
    check_installed("guidellm")


def test_margin_at_the_first_difference(tiny_models):
    """The margin is the target's top-2 logit gap after the prompt (through the chat template, as
    the coordinator builds it) and the reference's tokens before the first difference."""
    import torch

    from coordinator.api.request import prompt_ids
    from specdec.engine.models import load_causal_lm
    from specdec.v1 import coordinator_pb2
    from specdec_app.bench.concurrency import _margins

    model, tokenizer = load_causal_lm(str(tiny_models.target_dir), "float32")
    question = Question(7, "qa", "What is the capital of France?")
    reference = RequestRecord(method="pipeline/K=0", question_id=7, category="qa", token_ids=[11, 22, 33, 44])
    mismatches = [
        {"method": "pipeline/adaptive", "question_id": 7, "first_mismatch": 2, "token": 99},
        {"method": "transformers-serve", "question_id": 7, "first_mismatch": 2, "token": None},
    ]
    _margins(mismatches, {7: reference}, {7: question}, model, tokenizer)
    ids = [*prompt_ids(coordinator_pb2.GenerateRequest(text=question.prompt), tokenizer), 11, 22]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    for m in mismatches:
        assert m["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
        assert m["reference_token"] == 33
    assert mismatches[0]["logit_gap"] == pytest.approx(float(logits[33] - logits[99]), abs=1e-4)
    assert "logit_gap" not in mismatches[1]


def test_markdown_and_chart_from_a_hand_made_report(tmp_path):
    from specdec_app.bench.chart import write_concurrency_chart
    from specdec_app.bench.report import concurrency_markdown

    cells = [
        {
            "method": method,
            "concurrency": n,
            "errors": [],
            "stats": concurrency_cell_stats([record(10 * n, 100.0, 1000.0, identical=True)], 1000.0),
        }
        for method in ("pipeline/K=0", "transformers-serve")
        for n in (1, 4)
    ]
    report = {
        "config": {
            "command": "specdec bench concurrency --concurrency 1,4",
            "target": "t",
            "draft_model": "d",
            "drafter": "ngram",
            "max_new_tokens": 8,
            "requests_per_client": 1,
        },
        "machine": {"cpu": "cpu", "cpu_count": 2, "device": "cpu", "torch": "x", "transformers": "y"},
        "notes": ["a note"],
        "num_questions": 4,
        "methods": ["pipeline/K=0", "transformers-serve"],
        "ratios": [["pipeline/K=0", "transformers-serve"], ["pipeline/adaptive", "pipeline/K=0"]],
        "reference": {"method": "pipeline/K=0", "num_prompts": 4},
        "cells": cells,
        "identity": {
            "pipeline/K=0": {"num_compared": 5, "identical_rate": 1.0, "prompt_tokens_agree_rate": 1.0},
            "transformers-serve": {"num_compared": 5, "identical_rate": 0.8, "prompt_tokens_agree_rate": 1.0},
        },
        "mismatches": [
            {
                "method": "transformers-serve",
                "concurrency": 4,
                "question_id": 3,
                "first_mismatch": 5,
                "margin": 0.0123,
                "reference_token": 10,
                "token": None,
            }
        ],
        "peak_rss_bytes": {"verify": 2**30},
    }
    markdown = concurrency_markdown(report)
    assert "| transformers-serve | 4 | 1/1 | 40.0 |" in markdown
    assert "| transformers-serve | 5 | 80% | 100% |" in markdown
    assert "| transformers-serve | 4 | 3 | 5 | 0.0123 | 10 | - |" in markdown
    assert "- verify: 1024 MiB" in markdown
    # a report without arrival patterns reads as the closed loop; ratios of methods that ran only
    assert "## Arrivals: closed" in markdown and "## Arrivals: burst" not in markdown
    assert (
        "| N | pipeline/K=0 tokens/s | transformers-serve tokens/s | K=0 TTFT p50 ms | serve TTFT p50 ms "
        "| K=0 / serve |" in markdown
    )
    assert "| 4 | 40.0 | 40.0 | 100 | 100 | 1.00x | 100% | 100% |" in markdown
    write_concurrency_chart(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_best_fixed_k_and_serving_columns_from_hand_made_cells():
    """Per N the fixed K with the most tokens/s and adaptive's ratio to it, beside the existing
    ratios; the per-cell table's ITL and goodput columns."""
    from specdec_app.bench.report import best_fixed_k_cells, comparison_table, concurrency_table

    rates = {  # tokens/s by method at N = 1 and N = 4
        "pipeline/adaptive": (60.0, 90.0),
        "pipeline/K=0": (30.0, 100.0),
        "pipeline/K=2": (50.0, 80.0),
        "pipeline/K=4": (40.0, 60.0),
    }
    cells = [
        {
            "arrivals": "burst",
            "method": method,
            "concurrency": n,
            "stats": {
                "tokens_per_second": rate,
                "ttft_ms_p50": 100.0,
                "identical_rate": 1.0,
                "itl_ms_p50": 12.5,
                "goodput_requests_per_second": 0.5,
            },
        }
        for method, by_n in rates.items()
        for n, rate in zip((1, 4), by_n, strict=True)
    ]
    report = {
        "methods": list(rates),
        "ratios": [["pipeline/adaptive", "pipeline/K=0"]],
        "arrivals": {"patterns": ["burst"]},
        "cells": cells,
    }
    found = best_fixed_k_cells(report, "burst")
    assert [(b["concurrency"], b["method"], b["k"]) for b in found] == [(1, "pipeline/K=2", 2), (4, "pipeline/K=0", 0)]
    assert found[0]["adaptive_ratio"] == pytest.approx(60 / 50) and found[1]["adaptive_ratio"] == pytest.approx(0.9)
    table = comparison_table(report, "burst")
    assert "| adaptive / K=0 | best fixed K | adaptive / best fixed K |" in table[0]
    assert table[2].startswith("| 1 | 60.0 | 30.0 | 50.0 | 40.0 | 100 | 100 | 100 | 100 | 2.00x | 2 | 1.20x |")
    assert table[3].startswith("| 4 | 90.0 | 100.0 | 80.0 | 60.0 |") and "| 0.90x | 0 | 0.90x |" in table[3]
    # one fixed K: its ratio is already a column, so no best-K columns
    del report["cells"][4:]
    assert "best fixed K" not in comparison_table(report, "burst")[0]
    # 11 tokens in 1.1 s, TTFT 100: good; its 4 messages after the first 250 ms apart
    stats = concurrency_cell_stats([record(11, 100.0, 1100.0, itl=[250.0] * 4)], wall_ms=2000.0)
    rows = concurrency_table({"cells": [{"arrivals": "closed", "method": "m", "concurrency": 1, "stats": stats}]})
    assert "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | goodput req/s | goodput tokens/s |" in rows[0]
    assert "| 100 | 100 | 250.0 | 250.0 | 0.50 | 5.5 |" in rows[2]


def test_run_order_interleaves_the_methods_and_rotates_per_n_and_repeat():
    from specdec_app.bench.concurrency import run_order

    # one repeat: the methods once, rotated by the N's index (as before repeats)
    assert run_order(["A", "B", "C"], 0, 1) == [(0, "A"), (0, "B"), (0, "C")]
    assert run_order(["A", "B", "C"], 4, 1) == [(0, "B"), (0, "C"), (0, "A")]
    # three repeats: every method once per repeat (A B C, A B C, ...), each repeat rotated again
    order = run_order(["A", "B", "C"], 0, 3)
    assert ["".join(m for r, m in order if r == repeat) for repeat in range(3)] == ["ABC", "BCA", "CAB"]
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert run_order(["A", "B"], 1, 2) == [(0, "B"), (0, "A"), (1, "A"), (1, "B")]


def test_median_and_spread():
    from specdec_app.bench.report import _spread_text, spread

    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "num_repeats": 3}
    assert spread([1.0, 4.0])["median"] == 2.5  # an even count: the mean of the middle two
    assert spread([None, None]) is None and spread([]) is None
    assert _spread_text(spread([43.0, 45.1, 46.2]), ".1f") == "45.1 (43.0-46.2)"
    assert _spread_text(spread([0.9, 0.95, 1.01]), ".2f", "x") == "0.95x (0.90-1.01x)"
    assert _spread_text(spread([45.1]), ".1f") == "45.1"  # one repeat: no range
    assert _spread_text(None, ".1f") == "-"


def repeat_cell(method, repeat, tokens_per_second, n=4, arrivals="burst", **stats) -> dict:
    """A cell of a hand-made report: ``method`` at N = ``n`` in its ``repeat``."""
    return {
        "arrivals": arrivals,
        "method": method,
        "concurrency": n,
        "repeat": repeat,
        "stats": {"tokens_per_second": tokens_per_second, **stats},
    }


def test_repeats_read_as_medians_with_counts_summed():
    """Every figure the tables show is the median over the repeats, tokens/s with its range; the
    requests, tokens and drafts are summed, and an output that differs in one repeat shows."""
    from specdec_app.bench.report import concurrency_table, cpu_table, summarize_repeats

    def stats(tokens, ttft, identical, cpu):
        # 2 requests of ``tokens`` tokens each in 1 s, the second differing from the reference or not
        records = [
            record(tokens, ttft, ttft + 500.0, rounds=4, drafted=8, accepted=4, rounds_per_k=[0, 0, 4], identical=True),
            record(
                tokens, ttft, ttft + 500.0, rounds=4, drafted=8, accepted=4, rounds_per_k=[0, 0, 4], identical=identical
            ),
        ]
        return concurrency_cell_stats(records, 1000.0, {"verify": cpu})

    cells = [
        {"arrivals": "closed", "method": "m", "concurrency": 2, "repeat": r, "stats": stats(*figures), "errors": []}
        for r, figures in enumerate([(20, 100.0, True, 0.4), (22, 300.0, False, 0.2), (25, 200.0, True, 0.3)])
    ]
    summary = summarize_repeats(list(reversed(cells)))  # (the order given does not matter)
    s = summary["stats"]
    assert summary["num_repeats"] == 3 and summary["spreads"]["tokens_per_second"] == {
        "median": 44.0,
        "min": 40.0,
        "max": 50.0,
        "num_repeats": 3,
    }
    assert s["tokens_per_second"] == 44.0 and s["ttft_ms_p50"] == 200.0 and s["tpot_ms_p50"] == pytest.approx(500 / 21)
    assert (s["num_requests"], s["num_failed"], s["num_tokens"], s["num_draft_tokens"]) == (6, 0, 134, 48)
    assert s["acceptance_rate"] == 0.5 and s["mean_k"] == 2.0 and s["rounds_per_k"] == [0, 0, 24]
    assert s["identical_rate"] == pytest.approx(5 / 6)  # the one differing output of the 6 compared
    # per process, the median of each repeat's CPU ms per token: 10, 4.5 and 6.0
    assert s["cpu_ms_per_token"]["verify"] == pytest.approx(0.3 * 1000 / 50)
    report = {"cells": cells}
    assert concurrency_table(report)[2].startswith("| m | 2 | 6/6 | 44.0 (40.0-50.0) |")
    assert "| 83% |" in concurrency_table(report)[2]
    assert cpu_table(report)[2].startswith("| closed | m | 2 | 44.0 (40.0-50.0) |")


def test_ratios_are_taken_within_each_repeat():
    """adaptive / K=0 is the median of each repeat's ratio (the cells that ran side by side), not
    the ratio of the medians: here 0.83x, where the medians (80 and 80) would read 1.00x."""
    from specdec_app.bench.report import comparison_table, ratio_cells

    per_repeat = {"pipeline/adaptive": (100.0, 50.0, 80.0), "pipeline/K=0": (80.0, 60.0, 100.0)}
    cells = [
        repeat_cell(method, r, rate)
        for method, rates in per_repeat.items()
        for r, rate in reversed(list(enumerate(rates)))  # listed last repeat first: matched by index
    ]
    report = {"methods": list(per_repeat), "ratios": [["pipeline/adaptive", "pipeline/K=0"]], "cells": cells}
    [row] = ratio_cells(report, "burst")
    ratio = row["tokens_per_second_ratio"]
    assert ratio["median"] == pytest.approx(50 / 60) and ratio["num_repeats"] == 3
    assert (ratio["min"], ratio["max"]) == (pytest.approx(0.8), pytest.approx(1.25))
    table = comparison_table(report, "burst")
    assert table[2].startswith("| 4 | 80.0 (50.0-100.0) | 80.0 (60.0-100.0) | - | - | 0.83x (0.80-1.25x) |")
    # a repeat one method lacks has no ratio
    del report["cells"][0]  # adaptive's repeat 2
    assert ratio_cells(report, "burst")[0]["tokens_per_second_ratio"]["num_repeats"] == 2


def test_best_fixed_k_is_chosen_on_the_medians():
    """K=2's one fast repeat does not make it the best: K=4 has the higher median; adaptive's
    ratio to it is taken repeat by repeat."""
    from specdec_app.bench.report import best_fixed_k_cells, comparison_table

    per_repeat = {
        "pipeline/adaptive": (50.0, 55.0, 45.0),
        "pipeline/K=2": (100.0, 40.0, 45.0),  # median 45, mean 61.7
        "pipeline/K=4": (50.0, 50.0, 50.0),
    }
    cells = [repeat_cell(method, r, rate) for method, rates in per_repeat.items() for r, rate in enumerate(rates)]
    report = {"methods": list(per_repeat), "ratios": [], "cells": cells}
    [found] = best_fixed_k_cells(report, "burst")
    assert (found["method"], found["k"], found["tokens_per_second"]) == ("pipeline/K=4", 4, 50.0)
    assert found["adaptive_ratio"] == pytest.approx(1.0)
    spread = found["adaptive_ratio_spread"]
    assert (spread["min"], spread["max"], spread["num_repeats"]) == (pytest.approx(0.9), pytest.approx(1.1), 3)
    assert "| 4 | 1.00x (0.90-1.10x) |" in comparison_table(report, "burst")[2]


def test_one_repeat_and_a_report_from_before_repeats_read_as_before():
    """A committed report (its cells without ``repeat``) renders the tables of its committed
    Markdown line for line; with ``repeat`` 0 in every cell it renders the same."""
    from specdec_app.bench.report import (
        arrival_patterns,
        cell_repeats,
        comparison_table,
        concurrency_markdown,
        concurrency_table,
        cpu_table,
    )

    folder = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu-2core-fixed-k-sweep"
    report = json.loads((folder / "report-concurrency.json").read_text())
    markdown = (folder / "report-concurrency.md").read_text()
    assert all("repeat" not in cell for cell in report["cells"])
    assert all(len(cells) == 1 for cells in cell_repeats(report).values())
    tables = [*cpu_table(report)]
    for arrivals in arrival_patterns(report):
        tables += [*comparison_table(report, arrivals), *concurrency_table(report, arrivals)]
    missing = [line for line in tables if line not in markdown]
    assert len(tables) > 100 and not missing, missing[:3]
    with_repeat = report | {"cells": [cell | {"repeat": 0} for cell in report["cells"]]}
    assert concurrency_markdown(with_repeat) == concurrency_markdown(report)
    assert "the methods interleaved" not in concurrency_markdown(report)
    with_repeat["config"] = report["config"] | {"repeat": 3}
    assert "; every cell 3 times, the methods interleaved" in concurrency_markdown(with_repeat)


def test_poisson_rate_from_the_median_repeat_and_the_reference_from_the_first():
    """The Poisson rate per client is 1 / the median over the reference's closed-loop N = 1
    repeats of their mean latency; its first repeat's outputs are the identity reference, and a
    later repeat that differs from it is a mismatch."""
    from dataclasses import replace

    from specdec_app.bench.concurrency import (
        ConcurrencyConfig,
        _compare,
        poisson_rate_per_client,
        reference_outputs,
    )

    def run(method, repeat, latencies, tokens=(1, 2, 3), n=1):
        records = [
            RequestRecord(method, question_id=q, category="qa", latency_ms=ms, token_ids=list(tokens), repeat=repeat)
            for q, ms in enumerate(latencies)
        ]
        return {"arrivals": "closed", "method": method, "concurrency": n, "repeat": repeat, "records": records}

    cells = [
        run("pipeline/adaptive", 0, [100.0]),
        run("pipeline/K=0", 0, [1000.0, 3000.0]),  # mean 2000 ms
        run("pipeline/K=0", 1, [500.0], tokens=(1, 2, 4)),
        run("pipeline/K=0", 2, [4000.0, 4000.0]),
        run("pipeline/K=0", 0, [1.0], n=2),  # not N = 1
    ]
    config = ConcurrencyConfig(questions=Path("q"), out=Path("o"), command="")
    assert poisson_rate_per_client(config, cells) == pytest.approx(1000 / 2000)
    assert poisson_rate_per_client(replace(config, request_rate=0.25), cells) == 0.25
    # where the reference did not run: the first method's
    assert poisson_rate_per_client(config, cells[:1]) == pytest.approx(1000 / 100)
    references = reference_outputs(cells, "pipeline/K=0")
    assert {q: r.latency_ms for q, r in references.items()} == {0: 1000.0, 1: 3000.0}
    _compare(cells, references, tokenizer=None)
    assert [r.identical for r in cells[2]["records"]] == [False] and cells[2]["records"][0].first_mismatch == 2
    assert all(r.identical for cell in (cells[1], cells[3]) for r in cell["records"])


def captured_config(monkeypatch, tmp_path, mode, *args):
    """The ConcurrencyConfig ``specdec bench MODE`` hands the run for ``args`` (the run itself
    stubbed; the near-free model not written)."""
    from specdec_app.bench import ceiling, concurrency

    seen = []

    def stop(config, console):
        seen.append(config)
        raise RuntimeError("stubbed")

    monkeypatch.setattr(concurrency, "run_concurrency", stop)
    monkeypatch.setattr(ceiling, "near_free_model", lambda console=None: tmp_path / "near-free")
    path = write_questions(tmp_path / "q.jsonl", {"qa": ["a"]})
    result = CliRunner().invoke(app, ["bench", mode, "--questions", str(path), *args])
    assert "stubbed" in result.output
    return seen[0]


def test_cli_defaults_of_the_load_modes(monkeypatch, tmp_path):
    config = captured_config(monkeypatch, tmp_path, "concurrency")
    assert config.concurrency == [1, 4, 16, 32] and config.requests_per_client == 2  # the protocol's N
    assert config.repeat == 1
    config = captured_config(monkeypatch, tmp_path, "concurrency", "--concurrency", "1,4", "--repeat", "3")
    assert config.repeat == 3
    config = captured_config(monkeypatch, tmp_path, "concurrency", "--concurrency", "1,4")
    assert config.concurrency == [1, 4] and config.arrivals == ["closed", "burst", "poisson"]
    assert config.request_rate is None and config.methods == list(METHODS) and config.target == "smollm2"
    poisson = ("--arrivals", "poisson,burst", "--request-rate", "0.5")
    config = captured_config(monkeypatch, tmp_path, "concurrency", "--concurrency", "4", *poisson)
    assert config.arrivals == ["burst", "poisson"] and config.request_rate == 0.5
    config = captured_config(monkeypatch, tmp_path, "ceiling")
    assert config.concurrency == [64] and config.max_new_tokens == 128
    assert config.arrivals == ["closed"] and config.methods == ["pipeline/K=0", "pipeline/K=4", "transformers-serve"]
    assert config.target == config.draft_model == str(tmp_path / "near-free") and config.drafter == "transformers"
    assert config.service_env == {
        "SPECDEC_VERIFY_MAX_NUM_SEQS": "64",
        "SPECDEC_DRAFT_MAX_NUM_SEQS": "64",
        "SPECDEC_DRAFT_NICE": "0",
        "SPECDEC_COORDINATOR_DRAFT_SHARES_TARGET_CORES": "true",
        "SPECDEC_VERIFY_NUM_THREADS": "1",
        "SPECDEC_DRAFT_NUM_THREADS": "1",
    }
    config = captured_config(monkeypatch, tmp_path, "ceiling", "--concurrency", "8", "--arrivals", "burst")
    assert config.concurrency == [8] and config.arrivals == ["burst"] and config.repeat == 1
    assert captured_config(monkeypatch, tmp_path, "ceiling", "--repeat", "5").repeat == 5


def test_every_arrival_pattern_on_tiny_models(tmp_path, tiny_models):
    """Closed, burst and Poisson (its rate from the closed loop at N = 1) at N = 1 and 2, each
    pattern on its own prompt, two pipeline methods on the tiny target (services as subprocesses;
    the ngram drafter, which needs no model), every cell twice (--repeat 2): the same arrival
    times for every method and repeat, every output identical, CPU time per token for every
    process, the medians and ranges over the repeats, and every report written."""
    questions = write_questions(
        tmp_path / "q.jsonl", {"qa": ["What is the capital of France?", "Name two colors.", "Count to three."]}
    )
    out = tmp_path / "out"
    run, report = run_tiny_bench(
        tiny_models,
        questions,
        out,
        "--concurrency",
        "1,2",
        "--requests-per-client",
        "1",
        "--repeat",
        "2",
        methods="pipeline/K=0,pipeline/adaptive",
    )
    assert report["arrivals"]["patterns"] == ["closed", "burst", "poisson"]
    prompts = report["arrivals"]["prompts"]
    assert sorted(q for ids in prompts.values() for q in ids) == sorted({q for ids in prompts.values() for q in ids})
    by_cell = {(c["arrivals"], c["method"], c["concurrency"], c["repeat"]): c for c in report["cells"]}
    assert len(by_cell) == len(report["cells"]) == 3 * 2 * 2 * 2
    closed_k0 = [
        r for r in report["requests"] if (r["arrivals"], r["method"], r["concurrency"]) == ("closed", "pipeline/K=0", 1)
    ]
    assert sorted(r["repeat"] for r in closed_k0) == [0, 1]  # the median of two: their mean
    mean_ms = sum(r["latency_ms"] for r in closed_k0) / 2
    assert report["arrivals"]["poisson_rate_per_client_hz"] == pytest.approx(1000 / mean_ms)
    for n in (1, 2):
        times = [
            by_cell[("poisson", m, n, r)]["arrival_times_s"]
            for m in ("pipeline/K=0", "pipeline/adaptive")
            for r in (0, 1)
        ]
        assert all(t == times[0] for t in times) and len(times[0]) == n and times[0][0] == 0.0
    summaries = report["cell_summaries"]
    assert len(summaries) == 3 * 2 * 2 and {s["num_repeats"] for s in summaries} == {2}
    assert {r["tokens_per_second_ratio"]["num_repeats"] for r in report["ratios_by_cell"]} == {2}
    for (arrivals, _, n, _), cell in by_cell.items():
        s = cell["stats"]
        assert cell["errors"] == [] and s["identical_rate"] == 1.0 and s["rounds_per_second"] > 0
        assert set(s["cpu_ms_per_token"]) == {"coordinator", "draft", "verify", "bench"}
        assert all(v is not None and v >= 0 for v in s["cpu_ms_per_token"].values())
        asked = {r["question_id"] for r in report["requests"] if (r["arrivals"], r["concurrency"]) == (arrivals, n)}
        assert asked <= set(prompts[arrivals])
    burst = [r for r in report["requests"] if r["arrivals"] == "burst" and r["concurrency"] == 2]
    assert len(burst) == 8 and all(r["start_ms"] < 50 for r in burst)  # sent together
    for cell in report["cells"]:
        s = cell["stats"]
        assert s["tokens_per_second"] > 0 and s["ttft_ms_p50"] > 0 and s["tpot_ms_p99"] >= s["tpot_ms_p50"] > 0
        assert s["mean_batch_size"] >= 1 and s["mean_batched_tokens"] >= 1 and s["queue_ms_per_round"] >= 0
        assert s["num_failed"] == 0 and s["num_compared"] == s["num_requests"]
    k0 = by_cell[("closed", "pipeline/K=0", 1, 1)]["stats"]
    assert k0["mean_k"] == 0 and k0["num_draft_tokens"] == 0
    assert {"cpu", "cpu_count", "device", "torch", "transformers"} <= set(report["machine"])
    assert report["config"]["command"].startswith("specdec bench concurrency --concurrency 1,2")
    assert report["identity"]["pipeline/K=0"]["prompt_tokens_agree_rate"] == 1.0
    for m in report["mismatches"]:  # a differing output comes with the target's margin there
        assert m["margin"] >= 0
    assert (out / "concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| pipeline/K=0 | 2 |" in run.stdout
    markdown = (out / "report-concurrency.md").read_text()
    assert "| method | N | requests ok | tokens/s |" in markdown
    for arrivals in ("closed", "burst", "poisson"):
        assert f"## Arrivals: {arrivals}" in markdown and f"arrivals: {arrivals}" in run.stdout
    assert "| N | pipeline/adaptive tokens/s | pipeline/K=0 tokens/s |" in markdown and "adaptive / K=0" in markdown
    assert "; every cell 2 times, the methods interleaved" in markdown
    assert re.search(r"\| pipeline/K=0 \| 2 \| 4/4 \| [\d.]+ \([\d.]+-[\d.]+\) \|", markdown)  # median (range)
    assert re.search(r"\| [\d.]+x \([\d.]+-[\d.]+x\) \|", markdown)  # adaptive / K=0, repeat by repeat
    assert "## CPU time per generated token, per process" in markdown and "coordinator CPU ms/token" in markdown


@pytest.mark.long  # a smoke run of the bench: scripts/long_checks.sh
def test_ceiling_on_tiny_models_through_the_openai_api(tmp_path):
    """--ceiling writes the near-free model (hidden 64, 2 layers, SmolLM2's tokenizer) and runs K = 0
    and the K = 4 self-draft on it; the K = 4 drafts are all accepted and the targets reported.
    With --api openai both pipeline methods go through the coordinator's HTTP API with the openai
    SDK (the transformers serve client path); the reference stays Generate's token ids."""
    questions = write_questions(tmp_path / "q.jsonl", {"qa": ["What is the capital of France?"]})
    _, report = run_bench(
        tmp_path / "out",
        "ceiling",
        *("--concurrency", "2", "--requests-per-client", "1", "--max-new-tokens", "8"),
        *("--methods", "pipeline/K=0,pipeline/K=4", "--questions", str(questions), "--api", "openai"),
    )
    out = tmp_path / "out"
    assert report["config"]["api"] == "openai" and report["reference"]["num_prompts"] == 1
    for cell in report["cells"]:
        s = cell["stats"]
        assert cell["errors"] == [] and s["num_requests"] == 2 and s["num_compared"] == 2
        assert s["mean_batch_size"] >= 1  # the specdec metrics came with the stream
    assert "pipeline API `openai`" in (out / "report-concurrency.md").read_text()
    model = json.loads((Path(report["config"]["target"]) / "config.json").read_text())
    assert (model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]) == (64, 2, 49152)
    assert "ceiling_targets" in report and report["config"]["drafter"] == "transformers"
    stats = {c["method"]: c["stats"] for c in report["cells"]}
    assert stats["pipeline/K=4"]["acceptance_rate"] == pytest.approx(1.0, abs=0.05)
    assert list(stats["pipeline/K=4"]["drafter_usage"]) == ["transformers"]  # nested fields over HTTP too
    assert stats["pipeline/K=0"]["identical_rate"] == stats["pipeline/K=4"]["identical_rate"] == 1.0
    targets = report["ceiling_targets"]
    assert targets["concurrency"] == 2 and targets["k4_vs_k0_tokens_per_second"] > 0
    assert targets["k0_vs_serve_tokens_per_second"] is None  # transformers serve did not run
    assert "## Ceiling targets (closed loop, N=2)" in (out / "report-concurrency.md").read_text()


def test_ceiling_targets_from_hand_made_cells():
    from specdec_app.bench.ceiling import markdown, targets

    def cell(method, n, tokens_per_second, cpu=None, acceptance=None, arrivals="closed"):
        stats = {"tokens_per_second": tokens_per_second, "cpu_ms_per_token": cpu, "acceptance_rate": acceptance}
        return {"arrivals": arrivals, "method": method, "concurrency": n, "stats": stats}

    report = {
        "cells": [
            cell("pipeline/K=0", 64, 600.0, {"coordinator": 1.0, "verify": 3.0}),
            cell("pipeline/K=4", 64, 900.0, {"coordinator": 0.3, "verify": 1.5}, acceptance=1.0),
            cell("pipeline/adaptive", 64, 810.0, {"coordinator": 0.3, "verify": 1.5}, acceptance=1.0),
            cell("transformers-serve", 64, 400.0, {"transformers-serve": 2.0}),
            cell("pipeline/K=0", 8, 100.0, {"coordinator": 9.0, "verify": 9.0}),
            cell("pipeline/K=0", 128, 1.0, {"coordinator": 9.0, "verify": 9.0}, arrivals="burst"),
        ]
    }
    found = targets(report)
    assert found["concurrency"] == 64  # the largest closed-loop N
    assert found["k0_vs_serve_tokens_per_second"] == pytest.approx(1.5)
    assert found["k4_vs_k0_tokens_per_second"] == pytest.approx(1.5)
    assert found["k4_vs_k0_cpu_ms_per_token"] == pytest.approx({"coordinator": 0.3, "verify": 0.5})
    assert found["adaptive_vs_best_fixed_k_tokens_per_second"] == pytest.approx(0.9)  # K=4 the best
    lines = markdown(found)
    assert "| pipeline/K=0 tokens/s / transformers serve's | 1.50x | at least 1.5x |" in lines
    assert "| verify: CPU ms per token at K=4 / at K=0 | 0.50x | at most 0.33x |" in lines
    assert "| pipeline/adaptive tokens/s / the best fixed K's | 0.90x | at least 0.97x |" in lines


def test_ceiling_targets_over_repeats():
    """With repeats each target ratio is the median of the ratios within each repeat (K=4 / K=0
    tokens/s 1.5, 1.5, 0.8: 1.5, where the medians' ratio reads 450 / 500 = 0.9), the acceptance
    the median over the repeats."""
    from specdec_app.bench.ceiling import targets

    def cell(method, repeat, tokens_per_second, verify_cpu):
        stats = {
            "tokens_per_second": tokens_per_second,
            "cpu_ms_per_token": {"coordinator": 1.0, "verify": verify_cpu},
            "acceptance_rate": 1.0 - repeat / 10 if method == "pipeline/K=4" else None,
        }
        return {"arrivals": "closed", "method": method, "concurrency": 64, "repeat": repeat, "stats": stats}

    runs = {
        "pipeline/K=0": [(600.0, 3.0), (300.0, 2.0), (500.0, 1.0)],
        "pipeline/K=4": [(900.0, 1.5), (450.0, 1.2), (400.0, 0.25)],
    }
    found = targets(
        {"cells": [cell(m, r, *figures) for m, by_repeat in runs.items() for r, figures in enumerate(by_repeat)]}
    )
    assert found["k4_vs_k0_tokens_per_second"] == pytest.approx(1.5)
    assert found["k4_vs_k0_cpu_ms_per_token"] == pytest.approx({"coordinator": 1.0, "verify": 0.5})  # 0.5, 0.6, 0.25
    assert found["k4_acceptance_rate"] == pytest.approx(0.9) and found["k0_vs_serve_tokens_per_second"] is None
    assert found["adaptive_vs_best_fixed_k_tokens_per_second"] is None  # adaptive did not run


def test_services_sized_for_the_load(tmp_path):
    """Sessions and streams per client follow the most requests a cell can have in flight (a
    Poisson cell's N x requests per client), the llama-cpp drafter's sequences the largest N with
    a quarter to spare; the ceiling's settings come last."""
    from dataclasses import replace

    from specdec_app.bench.concurrency import ConcurrencyConfig, max_in_flight, service_settings

    base = ConcurrencyConfig(questions=tmp_path, out=tmp_path, command="", concurrency=[1, 32])
    closed = replace(base, arrivals=["closed", "burst"])
    assert max_in_flight(closed) == 32
    assert service_settings(closed) == {  # within the defaults; the draft behind the target on their shared cores
        "SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS": "40",  # a quarter more: openings overlap the releases before them
        "SPECDEC_DRAFT_NICE": "19",
        "SPECDEC_COORDINATOR_DRAFT_SHARES_TARGET_CORES": "true",
    }
    one = replace(base, concurrency=[1])
    assert service_settings(one)["SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS"] == "2"  # at least one to spare
    poisson = replace(base, concurrency=[64], requests_per_client=2)
    assert max_in_flight(poisson) == 128
    assert service_settings(poisson) == {
        "SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS": "80",
        "SPECDEC_DRAFT_NICE": "19",
        "SPECDEC_COORDINATOR_DRAFT_SHARES_TARGET_CORES": "true",
        "SPECDEC_COORDINATOR_MAX_STREAMS_PER_CLIENT": "128",
        "SPECDEC_VERIFY_MAX_SESSIONS": "264",
        "SPECDEC_DRAFT_MAX_SESSIONS": "264",
    }
    ceiling = replace(poisson, service_env={"SPECDEC_VERIFY_MAX_NUM_SEQS": "64", "SPECDEC_VERIFY_MAX_SESSIONS": "300"})
    assert service_settings(ceiling)["SPECDEC_VERIFY_MAX_SESSIONS"] == "300"
    assert service_settings(ceiling)["SPECDEC_VERIFY_MAX_NUM_SEQS"] == "64"

"""`specdec bench replicas` (specdec_app/bench/replicas.py) without its fleets: the share,
deviation and target arithmetic, each scenario's figures and targets from synthetic request
records, the reports, the prompts each scenario gets, and a missing question file (the options
it refuses: tests/test_bench_cli.py). The
scenarios themselves start a dozen service processes and take minutes: `specdec bench replicas`
runs them (docs/benchmark.md#replicas-specdec-bench-replicas)."""

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from specdec_app.bench import replicas
from specdec_app.bench.replicas import (
    AFFINITY,
    DRAFT_HOSTS,
    LOAD,
    POOL,
    PREFIX_LOAD,
    REPORT_FILES,
    ROUND_ROBIN,
    SINGLE,
    SPREAD,
    VERIFY_HOSTS,
    Kill,
    ReplicasConfig,
    Sent,
    affinity_section,
    check,
    cpu_shares,
    load_section,
    pool_section,
    run_replicas,
    scenario_questions,
    share_deviation,
    shares,
    short_hits,
    speculating_again_ms,
    spread_markdown,
    spread_section,
    system_prompts,
    to_markdown,
    validate,
)
from specdec_app.cli import app
from tests.conftest import write_questions

V1, V2, V3 = (f"{h}:5000" for h in VERIFY_HOSTS)
D1, D2 = (f"{h}:6000" for h in DRAFT_HOSTS)
C1, C2 = "127.0.0.7:7000", "127.0.0.8:7000"


def config(tmp_path: Path, **sizes) -> ReplicasConfig:
    return ReplicasConfig(tmp_path / "questions.jsonl", tmp_path / "out", "specdec bench replicas", **sizes)


def sent(verify: str = V1, draft: str | None = None, **fields) -> Sent:
    return Sent(
        fields.pop("run", "r"),
        fields.pop("client", 0),
        fields.pop("question_id", 1),
        fields.pop("coordinator", C1),
        verify_replicas=[verify],
        draft_replicas=[draft] if draft else [],
        **fields,
    )


def test_shares_count_every_replica_and_the_deviation_is_from_an_even_share():
    counts = shares(["127.0.0.2", "127.0.0.2", "127.0.0.3", "none"], ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    assert counts == {"127.0.0.2": 2, "127.0.0.3": 1, "127.0.0.4": 0, "none": 1}
    cpu = cpu_shares({"verify-a": 4.0, "verify-b": 5.0, "verify-c": 3.0, "draft-a": 9.0}, "verify", ["a", "b", "c"])
    assert cpu == pytest.approx({"a": 1 / 3, "b": 5 / 12, "c": 1 / 4})
    assert share_deviation(cpu) == pytest.approx(0.25)  # 5/12 and 3/12 of an even 4/12
    assert share_deviation(cpu_shares({"verify-a": 1.0, "verify-b": None}, "verify", ["a", "b"])) is None


@pytest.mark.parametrize(
    ("value", "op", "bound", "met"),
    [(0.25, "<=", 0.25, True), (0.26, "<=", 0.25, False), (0.95, ">=", 0.95, True), (1.0, "<", 1.0, False)],
)
def test_a_target_is_met_on_its_bound_as_its_operator_says(value, op, bound, met):
    assert check("t", value, op, bound)["met"] is met


def test_a_target_not_measured_is_missed():
    assert not check("t", None, "<=", 1.0)["met"]
    assert not check("t", 1.0, "<", None)["met"]


def test_spread_figures_and_targets():
    """Per burst, sessions and CPU shares per replica; the targets on the worst burst's CPU."""
    verify = [V1] * 20 + [V2] * 16 + [V3] * 12
    draft = [D1] * 30 + [D2] * 18
    records = [
        sent(v, d, coordinator=(C1, C2)[i % 2], num_prompt_tokens=100)
        for i, (v, d) in enumerate(zip(verify, draft, strict=True))
    ]
    even = {"verify-127.0.0.2": 1.0, "verify-127.0.0.3": 1.0, "verify-127.0.0.4": 1.0, "draft-127.0.0.5": 1.0}
    even["draft-127.0.0.6"] = 1.0
    skewed = {**even, "verify-127.0.0.2": 1.5}  # 1.5 of 3.5: 0.43 of the verify CPU, 29% above even
    section = spread_section([records, records], [even, skewed], config(Path("/x")))
    figures = section["figures"]
    first = figures["bursts"][0]
    assert first["verify_sessions"] == dict(zip(VERIFY_HOSTS, (20, 16, 12), strict=True))
    assert first["draft_sessions"] == dict(zip(DRAFT_HOSTS, (30, 18), strict=True))
    assert first["verify_prompt_tokens"] == dict(zip(VERIFY_HOSTS, (2000, 1600, 1200), strict=True))
    assert first["verify_cpu_deviation"] == pytest.approx(0.0)
    assert figures["verify_cpu_worst_deviation"] == pytest.approx(1.5 / 3.5 * 3 - 1)
    assert figures["num_requests"] == 96
    assert [t["met"] for t in section["targets"]] == [False, True, True]
    failed = [sent(V1, D1, error="UNAVAILABLE: gone"), *records[1:]]
    section = spread_section([failed], [even], config(Path("/x")))
    assert [t["met"] for t in section["targets"]] == [True, True, False]
    assert "verify CPU share" in "\n".join(spread_markdown(section))


def affinity_run(run: str, cached: list[list[int]], ttft_ms: float, homes: list[str]) -> list[Sent]:
    """Client c's requests, their cached prompt tokens ``cached[c]``, all on ``homes[c]``."""
    return [
        sent(homes[c], run=run, client=c, num_cached_prompt_tokens=n, num_prompt_tokens=640, ttft_ms=ttft_ms)
        for c, tokens in enumerate(cached)
        for n in tokens
    ]


def test_affinity_hits_against_the_single_replica_and_ttft_against_round_robin():
    runs = {
        PREFIX_LOAD: affinity_run(PREFIX_LOAD, [[0, 608, 608], [0, 608, 384]], 300.0, [V1, V2]),
        ROUND_ROBIN: affinity_run(ROUND_ROBIN, [[0, 0, 608], [0, 608, 0]], 900.0, [V3, V3]),
        SINGLE: affinity_run(SINGLE, [[0, 608, 608], [0, 608, 608]], 400.0, [V1, V1]),
    }
    section = affinity_section(runs, config(Path("/x"), affinity_clients=2, affinity_questions=3), "rules")
    figures = section["figures"]
    assert figures[PREFIX_LOAD]["cached_prompt_tokens"] == 2208
    assert figures[PREFIX_LOAD]["cached_vs_single"] == pytest.approx(2208 / 2432)
    assert figures[PREFIX_LOAD]["num_short_hits"] == 1
    assert figures[ROUND_ROBIN]["num_short_hits"] == 2
    assert figures[PREFIX_LOAD]["replicas_per_system_prompt"] == {"0": {"127.0.0.2": 3}, "1": {"127.0.0.3": 3}}
    hits, ttft = section["targets"]
    assert not hits["met"] and hits["value"] == pytest.approx(0.908, abs=1e-3)  # below 0.95
    assert ttft["met"] and ttft["bound"] == 900.0


def test_short_hits_count_requests_that_found_less_than_their_system_prompt():
    records = [sent(client=0, num_cached_prompt_tokens=n) for n in (0, 608, 384, 608)]
    records += [sent(client=1, num_cached_prompt_tokens=n) for n in (0, 0, 608)]
    assert short_hits(records) == 2  # client 0's 384, client 1's second request (its first: nothing to find)


def load_run(run: str, on_slowed: int, latencies: list[float]) -> list[Sent]:
    hosts = [V3] * on_slowed + [V1, V2] * len(latencies)
    return [sent(hosts[i], run=run, latency_ms=ms, num_tokens=64) for i, ms in enumerate(latencies)]


def test_load_the_slowed_replicas_share_and_the_p90_ratio():
    runs = {
        PREFIX_LOAD: load_run(PREFIX_LOAD, 1, [5000.0] + [1000.0] * 19),  # 1 of 20 on the slowed replica
        ROUND_ROBIN: load_run(ROUND_ROBIN, 7, [5000.0] * 7 + [1000.0] * 13),
    }
    section = load_section(runs, config(Path("/x")))
    figures = section["figures"]
    assert figures[PREFIX_LOAD]["slowed_share"] == pytest.approx(0.05)
    assert figures[ROUND_ROBIN]["verify_sessions"]["127.0.0.4"] == 7
    assert figures[PREFIX_LOAD]["ms_per_token_slowed"] == pytest.approx(5000 / 64)
    assert section["p90_ratio"] == pytest.approx(1000.0 / 5000.0)
    assert [t["met"] for t in section["targets"]] == [True, True]
    runs[PREFIX_LOAD] = load_run(PREFIX_LOAD, 4, [5000.0] * 4 + [1000.0] * 16)  # 20%: above half of 33%
    assert [t["met"] for t in load_section(runs, config(Path("/x")))["targets"]] == [False, False]


def test_speculating_again_is_the_first_message_of_several_tokens_after_the_kill():
    record = sent(arrivals=[(9.0, 5), (10.1, 1), (10.3, 1), (10.45, 5), (10.6, 5)])
    assert speculating_again_ms(record, 10.0) == pytest.approx(450.0)
    assert speculating_again_ms(sent(arrivals=[(10.1, 1), (10.2, 1)]), 10.0) is None


def test_draft_pool_identity_and_the_moved_requests():
    kill = Kill(replica=DRAFT_HOSTS[0], at=100.0, sessions={DRAFT_HOSTS[0]: 2, DRAFT_HOSTS[1]: 1})
    reference = [sent(question_id=q, token_ids=[q, 1, 2]) for q in (1, 2, 3)]
    moved = Sent("K=4", 0, 1, C1, verify_replicas=[V1], draft_replicas=[D1, D2], token_ids=[1, 1, 2])
    moved.arrivals = [(99.0, 5), (100.2, 1), (100.7, 4)]
    finished = Sent("K=4", 1, 2, C1, verify_replicas=[V1], draft_replicas=[D1], token_ids=[2, 1, 9])
    finished.arrivals = [(99.5, 5)]  # done before the kill: not counted as running
    other = Sent("K=4", 2, 3, C1, verify_replicas=[V1], draft_replicas=[D2], token_ids=[3, 1, 2], arrivals=[(101.0, 3)])
    section = pool_section(reference, [moved, finished, other], kill, config(Path("/x")))
    figures = section["figures"]
    assert figures["num_identical"] == 2  # question 2's output differs
    assert (figures["num_on_killed"], figures["num_running_at_kill"], figures["num_moved"]) == (2, 1, 1)
    assert figures["speculating_again_ms"]["max"] == pytest.approx(700.0)
    assert [t["met"] for t in section["targets"]] == [True, False, True]
    moved.arrivals = [(99.0, 5), (100.2, 1)]  # never speculated again: the target is missed
    section = pool_section(reference, [moved, finished, other], kill, config(Path("/x")))
    assert section["figures"]["speculating_again_ms"]["max"] is None and not section["targets"][2]["met"]


def test_system_prompts_differ_from_their_first_words_and_keep_the_length():
    prompts = system_prompts("Be brief.", 5, 4)
    assert len(set(prompts)) == 4 and all(p.endswith("Be brief.") for p in prompts)
    assert prompts[0].startswith("This is assistant profile 5.") and prompts[3].startswith(
        "This is assistant profile 8."
    )


def test_each_scenario_gets_prompts_of_its_own(tmp_path):
    write_questions(
        tmp_path / "questions.jsonl",
        {c: [f"{c} {i}?" for i in range(20)] for c in ("qa", "translation", "math_reasoning", "rag")},
    )
    chosen = scenario_questions(
        config(
            tmp_path,
            spread_requests=3,
            spread_bursts=2,
            load_clients=2,
            load_requests_per_client=3,
            pool_requests=4,
            affinity_questions=5,
        )
    )
    assert [len(chosen[s]) for s in (SPREAD, LOAD, POOL, AFFINITY)] == [6, 6, 4, 5]
    ids = [q.question_id for s in (SPREAD, LOAD, POOL) for q in chosen[s]]
    assert len(set(ids)) == len(ids)
    assert {q.category for q in chosen[AFFINITY]} == {"qa", "translation", "math_reasoning"}
    with pytest.raises(ValueError, match="has 80 questions; --replicas needs 320"):
        scenario_questions(config(tmp_path))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"scenarios": ("spread", "soak")}, "scenarios \\['soak'\\]"),
        ({"pool_requests": 0}, "pool_requests"),
        ({"kill_after_s": -1.0}, "kill_after_s"),
    ],
)
def test_bad_sizes_are_refused(tmp_path, sizes, message):
    with pytest.raises(ValueError, match=message):
        validate(config(tmp_path, **sizes))


def test_the_reports_are_written_after_each_scenario(tmp_path, monkeypatch):
    write_questions(
        tmp_path / "questions.jsonl",
        {c: [f"{c} {i}?" for i in range(50)] for c in ("qa", "translation", "math_reasoning")},
    )
    records = [sent(v, d) for v, d in zip([V1, V2, V3] * 4, [D1, D2] * 6, strict=True)]
    fleet = [("verify", h) for h in VERIFY_HOSTS] + [("draft", h) for h in DRAFT_HOSTS]
    cpu = {f"{service}-{h}": 1.0 for service, h in fleet}
    monkeypatch.setitem(replicas.RUNNERS, SPREAD, lambda cfg, questions, console: spread_section([records], [cpu], cfg))

    def failing(cfg, questions, console):
        assert (
            json.loads((cfg.out / REPORT_FILES[0]).read_text())["scenarios"][SPREAD]["figures"]["num_completed"] == 12
        )
        raise RuntimeError("the load scenario's coordinator did not start")

    monkeypatch.setitem(replicas.RUNNERS, LOAD, failing)
    with pytest.raises(RuntimeError, match="did not start"):
        run_replicas(config(tmp_path, scenarios=(SPREAD, LOAD), spread_bursts=1), Console(quiet=True))
    markdown = (tmp_path / "out" / REPORT_FILES[1]).read_text()
    assert "## 1. Spread" in markdown and "127.0.0.2: 4, 127.0.0.3: 4, 127.0.0.4: 4" in markdown
    assert markdown == to_markdown(json.loads((tmp_path / "out" / REPORT_FILES[0]).read_text()))


def test_a_missing_question_file_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(
        app, ["bench", "replicas", "--questions", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert "missing.jsonl not found" in " ".join(result.output.split())

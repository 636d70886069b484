"""`specdec bench conversation` (specdec_app/bench/conversation.py) on the tiny models: both modes'
requests reach the services as chat conversations, the pipeline with prefix caching finds the
earlier turn or the system prompt cached on the verify and the draft service and the one without
finds nothing, every output equals plain decoding's on the same conversation, and the reports carry
every figure. The cached pipeline is a coordinator on the tiny pipeline's verify and draft
services; the uncached one a coordinator with a verify and a draft service of their own whose KV
stores keep no prefix cache. Both coordinators run with adaptive K off (K = 4 every round): the
tiny draft costs what the target costs, so adaptive K would decode plainly and never open the
draft's session."""

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coordinator.api.request import prompt_ids
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.transformers_lm import TransformersDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.model_files import load_tokenizer
from specdec_app.bench.conversation import (
    FOLLOW_UPS,
    MULTI_TURN,
    NO_PREFIX_CACHE,
    PREFIX_CACHE,
    SHARED_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    ConversationConfig,
    load_follow_ups,
    method_suffixes,
    report_files,
    run_conversation,
    second_turn,
    targets,
)
from specdec_app.bench.cpu_pinning import SHARED, CpuPinning
from specdec_app.bench.questions import Question, generate_request
from specdec_app.bench.report import OVERALL
from specdec_app.bench.transformers_methods import TransformersMethod
from specdec_app.cli import app
from tests.conftest import CoordinatorThread, plain_greedy, write_questions
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings
from verify_service.target import Target

ROOT = Path(__file__).parents[1]
MAX_NEW = 16
# shorter than benchmarks/conversation/system_prompt.txt, which would not fit the tiny models' 512 positions
SYSTEM = (
    "You are Quill, the help-desk assistant of a public library. Answer in two sentences at most, in the "
    "user's language. Say so when you do not know, and never invent a book, an author or an opening hour. "
    "Do not ask for or repeat a reader's card number, address or phone number. Be polite and plain, and "
    "point the user to the front desk for anything about fines or lost books."
)
METHODS = ["plain", "close/adaptive", "close/adaptive@no-prefix-cache"]


def fixed_k_coordinator(tiny_models, verify_address: str, draft_address: str) -> CoordinatorThread:
    return CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=draft_address,
            verify_addresses=[verify_address],
            tokenizer=str(tiny_models.target_dir),
            max_new_tokens_limit=256,
            adaptive=False,
        )
    )


@pytest.fixture(scope="module")
def addresses(tiny_models, tiny_target, tiny_drafters, tiny_pipeline):
    """The coordinators by method suffix: with prefix caching (the tiny pipeline's services), and
    without (a verify and a draft service serving the tiny target and the tiny pipeline's
    ``close`` draft model, their KV stores without a prefix cache)."""
    tokenizer = load_tokenizer(str(tiny_models.target_dir))
    target = Target(tiny_target.lm.model, tokenizer, str(tiny_models.target_dir), 16, prefix_cache_max_tokens=None)
    target.measure_costs()
    close = TransformersDrafter(tiny_drafters["close"].lm.model, tokenizer, "close", prefix_cache_max_tokens=None)
    close.measure_step_ms()
    verify = build_verify(VerifySettings(port=0, max_sessions=8, enable_prefix_caching=False), target=target)
    draft = build_draft(
        DraftSettings(port=0, drafters=["close"], default_drafter="close", max_sessions=8, enable_prefix_caching=False),
        drafters={"close": close},
    )
    coordinators = {
        PREFIX_CACHE: fixed_k_coordinator(tiny_models, tiny_pipeline.verify_address, tiny_pipeline.draft_address),
        NO_PREFIX_CACHE: fixed_k_coordinator(tiny_models, f"127.0.0.1:{verify.port}", f"127.0.0.1:{draft.port}"),
    }
    yield {suffix: f"127.0.0.1:{coordinator.port}" for suffix, coordinator in coordinators.items()}
    for coordinator in coordinators.values():
        coordinator.stop()
    draft.stop(0)
    verify.stop(0)


def run_mode(conversation, folder, tiny_models, addresses) -> dict:
    system_prompt = folder / "system_prompt.txt"
    system_prompt.write_text(SYSTEM)
    questions = write_questions(
        folder / "questions.jsonl",
        {"qa": ["Who wrote the novel Middlemarch?"], "math_reasoning": ["Tom has 3 apples and buys 5 more. How many?"]},
    )
    config = ConversationConfig(
        questions=questions,
        out=folder / "out",
        command=f"specdec bench conversation --conversation {conversation}",
        limit=None,
        max_new_tokens=MAX_NEW,
        target=str(tiny_models.target_dir),
        draft_model=str(tiny_models.target_dir),
        dtype="float32",
        conversation=conversation,
        drafter="close",
        follow_ups=ROOT / FOLLOW_UPS,
        system_prompt=system_prompt,
    )
    return run_conversation(config, Console(quiet=True), addresses)


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory, tiny_models, addresses):
    return run_mode(MULTI_TURN, tmp_path_factory.mktemp("multi-turn"), tiny_models, addresses)


@pytest.fixture(scope="module")
def shared_system_prompt(tmp_path_factory, tiny_models, addresses):
    return run_mode(SHARED_SYSTEM_PROMPT, tmp_path_factory.mktemp("shared-system-prompt"), tiny_models, addresses)


def records(report: dict, phase: str, method: str) -> list[dict]:
    return [r for r in report["measurements"] if r["phase"] == phase and r["method"] == method]


@pytest.mark.parametrize("mode", ["multi_turn", "shared_system_prompt"])
def test_the_cached_pipeline_finds_the_shared_prefix_and_every_output_equals_plain(mode, request):
    report = request.getfixturevalue(mode)
    assert report["methods"] == METHODS
    assert report["mismatches"] == [] and all(r["identical"] for r in report["measurements"])
    cached, uncached = records(report, "measured", METHODS[1]), records(report, "measured", METHODS[2])
    assert cached and all(r["num_cached_prompt_tokens"] > 0 for r in cached)
    assert all(r["num_draft_cached_prompt_tokens"] > 0 for r in cached)
    assert all(r["num_cached_prompt_tokens"] == 0 == r["num_draft_cached_prompt_tokens"] for r in uncached)
    assert all(r["num_cached_prompt_tokens"] is None for r in records(report, "measured", "plain"))
    # every method sent the same prompt: the verify service counted as many tokens as plain's chat template
    for phase in ("first", "measured"):
        lengths = {m: [r["num_prompt_tokens"] for r in records(report, phase, m)] for m in METHODS}
        assert lengths[METHODS[1]] == lengths["plain"] == lengths[METHODS[2]], phase


def test_a_second_turn_holds_the_first_answer_and_a_follow_up(multi_turn):
    first = {r["question_id"]: r for r in records(multi_turn, "first", "plain")}
    second = {r["question_id"]: r for r in records(multi_turn, "measured", "plain")}
    assert first.keys() == second.keys() == {1, 2}
    for qid in first:  # the first turn, the answer, the follow-up and the template's tokens around them
        assert second[qid]["num_prompt_tokens"] > first[qid]["num_prompt_tokens"] + first[qid]["num_generated"]
    stats = multi_turn["summary"][OVERALL]
    assert stats[METHODS[1]]["mean_cached_prompt_tokens"] > 0 and stats[METHODS[2]]["mean_cached_prompt_tokens"] == 0
    assert multi_turn["phases"] == {"first_summary": "first turn", "summary": "second turn"}


def test_the_shared_system_prompt_is_cached_after_the_first_request(shared_system_prompt, smollm2_tokenizer):
    system_tokens = len(smollm2_tokenizer(SYSTEM).input_ids)
    measured = records(shared_system_prompt, "measured", METHODS[1])
    assert [r["question_id"] for r in measured] == [2]  # the first question warmed the caches
    # whole blocks of 16 tokens: the system prompt less the last, partial one
    assert measured[0]["num_cached_prompt_tokens"] >= system_tokens // 16 * 16 - 16
    assert shared_system_prompt["phases"] == {
        "first_summary": "first request (cold cache)",
        "summary": "later requests",
    }


def test_the_committed_system_prompt_is_400_to_600_tokens(smollm2_tokenizer):
    assert 400 <= len(smollm2_tokenizer((ROOT / SYSTEM_PROMPT).read_text().strip()).input_ids) <= 600


def test_second_turns_go_through_the_chat_template_as_plain_decodes_them(tiny_pipeline, smollm2_tokenizer):
    question = Question(7, "qa", "Who wrote the novel Middlemarch?")
    follow_ups = load_follow_ups(ROOT / FOLLOW_UPS)
    turn = second_turn(question, "George Eliot.", follow_ups)
    messages = [
        {"role": "user", "content": question.prompt},
        {"role": "assistant", "content": "George Eliot."},
        {"role": "user", "content": follow_ups["qa"][7 % len(follow_ups["qa"])]},
    ]
    ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt_ids(generate_request(turn), smollm2_tokenizer) == list(ids["input_ids"])
    plain = TransformersMethod(tiny_pipeline.plain_model, smollm2_tokenizer)
    assert plain.run(turn, 8, 0).token_ids == plain_greedy(tiny_pipeline.plain_model, list(ids["input_ids"]), 8)


def test_the_report_gives_every_figure_and_target(multi_turn):
    overall = multi_turn["summary"][OVERALL]
    for method in METHODS:
        for phase in ("summary", "first_summary"):
            s = multi_turn[phase][OVERALL][method]
            assert s["tokens_per_second"] > 0 and s["time_to_first_token_ms"] > 0 and s["ttft_ms_p50"] > 0
    assert overall["plain"]["speedup"] == 1.0 and overall["plain"]["mean_draft_cached_prompt_tokens"] is None
    assert [t["name"] for t in multi_turn["targets"]] == [
        "close/adaptive TTFT / close/adaptive@no-prefix-cache's, second turn",
        "close/adaptive TTFT / plain's, second turn",
        "close/adaptive TTFT / plain's, first turn",
    ]
    assert [t["goal"] for t in multi_turn["targets"]] == [pytest.approx(1 / 3), 1.0, 1.0]
    assert all(t["ratio"] > 0 and t["met"] == (t["ratio"] <= t["goal"]) for t in multi_turn["targets"])
    out = Path(multi_turn["config"]["out"])
    json_file, markdown_file, chart_file = report_files(MULTI_TURN)
    markdown = (out / markdown_file).read_text()
    assert (
        "| method | TTFT mean ms | TTFT p50 ms | tokens/s | speedup | identical to plain | prompt tokens |" in markdown
    )
    assert "## Measured: second turn (overall)" in markdown and "## Apart: first turn (overall)" in markdown
    assert json.loads((out / json_file).read_text())["methods"] == METHODS
    assert (out / chart_file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--conversation", "three-turns"], "--conversation 'three-turns': use multi-turn or shared-system-prompt"),
        (["--conversation", "multi-turn", "--placement", "both"], "--placement 'both': use one of shared, split"),
        (["--conversation", "multi-turn", "--drafter", "eagle"], "--drafter 'eagle': use one of llama-cpp,"),
        (
            ["--conversation", "shared-system-prompt", "--categories", "qa", "--limit", "1"],
            "needs 2 questions at least (the first warms the caches)",
        ),
    ],
)
def test_bad_options_are_a_clear_error(tmp_path, args, message):
    questions = write_questions(tmp_path / "questions.jsonl", {"qa": ["Who wrote Middlemarch?"]})
    result = CliRunner().invoke(app, ["bench", "conversation", *args, "--questions", str(questions)])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


def test_both_placements_pair_each_pipeline_with_its_uncached_twin_and_its_plain():
    split = CpuPinning("split", {"draft": frozenset({0}), "verify": frozenset({1})})
    suffixes = method_suffixes([SHARED, split])
    assert suffixes == {
        "@shared": (SHARED, True),
        "@no-prefix-cache@shared": (SHARED, False),
        "@split": (split, True),
        "@no-prefix-cache@split": (split, False),
    }
    ttft = {  # method -> mean TTFT ms of the measured requests, the first ones 10x
        "plain": 400.0,
        "plain/verify-cpu": 500.0,
        "d/adaptive@shared": 100.0,
        "d/adaptive@no-prefix-cache@shared": 400.0,
        "d/adaptive@split": 200.0,
        "d/adaptive@no-prefix-cache@split": 500.0,
    }
    report = {
        "config": {"placements": ["shared", "split"], "drafter": "d"},
        "phases": {"first_summary": "first turn", "summary": "second turn"},
        "summary": {OVERALL: {m: {"time_to_first_token_ms": t, "ttft_ms_p50": t} for m, t in ttft.items()}},
        "first_summary": {OVERALL: {m: {"time_to_first_token_ms": 10 * t, "ttft_ms_p50": t} for m, t in ttft.items()}},
    }
    assert [(t["name"], t["ratio"], t["met"]) for t in targets(report)] == [
        ("d/adaptive@shared TTFT / d/adaptive@no-prefix-cache@shared's, second turn", 0.25, True),
        ("d/adaptive@shared TTFT / plain's, second turn", 0.25, True),
        ("d/adaptive@shared TTFT / plain's, first turn", 0.25, True),
        ("d/adaptive@split TTFT / d/adaptive@no-prefix-cache@split's, second turn", 0.4, False),
        ("d/adaptive@split TTFT / plain/verify-cpu's, second turn", 0.4, True),
        ("d/adaptive@split TTFT / plain/verify-cpu's, first turn", 0.4, True),
    ]

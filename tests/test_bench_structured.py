"""`specdec bench structured` (specdec_app/bench/structured.py) on the tiny models, over schemas
beyond the committed prompts (``HELD_OUT``): every method's output is valid for its schema, the
constrained methods' tokens equal plain constrained decoding in process (and that reference equals
the tests' own, ``constrained_greedy``), and the reports carry every figure. The default pipeline is
the tiny pipeline's coordinator; the one without grammar-aware drafting a second coordinator and
draft service started with ``--no-grammar-aware-drafting`` on the same verify service."""

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coordinator.settings import CoordinatorSettings
from draft_service.drafters.transformers_lm import TransformersDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.model_files import load_tokenizer
from specdec.sampling.structured_output import StructuredOutput
from specdec.settings import parse_settings
from specdec_app.bench.questions import Question
from specdec_app.bench.report import OVERALL
from specdec_app.bench.structured import (
    CLUSTER_ARGS,
    GRAMMAR_AWARE,
    NO_GRAMMAR_AWARE,
    REPORT_FILES,
    StructuredConfig,
    grammar_constraint,
    pass_rates,
    run_structured,
    schema_valid,
)
from specdec_app.bench.transformers_methods import TransformersMethod
from specdec_app.cli import app
from tests.conftest import CoordinatorThread, chat_ids, constrained_greedy


def obj(properties: dict, required: list[str] | None = None) -> dict:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def text(n: int, **more) -> dict:
    return {"type": "string", "maxLength": n, **more}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


# Not among benchmarks/structured/prompts.jsonl: bounded, so that a random model's answer ends
HELD_OUT = [
    (
        "extraction",
        "Extract the alarm: Sensor B7 reports level high, 3 times today.",
        obj(
            {
                "sensor": text(4, pattern="^[A-Z][0-9]$"),
                "level": {"enum": ["low", "mid", "high"]},
                "count": integer(0, 99),
            }
        ),
    ),
    (
        "extraction",
        "Extract the parcel: two boxes, SKU ABC12 x2 and XYZ07 x1, fragile.",
        obj(
            {
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": obj({"sku": text(5, pattern="^[A-Z]{3}[0-9]{2}$"), "qty": integer(1, 9)}),
                },
                "fragile": {"type": "boolean"},
            }
        ),
    ),
    (
        "generation",
        "Make up a user and their settings as JSON.",
        obj(
            {
                "user": obj({"id": integer(1, 999), "tag": text(6)}),
                "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            }
        ),
    ),
    ("generation", "Give a title and maybe a note, as JSON.", obj({"title": text(8), "note": text(5)}, ["title"])),
]
MAX_NEW = 48


def write_prompts(path) -> None:
    with path.open("w") as out:
        for number, (category, prompt, schema) in enumerate(HELD_OUT, 1):
            out.write(json.dumps({"id": number, "category": category, "prompt": prompt, "schema": schema}) + "\n")


@pytest.fixture(scope="module")
def without_grammar_aware_drafting(tiny_models, tiny_pipeline, tiny_drafters):
    """A coordinator and a draft service with grammar-aware drafting off, on the tiny pipeline's
    verify service; its drafter is the tiny pipeline's ``close`` model in an engine of its own."""
    close = TransformersDrafter(tiny_drafters["close"].lm.model, load_tokenizer(str(tiny_models.target_dir)), "close")
    close.measure_step_ms()
    draft = build_draft(
        DraftSettings(
            port=0, drafters=["close"], default_drafter="close", max_sessions=8, grammar_aware_drafting=False
        ),
        drafters={"close": close},
    )
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            max_new_tokens_limit=256,
            grammar_aware_drafting=False,
        )
    )
    yield f"127.0.0.1:{coordinator.port}"
    coordinator.stop()
    draft.stop(0)


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_models, tiny_pipeline, without_grammar_aware_drafting):
    folder = tmp_path_factory.mktemp("structured")
    write_prompts(folder / "held-out.jsonl")
    config = StructuredConfig(
        questions=folder / "held-out.jsonl",
        out=folder / "out",
        command="specdec bench structured",
        limit=None,
        max_new_tokens=MAX_NEW,
        target=str(tiny_models.target_dir),
        draft_model=str(tiny_models.target_dir),
        dtype="float32",
        drafter="close",
    )
    addresses = {GRAMMAR_AWARE: tiny_pipeline.address, NO_GRAMMAR_AWARE: without_grammar_aware_drafting}
    return run_structured(config, Console(quiet=True), addresses)


@pytest.mark.long  # a smoke run of the bench's processes: scripts/long_checks.sh
def test_every_constrained_output_is_schema_valid_and_identical_to_plain_constrained_decoding(
    report, tiny_pipeline, smollm2_tokenizer, tiny_grammar_vocab
):
    methods = ["plain", "close/adaptive", "close/adaptive@no-grammar-aware", "close/K=8"]
    by_method = {m: [r for r in report["measurements"] if r["method"] == m] for m in report["methods"]}
    for method in methods:
        assert [r["schema_valid"] for r in by_method[method]] == [True] * len(HELD_OUT), method
        assert [r["identical"] for r in by_method[method]] == [True] * len(HELD_OUT), method
    assert report["mismatches"] == []
    # the bench's reference, transformers' generate under the grammar's logits processor, is the
    # tests' own constrained decoding
    reference = [
        constrained_greedy(
            tiny_pipeline.plain_model,
            chat_ids(smollm2_tokenizer, prompt),
            StructuredOutput("json_schema", json.dumps(schema)),
            tiny_grammar_vocab,
            MAX_NEW,
        )
        for _, prompt, schema in HELD_OUT
    ]
    assert plain_token_ids(tiny_pipeline.plain_model, smollm2_tokenizer) == reference


def plain_token_ids(model, tokenizer) -> list[list[int]]:
    """The bench's plain constrained decoding of every held-out prompt (the reports leave token
    ids out)."""
    constraint = grammar_constraint(tokenizer, model.config.vocab_size, [2])
    plain = TransformersMethod(model, tokenizer, constraint=constraint)
    questions = [Question(n, c, p, json.dumps(s)) for n, (c, p, s) in enumerate(HELD_OUT, 1)]
    return [plain.run(q, MAX_NEW, 0).token_ids for q in questions]


@pytest.mark.long  # the bench run of the fixture: scripts/long_checks.sh
def test_the_report_gives_every_figure_per_method(report):
    overall = report["summary"][OVERALL]
    assert report["methods"] == [
        "plain",
        "close/adaptive",
        "close/adaptive@no-grammar-aware",
        "close/adaptive@unconstrained",
        "close/K=8",
        "close/K=8@unconstrained",
    ]
    assert report["categories"] == ["extraction", "generation"] and report["num_questions"] == len(HELD_OUT)
    default, without = overall["close/adaptive"], overall["close/adaptive@no-grammar-aware"]
    assert default["free_proposal_share"] > 0 and without["free_proposal_share"] == 0
    assert overall["plain"]["free_proposal_share"] is None and overall["plain"]["speedup"] == 1.0
    assert overall["close/adaptive@unconstrained"]["identical_rate"] is None
    assert overall["close/K=8@unconstrained"]["identical_rate"] is None
    for stats in overall.values():
        assert stats["tokens_per_second"] > 0 and 0 <= stats["schema_valid_rate"] <= 1
    assert default["draft_acceptance_rate"] is not None and default["mean_acceptance_length"] >= 1
    out = Path(report["config"]["out"])
    markdown = (out / REPORT_FILES[1]).read_text()
    assert "| method | schema-valid | identical to plain | tokens/s | speedup | acceptance rate |" in markdown
    assert "`close/adaptive` at " in markdown and "(target: 2x or more)" in markdown
    assert "`close/K=8`'s acceptance rate " in markdown
    assert "at equal depth: all 8 drafts of a `close/K=8` round passed in " in markdown
    assert len(overall["close/K=8"]["pass_rates"]) == 8
    assert json.loads((out / REPORT_FILES[0]).read_text())["methods"] == report["methods"]
    assert (out / REPORT_FILES[2]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pass_rates_are_per_position_over_the_rounds_that_reached_it():
    # 10 rounds: 2 accepted no draft, 3 one, 4 two, 1 three (past the depth: forced tokens)
    assert pass_rates([2, 3, 4, 1], 2) == [0.8, 5 / 8]
    assert pass_rates([3], 2) == [0.0, None]  # no round passed position 1
    assert pass_rates([], 1) == [None]


def test_schema_validity_is_the_reference_validators():
    schema = json.dumps(obj({"n": integer(0, 9)}))
    assert schema_valid('{"n": 3}', schema)
    assert not schema_valid('{"n": 12}', schema) and not schema_valid('{"n": 3', schema)


def test_the_services_of_the_comparison_take_their_flags():
    """The flags the bench starts the services without grammar-aware drafting with."""
    flags = CLUSTER_ARGS[NO_GRAMMAR_AWARE]
    assert not parse_settings(DraftSettings, flags["draft"], "draft").grammar_aware_drafting
    assert not parse_settings(CoordinatorSettings, flags["coordinator"], "coordinator").grammar_aware_drafting


def test_a_missing_question_file_is_a_clear_error():
    result = CliRunner().invoke(app, ["bench", "structured", "--questions", "missing.jsonl"])
    assert result.exit_code == 1
    assert "question file missing.jsonl not found" in " ".join(result.output.split())

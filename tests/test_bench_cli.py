"""`specdec bench`'s subcommands (specdec_app/bench_cli.py): one per mode, listed by `specdec bench
--help`; each refuses the options of the other modes (typer's own usage error, exit code 2), and
the old spelling, a mode's options straight after `bench`, is refused with the new spelling; the
default prompts are in the repository. The options each mode takes, their values and defaults: the
test file of each mode. No services, no models: a fraction of a second."""

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_app.bench.questions import load_questions
from specdec_app.bench_cli import SPEC_BENCH, STRUCTURED_PROMPTS
from specdec_app.cli import app

ROOT = Path(__file__).resolve().parent.parent

MODES = ("batch1", "concurrency", "ceiling", "structured", "conversation", "replicas")


def bench(*args: str):
    return CliRunner().invoke(app, ["bench", *args], terminal_width=200)


def test_help_lists_every_mode_with_a_line_of_help():
    result = bench("--help")
    assert result.exit_code == 0
    lines = {line.split()[1]: line for line in result.output.splitlines() if len(line.split()) > 2}
    for mode in MODES:
        assert mode in lines and len(lines[mode].split()) > 4, result.output


@pytest.mark.parametrize(
    ("mode", "option"),
    [
        ("batch1", ["--concurrency", "4"]),
        ("batch1", ["--drafter", "ngram"]),
        ("batch1", ["--methods", "pipeline/K=0"]),
        ("batch1", ["--arrivals", "burst"]),
        ("batch1", ["--load-generator", "guidellm"]),
        ("batch1", ["--slo-ttft-ms", "500"]),
        ("batch1", ["--structured"]),
        ("concurrency", ["--pipeline", "ngram:4"]),
        ("concurrency", ["--hf-k", "4"]),
        ("concurrency", ["--placement", "split"]),
        ("concurrency", ["--ceiling"]),
        ("ceiling", ["--target", "x"]),
        ("ceiling", ["--draft-model", "x"]),
        ("ceiling", ["--drafter", "ngram"]),
        ("ceiling", ["--network-rtt-ms", "5"]),
        ("structured", ["--pipeline", "ngram:4"]),
        ("structured", ["--concurrency", "1"]),
        ("structured", ["--placement", "split"]),
        ("structured", ["--network-rtt-ms", "5"]),
        ("conversation", ["--pipeline", "ngram:4"]),
        ("conversation", ["--concurrency", "1"]),
        ("conversation", ["--network-rtt-ms", "5"]),
        ("replicas", ["--pipeline", "ngram:4"]),
        ("replicas", ["--concurrency", "4"]),
        ("replicas", ["--conversation", "multi-turn"]),
        ("replicas", ["--limit", "2"]),
        ("replicas", ["--max-new-tokens", "16"]),
        ("replicas", ["--target", "gpt2"]),
        ("replicas", ["--drafter", "ngram"]),
        ("replicas", ["--arrivals", "burst"]),
        ("replicas", ["--categories", "qa"]),
        ("replicas", ["--network-rtt-ms", "5"]),
    ],
)
def test_a_mode_refuses_the_options_of_the_others(mode, option):
    result = bench(mode, *option)
    assert result.exit_code == 2
    assert f"No such option: {option[0]}" in result.output


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--concurrency", "4", "--limit", "2"], "specdec bench concurrency --concurrency 4 --limit 2"),
        (["--concurrency=1,4"], "specdec bench concurrency --concurrency=1,4"),
        (["--ceiling", "--concurrency", "16"], "specdec bench ceiling --concurrency 16"),
        (["--limit", "1", "--ceiling"], "specdec bench ceiling --limit 1"),
        (["--structured", "--drafter", "ngram"], "specdec bench structured --drafter ngram"),
        (["--conversation", "multi-turn"], "specdec bench conversation --conversation multi-turn"),
        (["--replicas", "--out", "o"], "specdec bench replicas --out o"),
        (["--limit", "1", "--pipeline", "ngram:4"], "specdec bench batch1 --limit 1 --pipeline ngram:4"),
    ],
)
def test_the_old_spelling_is_refused_with_the_new_one(old, new):
    result = bench(*old)
    assert result.exit_code == 2
    assert f"`{new}`" in " ".join(result.output.split())
    assert "the modes of specdec bench are subcommands now" in " ".join(result.output.split())


def test_bench_alone_shows_the_modes():
    result = bench()  # the help, whose exit code typer's version decides
    assert all(mode in result.output for mode in MODES)


def test_the_default_prompts_are_in_the_repository():
    """A fresh clone benchmarks with nothing beside it: the default question files are the
    repository's own (paths from its root), Spec-Bench's with its source and license beside it."""
    assert not SPEC_BENCH.is_absolute() and not STRUCTURED_PROMPTS.is_absolute()
    spec_bench = load_questions(ROOT / SPEC_BENCH)
    categories = ("translation", "summarization", "qa", "math_reasoning", "rag")
    assert Counter(question.category for question in spec_bench) == dict.fromkeys(categories, 80)
    assert {"SOURCE.md", "LICENSE"} <= {path.name for path in (ROOT / SPEC_BENCH).parent.iterdir()}
    assert (ROOT / STRUCTURED_PROMPTS).is_file()

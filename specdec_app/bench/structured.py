"""``specdec bench structured``: structured output at batch 1, greedy.

Every prompt of ``benchmarks/structured/prompts.jsonl`` (JSON-schema extraction from a given text,
JSON generation from a description; see its README) asks for an answer under its JSON schema.
Every method runs every prompt in one run, interleaved per prompt after a warm-up
(:func:`specdec_app.bench.run.run_all`):

- ``plain``: plain constrained decoding in process, the reference: transformers' ``generate`` on
  the target with a logits processor that masks each step by the schema's grammar
  (:class:`GrammarLogitsProcessor`, over :mod:`specdec.sampling.grammar`, the services' own module). Every
  speedup is over it, and the constrained methods' token ids are compared with its;
- ``<drafter>/adaptive``: the pipeline as deployed, with grammar-aware drafting (the draft masked
  by the grammar, the tokens it forces proposed without a forward and priced free by adaptive K);
- ``<drafter>/adaptive@no-grammar-aware``: the same drafter on services started with
  ``--no-grammar-aware-drafting`` (draft service and coordinator): the draft drafts as without a
  grammar and only the verify service's cut keeps the output in it (vLLM's and SGLang's way);
- ``<drafter>/adaptive@unconstrained``: the same prompts without the schema through the default
  pipeline, for the acceptance rate the grammar should not lower;
- ``<drafter>/K=8`` and ``<drafter>/K=8@unconstrained``: the same pair at a fixed K
  (:data:`FIXED_K`). Adaptive K drafts as deep as pays, and deeper under a grammar (its forced
  tokens are free), so the adaptive pair's acceptance rates are taken at different depths; the
  fixed pair compares them at the same one.

Reported per category and overall, per method: the schema-valid rate (the answer, EOS left out,
parsed as JSON and validated against its schema by ``jsonschema``: the reference validator, not the
grammar library, so a grammar compiled wrong would show), the share identical to ``plain``, tokens/s,
speedup, acceptance rate, mean accepted length and the share of free (forced) draft tokens; JSON,
Markdown and a PNG chart (:func:`specdec_app.bench.chart.write_chart`).
"""

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jsonschema
import torch
from rich.console import Console
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.engine.models import load_causal_lm
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.structured_output import UNLIMITED, StructuredOutput, grammar_tokenizer
from specdec_app.bench.chart import write_chart
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.pipeline_method import PipelineMethod, start_cluster
from specdec_app.bench.questions import Question, load_jsonl
from specdec_app.bench.report import (
    OVERALL,
    _cell,
    _header,
    _ratio,
    _table,
    speedup_table,
    summarize,
    write_json,
)
from specdec_app.bench.run import BenchInputs, machine_info, run_all
from specdec_app.bench.transformers_methods import TransformersMethod

REPORT_FILES = ("report-structured.json", "report-structured.md", "structured.png")
GRAMMAR_AWARE, NO_GRAMMAR_AWARE, UNCONSTRAINED = "", "@no-grammar-aware", "@unconstrained"  # method suffixes
FIXED_K = 8  # the fixed-K pair's K: the batch-1 bench's fixed K, about adaptive K's mean accepted length here
CLUSTER_ARGS = {  # the services of each cluster, by the suffix of its methods
    GRAMMAR_AWARE: {},
    NO_GRAMMAR_AWARE: {"draft": ["--no-grammar-aware-drafting"], "coordinator": ["--no-grammar-aware-drafting"]},
}


def load_structured_questions(
    path: Path, categories: list[str] | None = None, limit: int | None = None
) -> list[Question]:
    """The first ``limit`` prompts (all when None) of each category, grouped by category in the
    order of ``categories`` (file order when None). Each line of ``path`` is a JSON object with
    ``id``, ``category``, ``prompt`` and ``schema`` (a JSON schema).

    Raises:
        ValueError: the file is missing or malformed, a schema is not a valid JSON schema, or a
            category is not in it.
    """

    def question(record: dict) -> Question:
        try:
            jsonschema.validators.validator_for(record["schema"]).check_schema(record["schema"])
        except jsonschema.SchemaError as err:
            raise ValueError(f"its schema is not a JSON schema: {err.message}") from None
        return Question(int(record["id"]), str(record["category"]), str(record["prompt"]), json.dumps(record["schema"]))

    what = "a structured prompt (each line needs id, category, prompt and schema, a JSON schema)"
    return load_jsonl(path, question, what, categories, limit)


@dataclass
class StructuredConfig(BenchInputs):
    """What ``specdec bench structured`` runs: ``drafter``, the pipeline's (adaptive K)."""

    drafter: str = "llama-cpp"

    def load_questions(self) -> list[Question]:
        """The selected prompts. Raises ValueError naming the option to fix."""
        if self.max_new_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise ValueError("--max-new-tokens and --limit must be at least 1")
        questions = load_structured_questions(self.questions, self.categories, self.limit)
        if not questions:
            raise ValueError(f"{self.questions} has no prompts")
        return questions


class GrammarLogitsProcessor(LogitsProcessor):
    """Plain constrained decoding in transformers' ``generate`` (batch 1): each step's scores
    masked by the grammar state the generated tokens reach (disallowed tokens at -inf), the
    matcher following the ids after the ``prompt_len`` prompt tokens."""

    def __init__(self, matcher: GrammarMatcher, prompt_len: int):
        self.matcher, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.matcher.advance(input_ids[0, self.prompt_len + self.matcher.num_tokens :].tolist())
        allowed = torch.from_numpy(self.matcher.allowed()).to(scores.device)
        return scores.masked_fill(~allowed[: scores.shape[-1]], float("-inf"))


def grammar_constraint(
    tokenizer, vocab_size: int, eos_token_ids: list[int]
) -> Callable[[str, int], LogitsProcessorList]:
    """A schema's logits processors for ``generate`` after a prompt of n tokens (``(schema, n)``),
    over the target's vocabulary as the grammar library sees it (built once, about 0.4 s)."""
    vocabulary = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)

    def constraint(schema: str, prompt_len: int) -> LogitsProcessorList:
        matcher = GrammarMatcher(StructuredOutput("json_schema", schema), vocabulary, UNLIMITED)
        return LogitsProcessorList([GrammarLogitsProcessor(matcher, prompt_len)])

    return constraint


def schema_valid(text: str, schema: str) -> bool:
    """Whether ``text`` is one JSON value valid for the JSON schema ``schema`` (jsonschema)."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    schema_object = json.loads(schema)
    return jsonschema.validators.validator_for(schema_object)(schema_object).is_valid(instance)


def _plain_constrained(config: StructuredConfig, console: Console) -> TransformersMethod:
    console.print(f"loading the target {config.target} in transformers (plain constrained decoding)...")
    target, tokenizer = load_causal_lm(config.target, config.dtype)
    eos = target.generation_config.eos_token_id
    constraint = grammar_constraint(tokenizer, target.config.vocab_size, [eos] if isinstance(eos, int) else eos)
    return TransformersMethod(target, tokenizer, constraint=constraint)


def _pipelines(config: StructuredConfig, addresses: dict[str, str]) -> list[PipelineMethod]:
    """The pipeline methods, on the coordinator of each cluster (``addresses`` by method suffix)."""
    drafter = config.drafter
    return [
        PipelineMethod(addresses[GRAMMAR_AWARE], drafter, None),
        PipelineMethod(addresses[NO_GRAMMAR_AWARE], drafter, None, NO_GRAMMAR_AWARE),
        PipelineMethod(addresses[GRAMMAR_AWARE], drafter, None, UNCONSTRAINED, constrained=False),
        PipelineMethod(addresses[GRAMMAR_AWARE], drafter, FIXED_K),
        PipelineMethod(addresses[GRAMMAR_AWARE], drafter, FIXED_K, UNCONSTRAINED, constrained=False),
    ]


def run_structured(config: StructuredConfig, console: Console, addresses: dict[str, str] | None = None) -> dict:
    """Runs the benchmark and writes its reports (:data:`REPORT_FILES`) to ``config.out``;
    returns the report. ``addresses``: the coordinators to use, by method suffix (GRAMMAR_AWARE,
    NO_GRAMMAR_AWARE; each with its own draft service), else the services are started here with
    the config's models, one set for each. Raises ValueError for bad options, RuntimeError when a
    service fails to start, grpc.RpcError when a pipeline request fails."""
    questions = config.load_questions()
    config.out.mkdir(parents=True, exist_ok=True)
    plain = _plain_constrained(config, console)
    clusters = []
    try:
        if addresses is None:
            addresses = {}
            for suffix, extra_args in CLUSTER_ARGS.items():
                console.print(f"starting the coordinator, draft ({config.drafter}) and verify services{suffix}...")
                log_dir = config.out / "logs" / (suffix.lstrip("@") or "grammar-aware")
                clusters.append(
                    start_cluster(
                        config.target,
                        config.draft_model,
                        [config.drafter],
                        config.dtype,
                        log_dir,
                        extra_args=extra_args,
                    )
                )
                addresses[suffix] = clusters[-1].address("coordinator")
        methods = [plain, *_pipelines(config, addresses)]
        measurements = run_all(methods, questions, config, console)
    finally:
        for cluster in clusters:
            cluster.stop()
    report = _report(config, questions, methods, measurements, plain.tokenizer)
    write_json(report, config.out / REPORT_FILES[0])
    (config.out / REPORT_FILES[1]).write_text(to_markdown(report))
    write_chart(report, config.out / REPORT_FILES[2])
    return report


def _report(config, questions, methods, measurements: list[Measurement], tokenizer) -> dict:
    schemas = {q.question_id: q.schema for q in questions}
    valid = {
        id(m): schema_valid(tokenizer.decode(m.token_ids, skip_special_tokens=True), schemas[m.question_id])
        for m in measurements
    }
    summary = summarize(measurements, {m.name: m.k for m in methods})
    for group, stats in summary.items():
        for method, s in stats.items():
            runs = [m for m in measurements if m.method == method and group in (OVERALL, m.category)]
            s["schema_valid_rate"] = sum(valid[id(m)] for m in runs) / len(runs)
            forced = [m.num_forced_draft_tokens for m in runs if m.num_forced_draft_tokens is not None]
            s["free_proposal_share"] = _ratio(sum(forced), s["num_draft_tokens"]) if forced else None
            if method.endswith(UNCONSTRAINED):  # other text than plain constrained decoding's
                s["identical_rate"] = None
    for method in (m.name for m in methods if m.k == FIXED_K):
        for stats in summary.values():
            if method in stats:
                stats[method]["pass_rates"] = pass_rates(stats[method]["acceptance_histogram"], FIXED_K)
    records = [m.to_json() | {"schema_valid": valid[id(m)]} for m in measurements]
    return {
        "mode": "structured",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "machine": machine_info(),
        "num_questions": len(questions),
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "methods": [m.name for m in methods],
        "summary": summary,
        "mismatches": [r for r in records if not r["identical"] and not r["method"].endswith(UNCONSTRAINED)],
        "measurements": records,
    }


def pass_rates(histogram: list[int], depth: int) -> list[float | None]:
    """P(draft position i passes | positions 1..i-1 passed) for i = 1..``depth``, from
    ``histogram`` (rounds by accepted drafts): the acceptance of a fixed-K method at equal depth,
    whatever its rounds proposed past ``depth`` (forced tokens take a constrained round further).
    A round that proposed fewer than i tokens (at the length limit) counts as stopped before i;
    None where no round reached i - 1."""
    reached = [sum(histogram[i:]) for i in range(depth + 1)]
    return [reached[i] / reached[i - 1] if reached[i - 1] else None for i in range(1, depth + 1)]


def _all_pass(rates: list[float | None]) -> float | None:
    """The share of rounds whose drafts all passed: the product of ``rates`` (None if one is)."""
    known = [rate for rate in rates if rate is not None]
    return math.prod(known) if len(known) == len(rates) else None


def structured_table(report: dict) -> list[str]:
    """Per method, overall: schema-valid, identical to plain constrained, tokens/s, speedup,
    acceptance, mean accepted length, the share of free (forced) draft tokens."""
    rows = [
        [
            method,
            _cell(s["schema_valid_rate"], ".0%"),
            _cell(s["identical_rate"], ".0%"),
            _cell(s["tokens_per_second"], ".1f"),
            _cell(s["speedup"], ".2f", "x"),
            _cell(s["draft_acceptance_rate"], ".3f"),
            _cell(s["mean_acceptance_length"], ".2f"),
            _cell(s["free_proposal_share"], ".0%"),
        ]
        for method, s in report["summary"][OVERALL].items()
    ]
    header = ["method", "schema-valid", "identical to plain", "tokens/s", "speedup", "acceptance rate"]
    return _table([*header, "mean accepted length", "free (forced) proposals"], rows)


def targets(report: dict) -> list[str]:
    """The mode's targets, read off the overall figures: the default pipeline at least 2x plain
    constrained decoding, its acceptance no lower than the same prompts unconstrained (adaptive K,
    and the fixed-K pair at the same depth)."""
    overall = report["summary"][OVERALL]
    default = next(name for name in report["methods"] if name.endswith("/adaptive"))
    fixed = next(name for name in report["methods"] if name.endswith(f"/K={FIXED_K}"))
    speedup = _cell(overall[default]["speedup"], ".2f", "x")
    lines = [f"- `{default}` at {speedup} plain constrained decoding (target: 2x or more)"]
    for method in (default, fixed):
        acceptance = overall[method]["draft_acceptance_rate"]
        unconstrained = overall[f"{method}{UNCONSTRAINED}"]["draft_acceptance_rate"]
        lines.append(
            f"- `{method}`'s acceptance rate {_cell(acceptance, '.3f')} against {_cell(unconstrained, '.3f')} "
            "unconstrained (target: no lower)"
        )
    constrained, free = (overall[name]["pass_rates"] for name in (fixed, f"{fixed}{UNCONSTRAINED}"))

    def by_position(rates: list[float | None]) -> str:
        return " ".join(_cell(rate, ".2f") for rate in rates)

    lines.append(
        f"- at equal depth: all {FIXED_K} drafts of a `{fixed}` round passed in {_cell(_all_pass(constrained), '.3f')} "
        f"of its rounds against {_cell(_all_pass(free), '.3f')} unconstrained; per position 1..{FIXED_K} "
        f"{by_position(constrained)} against {by_position(free)}"
    )
    return lines


def to_markdown(report: dict) -> str:
    lines = [
        *_header(
            report, "specdec bench structured", f", {report['num_questions']} JSON-schema prompts; batch 1, shared."
        ),
        "",
        "`plain`: constrained decoding in process (transformers' generate, the grammar's mask at each step). "
        f"`@no-grammar-aware`: services with `--no-grammar-aware-drafting`. `{UNCONSTRAINED}`: the same prompts "
        f"without the schema. `K={FIXED_K}`: K fixed, to compare acceptance at one depth. Schema-valid: the answer "
        "parses as JSON and `jsonschema` validates it.",
        "",
        "## Overall",
        "",
        *structured_table(report),
        "",
        *targets(report),
        "",
        "## Speedup over plain constrained decoding (ratio of tokens/s)",
        "",
        *speedup_table(report),
        "",
    ]
    if report["mismatches"]:
        lines += ["## Token ids that differ from plain constrained decoding", ""]
        lines += [
            f"- {m['method']} on prompt {m['question_id']} ({m['category']}): first at token {m['first_mismatch']}"
            for m in report["mismatches"]
        ]
        lines.append("")
    return "\n".join(lines)

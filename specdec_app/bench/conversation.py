"""``specdec bench conversation multi-turn|shared-system-prompt``: prefix caching in the time to
first token, at batch 1, greedy.

Requests that share a prefix with an earlier one, as chat clients send them:

- ``multi-turn``: each Spec-Bench question's first turn, then its second turn: the first turn, the
  method's own answer as the assistant message (its token ids decoded as the coordinator streams
  them, special tokens left out) and a follow-up user message, MT-bench style (Zheng et al. 2023),
  from ``benchmarks/conversation/follow_ups.json`` (per category; the question's is the one at
  ``question_id`` modulo their number). The second turns are measured; the first turns are
  reported apart.
- ``shared-system-prompt``: every question after one long system prompt
  (``benchmarks/conversation/system_prompt.txt``, about 600 tokens). The first question (the first
  category's first) warms the caches and is reported apart; the other questions are measured, so
  the run needs two at least.

Methods, all in one run, each question through every method in turn (the order rotating per
question, :func:`specdec_app.bench.run.interleaved`) after an unmeasured warm-up that shares no
prefix with the questions beyond what the chat template puts first (SmolLM2's adds a default
system prompt to a conversation without one, which the first turns of ``multi-turn`` share):

- ``plain`` (and ``plain/verify-cpu`` with the split placement): the target's ``generate`` in
  process, the reference for speedup and identity;
- ``<drafter>/adaptive``: the pipeline on services with prefix caching (their default);
- ``<drafter>/adaptive@no-prefix-cache``: the same on services started with
  ``--no-enable-prefix-caching`` (verify and draft).

With several placements every pipeline runs on each, named ``...@<placement>``. Each pipeline
method has services of its own, so no method finds another's prompts in a cache.

Identity (greedy): a first turn is compared with ``plain``'s; a second turn with ``plain``'s
second turn on the same conversation, which is ``plain``'s own when the method's first answer
equals ``plain``'s, else one more, unmeasured, ``plain`` request on the method's conversation.

Reported per method, per category and overall, for the measured requests and apart for the first
ones: TTFT mean and p50, tokens/s, speedup over ``plain``, the share identical to ``plain``, the
mean prompt tokens and the mean of them the verify and the draft service found cached
(``RequestMetrics.num_cached_prompt_tokens`` and ``num_draft_cached_prompt_tokens``; the draft's
is 0 too for a request that never prefilled a draft session: adaptive K opens it only for a round
that drafts with it); then the mode's targets per placement, judged on the mean TTFT of the
measured requests overall: with prefix caching / without at most 1/3, the pipeline's /
``plain``'s (shared) or ``plain/verify-cpu``'s (split) at most 1 (on the first requests too).
JSON, Markdown and a PNG of the speedups (:func:`specdec_app.bench.chart.write_chart`).
"""

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console

from specdec.engine.models import load_causal_lm
from specdec_app.bench.chart import write_chart
from specdec_app.bench.cpu_pinning import PINNED_PLAIN, CpuPinning
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.pipeline_method import PipelineMethod, start_cluster
from specdec_app.bench.questions import Question
from specdec_app.bench.report import (
    BASELINE,
    OVERALL,
    _cell,
    _header,
    _placement,
    _ratio,
    _table,
    percentile,
    summarize,
    write_json,
)
from specdec_app.bench.run import (
    BenchInputs,
    compared_to_plain,
    interleaved,
    machine_info,
    parse_placements,
    run_all,
    warm_up,
)
from specdec_app.bench.transformers_methods import TransformersMethod

MULTI_TURN, SHARED_SYSTEM_PROMPT = "multi-turn", "shared-system-prompt"
CONVERSATIONS = (MULTI_TURN, SHARED_SYSTEM_PROMPT)
FOLLOW_UPS = Path("benchmarks/conversation/follow_ups.json")
SYSTEM_PROMPT = Path("benchmarks/conversation/system_prompt.txt")
PREFIX_CACHE, NO_PREFIX_CACHE = "", "@no-prefix-cache"  # method suffixes, by the services' prefix caching
PREFIX_CACHING = {PREFIX_CACHE: True, NO_PREFIX_CACHE: False}
# the warm-up: no prefix in common with the questions or the system prompt but what the template puts first
WARM_UP = Question(0, "warm-up", "Name three colours of the rainbow.")
PHASES = {  # the requests of each phase, by mode: (the first ones, the measured ones)
    MULTI_TURN: ("first turn", "second turn"),
    SHARED_SYSTEM_PROMPT: ("first request (cold cache)", "later requests"),
}
TTFT_CACHE_GOAL, TTFT_PLAIN_GOAL = 1 / 3, 1.0


def report_files(conversation: str) -> tuple[str, str, str]:
    """The JSON, Markdown and PNG reports of a mode, so that both modes can share ``--out``."""
    return f"report-{conversation}.json", f"report-{conversation}.md", f"{conversation}.png"


@dataclass
class ConversationConfig(BenchInputs):
    """What ``specdec bench conversation`` runs: ``conversation``, the mode; ``drafter``, the
    pipeline's (adaptive K); ``placements``, as ``specdec bench conversation --placement``; ``follow_ups`` and
    ``system_prompt``, the files of the follow-up messages and the system prompt."""

    conversation: str = MULTI_TURN
    drafter: str = "llama-cpp"
    placements: list[str] = field(default_factory=lambda: ["shared"])
    follow_ups: Path = FOLLOW_UPS
    system_prompt: Path = SYSTEM_PROMPT

    def load_questions(self) -> list[Question]:
        """The selected questions: first turns (multi-turn) or after the system prompt. Raises
        ValueError naming the option or file to fix."""
        if self.conversation not in CONVERSATIONS:
            raise ValueError(f"--conversation {self.conversation!r}: use {' or '.join(CONVERSATIONS)}")
        questions = super().load_questions()
        if self.conversation == MULTI_TURN:
            follow_ups = load_follow_ups(self.follow_ups)
            missing = sorted({q.category for q in questions} - set(follow_ups))
            if missing:
                raise ValueError(f"{self.follow_ups} has no follow-up for the categories {missing}: add them")
            return questions
        if len(questions) < 2:
            raise ValueError(
                "--conversation shared-system-prompt needs 2 questions at least (the first warms the caches): "
                "raise --limit or name more --categories"
            )
        system = read_system_prompt(self.system_prompt)
        return [replace(q, messages=(("system", system),)) for q in questions]


def load_follow_ups(path: Path) -> dict[str, list[str]]:
    """``{category: [follow-up message, ...]}`` from a JSON object. Raises ValueError for a missing
    or malformed file."""
    try:
        follow_ups = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"follow-up file {path}: {err}; it must be a JSON object of category -> messages") from None
    if not isinstance(follow_ups, dict) or not all(
        isinstance(messages, list) and messages and all(isinstance(m, str) and m.strip() for m in messages)
        for messages in follow_ups.values()
    ):
        raise ValueError(f"follow-up file {path}: give each category a list of non-empty messages")
    return follow_ups


def read_system_prompt(path: Path) -> str:
    """The system prompt's text. Raises ValueError for a missing or empty file."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"system prompt file {path}: {err}") from None
    if not text:
        raise ValueError(f"system prompt file {path} is empty")
    return text


def second_turn(question: Question, answer: str, follow_ups: dict[str, list[str]]) -> Question:
    """The question's second turn after ``answer`` to its first: the conversation so far, then the
    category's follow-up at ``question_id`` modulo their number."""
    messages = follow_ups[question.category]
    return replace(
        question,
        messages=(*question.messages, ("user", question.prompt), ("assistant", answer)),
        prompt=messages[question.question_id % len(messages)],
    )


def _transformers_methods(config: ConversationConfig, placements: list[CpuPinning], console: Console) -> list:
    """``plain``, and ``plain/verify-cpu`` pinned to the split placement's verify CPU."""
    console.print(f"loading the target {config.target} in transformers (plain)...")
    target, tokenizer = load_causal_lm(config.target, config.dtype)
    methods = [TransformersMethod(target, tokenizer)]
    split = next((where for where in placements if where.cpus), None)
    if split:
        methods.append(TransformersMethod(target, tokenizer, cpus=split.cpus["verify"], name=PINNED_PLAIN))
    return methods


def placement_suffix(name: str, placements: list[str]) -> str:
    """A pipeline method's placement suffix (``@split``) where the run has several, else none."""
    return f"@{name}" if len(placements) > 1 else ""


def method_suffixes(placements: list[CpuPinning]) -> dict[str, tuple[CpuPinning, bool]]:
    """Each pipeline method's name suffix: its placement and whether its services cache prefixes."""
    names = [where.name for where in placements]
    return {
        cache + placement_suffix(where.name, names): (where, caching)
        for where in placements
        for cache, caching in PREFIX_CACHING.items()
    }


def run_conversation(config: ConversationConfig, console: Console, addresses: dict[str, str] | None = None) -> dict:
    """Runs the benchmark and writes its reports (:func:`report_files`) to ``config.out``; returns
    the report. ``addresses``: the coordinators to use, by method suffix (:func:`method_suffixes`;
    each with services of its own), else the services are started here with the config's models,
    one set for each. Raises ValueError for bad options, RuntimeError when a service fails to
    start, grpc.RpcError when a pipeline request fails."""
    placements = parse_placements(config.placements)
    questions = config.load_questions()
    config.out.mkdir(parents=True, exist_ok=True)
    methods = _transformers_methods(config, placements, console)
    clusters = []
    try:
        if addresses is None:
            addresses = {}
            for suffix, (where, caching) in method_suffixes(placements).items():
                console.print(f"starting the coordinator, draft ({config.drafter}) and verify services{suffix}...")
                log_dir = config.out / "logs" / f"{where.name}-{'prefix-cache' if caching else 'no-prefix-cache'}"
                cluster = start_cluster(
                    config.target,
                    config.draft_model,
                    [config.drafter],
                    config.dtype,
                    log_dir,
                    placement=where,
                    prefix_caching=caching,
                )
                clusters.append(cluster)
                addresses[suffix] = cluster.address("coordinator")
        methods += [PipelineMethod(addresses[suffix], config.drafter, None, suffix) for suffix in addresses]
        if config.conversation == MULTI_TURN:
            first, measured = _multi_turn(methods, questions, config, console)
        else:
            first, measured = _shared_system_prompt(methods, questions, config, console)
    finally:
        for cluster in clusters:
            cluster.stop()
    report = _report(config, questions, methods, first, measured)
    json_file, markdown_file, chart_file = report_files(config.conversation)
    write_json(report, config.out / json_file)
    (config.out / markdown_file).write_text(to_markdown(report))
    write_chart(report, config.out / chart_file)
    return report


def _multi_turn(methods, questions: list[Question], config: ConversationConfig, console: Console):
    """``(first turns, second turns)``, each compared with ``plain``'s on the same conversation."""
    follow_ups = load_follow_ups(config.follow_ups)
    plain, names = methods[0], [method.name for method in methods]
    warm_up(methods, WARM_UP, config)
    first: list[dict[str, Measurement]] = [{} for _ in questions]
    second: list[dict[str, Measurement]] = [{} for _ in questions]
    conversations: list[dict[str, Question]] = [{} for _ in questions]  # each method's second turn
    for i, question, method in interleaved(methods, questions, console):
        first[i][method.name] = method.run(question, config.max_new_tokens, config.seed)
        answer = plain.tokenizer.decode(first[i][method.name].token_ids, skip_special_tokens=True)
        conversations[i][method.name] = second_turn(question, answer, follow_ups)
        second[i][method.name] = method.run(conversations[i][method.name], config.max_new_tokens, config.seed)
    references = {c[BASELINE]: m[BASELINE].token_ids for c, m in zip(conversations, second, strict=True)}
    for by_method, conversation_of in zip(second, conversations, strict=True):
        for name, m in by_method.items():
            conversation = conversation_of[name]
            if conversation not in references:  # its first answer differs from plain's
                references[conversation] = plain.run(conversation, config.max_new_tokens, config.seed).token_ids
            m.compare_to(references[conversation])
    return compared_to_plain(first, names), [by_method[name] for by_method in second for name in names]


def _shared_system_prompt(methods, questions: list[Question], config: ConversationConfig, console: Console):
    """``(the first question's requests, the others')``, each compared with ``plain``'s."""
    measurements = run_all(methods, questions, config, console, WARM_UP)
    return measurements[: len(methods)], measurements[len(methods) :]


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize_requests(measurements: list[Measurement], methods: list[str]) -> dict[str, dict[str, dict]]:
    """:func:`specdec_app.bench.report.summarize` (per category and overall, per method) with the
    TTFT p50 (``ttft_ms_p50``; the mean is ``time_to_first_token_ms``) and the means of the prompt
    tokens and of those found cached on the verify and the draft service (None: not reported)."""
    summary = summarize(measurements, dict.fromkeys(methods, 0))
    for group, stats in summary.items():
        for method, s in stats.items():
            runs = [m for m in measurements if m.method == method and group in (OVERALL, m.category)]
            s["ttft_ms_p50"] = percentile([m.ttft_ms for m in runs], 50)
            s["mean_prompt_tokens"] = _mean([m.num_prompt_tokens for m in runs])
            s["mean_cached_prompt_tokens"] = _mean([m.num_cached_prompt_tokens for m in runs])
            s["mean_draft_cached_prompt_tokens"] = _mean([m.num_draft_cached_prompt_tokens for m in runs])
    return summary


def targets(report: dict) -> list[dict]:
    """The mode's TTFT targets per placement, read off the measured requests overall (and the
    pipeline against plain on the first requests too): ``name``, ``ratio`` of the mean TTFTs,
    ``ratio_p50`` of the p50s, ``goal`` (at most), ``met`` (on the mean)."""
    config, rows = report["config"], []
    for name in config["placements"]:
        suffix = placement_suffix(name, config["placements"])
        cached = f"{config['drafter']}/adaptive{suffix}"
        uncached = f"{config['drafter']}/adaptive{NO_PREFIX_CACHE}{suffix}"
        plain = PINNED_PLAIN if name == "split" else BASELINE
        comparisons = [
            ("summary", cached, uncached, TTFT_CACHE_GOAL),
            ("summary", cached, plain, TTFT_PLAIN_GOAL),
            ("first_summary", cached, plain, TTFT_PLAIN_GOAL),
        ]
        for phase, method, baseline, goal in comparisons:
            a, b = report[phase][OVERALL][method], report[phase][OVERALL][baseline]
            ratio = _ratio(a["time_to_first_token_ms"], b["time_to_first_token_ms"])
            rows.append(
                {
                    "name": f"{method} TTFT / {baseline}'s, {report['phases'][phase]}",
                    "ratio": ratio,
                    "ratio_p50": _ratio(a["ttft_ms_p50"], b["ttft_ms_p50"]),
                    "goal": goal,
                    "met": ratio is not None and ratio <= goal,
                }
            )
    return rows


def _report(config, questions, methods, first: list[Measurement], measured: list[Measurement]) -> dict:
    """``summary`` (of the ``measured`` requests, the one the chart and the batch-1 helpers read)
    and ``first_summary``; ``phases`` names each; every request's record has its ``phase``,
    ``first`` or ``measured``."""
    names = [m.name for m in methods]
    phases = (("first", first), ("measured", measured))
    records = [m.to_json() | {"phase": phase} for phase, runs in phases for m in runs]
    report = {
        "mode": "conversation",
        "conversation": config.conversation,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "machine": machine_info(),
        "num_questions": len(questions),
        "categories": list(dict.fromkeys(m.category for m in measured)),  # of the measured requests
        "methods": names,
        "phases": dict(zip(("first_summary", "summary"), PHASES[config.conversation], strict=True)),
        "summary": summarize_requests(measured, names),
        "first_summary": summarize_requests(first, names),
        "mismatches": [r for r in records if not r["identical"]],
        "measurements": records,
    }
    report["targets"] = targets(report)
    return report


def requests_table(report: dict, phase: str) -> list[str]:
    """Per method, overall, the requests of ``phase`` (``summary``: measured, ``first_summary``):
    TTFT mean and p50, tokens/s, speedup, identity, prompt tokens and those found cached."""
    rows = [
        [
            method,
            _cell(s["time_to_first_token_ms"], ".0f"),
            _cell(s["ttft_ms_p50"], ".0f"),
            _cell(s["tokens_per_second"], ".1f"),
            _cell(s["speedup"], ".2f", "x"),
            _cell(s["identical_rate"], ".0%"),
            _cell(s["mean_prompt_tokens"], ".0f"),
            _cell(s["mean_cached_prompt_tokens"], ".0f"),
            _cell(s["mean_draft_cached_prompt_tokens"], ".0f"),
        ]
        for method, s in report[phase][OVERALL].items()
    ]
    header = ["method", "TTFT mean ms", "TTFT p50 ms", "tokens/s", "speedup", "identical to plain", "prompt tokens"]
    return _table([*header, "cached (verify)", "cached (draft)"], rows)


def ttft_table(report: dict) -> list[str]:
    """Methods x (categories, overall): the mean TTFT of the measured requests, ms."""
    groups = [*report["categories"], OVERALL]
    rows = [
        [method, *(_cell(report["summary"][g][method]["time_to_first_token_ms"], ".0f") for g in groups)]
        for method in report["methods"]
    ]
    return _table(["method", *groups], rows)


def targets_table(report: dict) -> list[str]:
    rows = [
        [
            t["name"],
            _cell(t["ratio"], ".2f"),
            _cell(t["ratio_p50"], ".2f"),
            f"{t['goal']:.2f}",
            "yes" if t["met"] else "no",
        ]
        for t in report["targets"]
    ]
    return _table(["target", "mean TTFT ratio", "p50 TTFT ratio", "goal (at most)", "met"], rows)


SENT = {
    MULTI_TURN: "each question's first turn, then its second turn: the first turn, the method's own answer and a "
    "follow-up (benchmarks/conversation/follow_ups.json). Measured: the second turns.",
    SHARED_SYSTEM_PROMPT: "every question after the same system prompt (benchmarks/conversation/system_prompt.txt); "
    "the first question warms the caches. Measured: the other questions.",
}


def to_markdown(report: dict) -> str:
    """The report as Markdown: what was sent, the targets, the measured and the first requests per
    method, the measured TTFT per category, the outputs that differ from plain's."""
    first, measured = report["phases"]["first_summary"], report["phases"]["summary"]
    lines = [
        *_header(
            report,
            f"specdec bench conversation {report['conversation']}",
            f", {report['num_questions']} questions; {_placement(report)}.",
        ),
        "",
        f"Sent: {SENT[report['conversation']]} `{NO_PREFIX_CACHE}`: services started with "
        "`--no-enable-prefix-caching` (verify and draft); cached: mean prompt tokens the service found in its "
        "prefix cache.",
        "",
        "## Targets (mean TTFT; goal: at most)",
        "",
        *targets_table(report),
        "",
        f"## Measured: {measured} (overall)",
        "",
        *requests_table(report, "summary"),
        "",
        f"## Apart: {first} (overall)",
        "",
        *requests_table(report, "first_summary"),
        "",
        f"## TTFT per category, {measured} (mean, ms)",
        "",
        *ttft_table(report),
        "",
    ]
    if report["mismatches"]:
        lines += ["## Token ids that differ from plain decoding", ""]
        lines += [
            f"- {m['method']} on question {m['question_id']} ({m['category']}, "
            f"{first if m['phase'] == 'first' else measured}): first at token {m['first_mismatch']}"
            for m in report["mismatches"]
        ]
        lines.append("")
    return "\n".join(lines)

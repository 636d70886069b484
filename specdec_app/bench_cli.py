"""``specdec bench``: one subcommand per benchmark mode, each taking only the options its mode uses.
The options several modes share are declared once below (the ``Annotated`` aliases) and named the
same in every subcommand; the runs themselves are :mod:`specdec_app.bench`'s. The spelling from
before the subcommands, a mode's options straight after ``bench`` (``specdec bench --concurrency
4``), is refused (exit code 2) with the new spelling printed, not translated: a command line either
means what it says or is refused."""

import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import grpc
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

if TYPE_CHECKING:
    from specdec_app.bench.concurrency import ConcurrencyConfig

# soft_wrap: messages are not broken at the console's width, so a path or a command in one stays whole
# for copying (the terminal wraps it)
stderr = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")

# The modes' default prompts, in the repository (read from its root): Spec-Bench's 400 questions
# (benchmarks/prompts/spec_bench/SOURCE.md: source and license) and the structured-output prompts.
SPEC_BENCH = Path("benchmarks/prompts/spec_bench/question.jsonl")
STRUCTURED_PROMPTS = Path("benchmarks/structured/prompts.jsonl")
# The flags that chose a mode before the modes were subcommands, in the order they took precedence:
# the subcommand each stands for, and whether it stays an option of that subcommand.
OLD_MODE_FLAGS = {
    "--replicas": ("replicas", False),
    "--conversation": ("conversation", True),
    "--structured": ("structured", False),
    "--ceiling": ("ceiling", False),
    "--concurrency": ("concurrency", True),
}


class BenchGroup(TyperGroup):
    """``specdec bench``'s subcommands. A mode's options straight after ``bench`` (the spelling from
    before the subcommands) are refused, exit code 2 as any usage error, with the new spelling."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: click's Context, vendored by newer typer
        if args and args[0].startswith("-") and args[0] not in ctx.help_option_names:
            stderr.print(f"[red]error: {escape(new_spelling(args))}[/red]", highlight=False)
            raise typer.Exit(2)
        return super().parse_args(ctx, args)


def new_spelling(args: list[str]) -> str:
    """What to run instead of ``specdec bench ARGS`` (the old spelling, the mode chosen by a flag)."""
    names = [arg.split("=", 1)[0] for arg in args]
    flag = next((flag for flag in OLD_MODE_FLAGS if flag in names), None)
    mode, kept = OLD_MODE_FLAGS[flag] if flag else ("batch1", True)
    rest = [arg for arg, name in zip(args, names, strict=True) if kept or name != flag]
    old = f"`specdec bench {flag} ...`" if flag else "`specdec bench` with the batch-1 options"
    new = f"`specdec bench {mode} {flag} ...`" if flag and kept else f"`specdec bench {mode} ...`"
    return (
        f"the modes of specdec bench are subcommands now: {old} is {new}; run "
        f"`{shlex.join(['specdec', 'bench', mode, *rest])}` (specdec bench --help lists the modes)"
    )


bench_app = typer.Typer(
    cls=BenchGroup,
    no_args_is_help=True,
    help="Benchmark the pipeline: one subcommand per mode, each with only its own options (specdec bench MODE "
    "--help). The old spelling, a mode's options straight after bench (e.g. specdec bench --concurrency 4), is "
    "refused with exit code 2 and the new one (specdec bench concurrency --concurrency 4) printed.",
)

# ---- the options, each declared once; every subcommand names its own by these aliases ----

Questions = Annotated[Path, typer.Option(help="Question file in the Spec-Bench JSONL schema.")]
StructuredQuestions = Annotated[
    Path, typer.Option(help="Question file: JSON lines of id, category, prompt and schema.")
]
Categories = Annotated[str | None, typer.Option(help="Comma-separated categories (default: all in the file).")]
Limit = Annotated[int, typer.Option(help="Prompts per category (the first N of each).")]
MaxNewTokens = Annotated[int, typer.Option(help="New tokens per prompt, the same for every method.")]
Seed = Annotated[int, typer.Option(help="Seed sent with every request.")]
Target = Annotated[str, typer.Option(help="Target model (verify service and the transformers methods).")]
DraftModel = Annotated[str, typer.Option(help="Model of the llama-cpp and transformers drafters (and of hf-assisted).")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.")]
Out = Annotated[Path, typer.Option(help="Directory for the mode's reports (JSON, Markdown, PNG) and service logs.")]
Pipeline = Annotated[
    list[str] | None,
    typer.Option(
        help="DRAFTER:K of a pipeline method, K in 1..16 or auto (adaptive; repeatable; default ngram:4 "
        "ngram:8 llama-cpp:4 llama-cpp:8 ngram:auto llama-cpp:auto)."
    ),
]
HfK = Annotated[
    list[int] | None,
    typer.Option(help="K of transformers' prompt lookup and assisted generation (repeatable; default 4)."),
]
Placements = Annotated[
    list[str] | None,
    typer.Option(
        help="shared (default): every process on every core; split: the draft service pinned to one CPU "
        "and the verify service to another (one thread each), emulating a draft on its own device; "
        "plain then also runs pinned to the verify service's CPU (plain/verify-cpu). Repeatable: "
        "each placement gets its own services and every pipeline runs on each in the same run "
        "(methods named <method>@<placement>).",
    ),
]
Drafter = Annotated[
    str | None,
    typer.Option(help="The drafter pipeline/adaptive names (llama-cpp, transformers or ngram; default llama-cpp)."),
]
Concurrency = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated client counts N, e.g. 1,4,16,32 (default: the protocol's list 1,4,16,32; 64 for ceiling)."
    ),
]
RequestsPerClient = Annotated[
    int | None, typer.Option(help="Requests per client in each cell (default 2: N x 2 requests per cell).")
]
Methods = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated methods of pipeline/adaptive, pipeline/K=<n> (n in 0..16: the pipeline at a fixed K, "
        "K=0 plain decode), transformers-serve (default pipeline/adaptive, pipeline/K=0, transformers-serve; for "
        "ceiling pipeline/K=0, pipeline/K=4, transformers-serve, where pipeline/adaptive self-drafts as K=4 does)."
    ),
]
Api = Annotated[
    str | None,
    typer.Option(
        help="The API the pipeline methods are driven through: grpc (Generate, default) or openai (the "
        "coordinator's OpenAI-compatible HTTP API, the same client code as transformers serve)."
    ),
]
LoadGenerator = Annotated[
    str | None,
    typer.Option(
        help="After the cells, also load every method's OpenAI-compatible endpoint (the coordinator's HTTP API, "
        "transformers serve's) with this third-party load generator at each N, the cells' prompts, request count "
        "and max tokens: guidellm. Its figures go into the reports."
    ),
]
Arrivals = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated arrival patterns, each with its own slice of the prompts: closed (N closed-loop "
        "clients), burst (N requests at once), poisson (N x --requests-per-client requests at a seeded Poisson "
        "rate of N x --request-rate). Default closed,burst,poisson (closed for ceiling)."
    ),
]
RequestRate = Annotated[
    float | None,
    typer.Option(
        help="With --arrivals poisson: requests/s per client (a cell of N arrives at N x this). Default: 1 / "
        "the mean latency of pipeline/K=0's requests in the closed loop at N=1 of the same run."
    ),
]
SloTtftMs = Annotated[
    float | None,
    typer.Option(
        help="Goodput's time-to-first-token objective, ms (default 2000): goodput counts the requests meeting it "
        "and --slo-tpot-ms, as vllm bench serve --goodput ttft:MS tpot:MS."
    ),
]
SloTpotMs = Annotated[float | None, typer.Option(help="Goodput's time-per-output-token objective, ms (default 200).")]
Repeat = Annotated[
    int,
    typer.Option(
        help="Runs of every cell per method, the methods interleaved (A B C, A B C, ...) after the warm-ups; the "
        "reports give each figure's median over the runs, tokens/s and its ratios with their range (min-max), "
        "each ratio taken within a run (default 1). Compare methods on the medians of 3 or more: one run of a "
        "cell moves by up to 15% between runs of the same code."
    ),
]
NetworkRttMs = Annotated[
    str | None,
    typer.Option(
        help="A network between the services. Comma-separated round-trip times in ms, e.g. 0,5,20: the "
        "coordinator reaches the draft and verify services through delaying TCP proxies, and every pipeline "
        "method runs under each RTT (named <method>@rtt<RTT>ms-<topology>) on the same services; with it "
        "batch1 also runs pipeline/K=0 (plain decode through the services) under each. 0: the proxies "
        "without delay."
    ),
]
NetworkJitterMs = Annotated[
    float | None,
    typer.Option(
        help="With --network-rtt-ms: each direction's delay drawn uniformly from RTT/2 +- this/2 ms (bytes never "
        "reordered; default 0, at most the smallest RTT above 0)."
    ),
]
NetworkTopology = Annotated[
    str | None,
    typer.Option(
        help="With --network-rtt-ms: comma-separated topologies, each RTT above 0 run in each: apart (the RTT on "
        "the coordinator's links to the draft and to the verify service; default), beside-verify (the draft "
        "link only: the coordinator beside the verify service), beside-draft (the verify link only)."
    ),
]
Conversation = Annotated[
    str,
    typer.Option(
        help="multi-turn (each question's second turn, after the method's own answer to the first and a "
        "follow-up from benchmarks/conversation/follow_ups.json) or shared-system-prompt (every question after "
        "benchmarks/conversation/system_prompt.txt)."
    ),
]

# ---- the subcommands: each names its options and hands them on as a dict (its locals()) ----


@bench_app.command("batch1")
def batch1(
    questions: Questions = SPEC_BENCH,
    categories: Categories = None,
    limit: Limit = 10,
    max_new_tokens: MaxNewTokens = 128,
    seed: Seed = 0,
    target: Target = "smollm2",
    draft_model: DraftModel = "smollm2",
    dtype: Dtype = "auto",
    out: Out = Path("bench-out"),
    pipeline: Pipeline = None,
    hf_k: HfK = None,
    placement: Placements = None,
    network_rtt_ms: NetworkRttMs = None,
    network_jitter_ms: NetworkJitterMs = None,
    network_topology: NetworkTopology = None,
) -> None:
    """Batch 1: plain decoding, transformers' prompt lookup and assisted generation, and the pipeline.

    The same Spec-Bench prompts (greedy, batch size 1) through every method; writes report.json,
    report.md and speedup.png. hf-assisted runs when a pipeline uses the transformers drafter (its
    model is the assistant)."""
    _bench_batch1(locals())


@bench_app.command("concurrency")
def concurrency(
    questions: Questions = SPEC_BENCH,
    categories: Categories = None,
    limit: Limit = 10,
    max_new_tokens: MaxNewTokens = 128,
    seed: Seed = 0,
    target: Target = "smollm2",
    draft_model: DraftModel = "smollm2",
    dtype: Dtype = "auto",
    out: Out = Path("bench-out"),
    concurrency: Concurrency = None,
    requests_per_client: RequestsPerClient = None,
    methods: Methods = None,
    drafter: Drafter = None,
    api: Api = None,
    load_generator: LoadGenerator = None,
    arrivals: Arrivals = None,
    request_rate: RequestRate = None,
    slo_ttft_ms: SloTtftMs = None,
    slo_tpot_ms: SloTpotMs = None,
    repeat: Repeat = 1,
    network_rtt_ms: NetworkRttMs = None,
    network_jitter_ms: NetworkJitterMs = None,
    network_topology: NetworkTopology = None,
) -> None:
    """Under load: every method at each client count N and arrival pattern, on the same prompts.

    For each arrival pattern (--arrivals: N closed-loop clients sending --requests-per-client
    prompts each, a burst of N, Poisson arrivals) and each N, the same prompts at the same times
    (greedy, --max-new-tokens) go to every method: the pipeline with adaptive K, the pipeline at
    K=0 (plain decode through the same batched services), and transformers serve
    --continuous-batching on the same target through its OpenAI-compatible API. Reports total
    output tokens/s, rounds/s, TTFT and TPOT p50/p99, batch size, acceptance, K chosen, CPU ms per
    token per process and greedy identity against pipeline/K=0 at N=1 per pattern, method and N,
    in report-concurrency.json, report-concurrency.md and concurrency.png."""
    _bench_load(locals(), ceiling=False)


@bench_app.command("ceiling")
def ceiling(
    questions: Questions = SPEC_BENCH,
    categories: Categories = None,
    limit: Limit = 10,
    max_new_tokens: MaxNewTokens = 128,
    seed: Seed = 0,
    dtype: Dtype = "auto",
    out: Out = Path("bench-out"),
    concurrency: Concurrency = None,
    requests_per_client: RequestsPerClient = None,
    methods: Methods = None,
    api: Api = None,
    load_generator: LoadGenerator = None,
    arrivals: Arrivals = None,
    request_rate: RequestRate = None,
    slo_ttft_ms: SloTtftMs = None,
    slo_tpot_ms: SloTpotMs = None,
    repeat: Repeat = 1,
) -> None:
    """The serving path's ceiling: the load benchmark on a near-free model the bench writes itself.

    A random 2-layer Llama (hidden 64, SmolLM2's tokenizer) as target and draft model:
    pipeline/K=0, pipeline/K=4 self-drafted by the transformers drafter on the same folder, and
    transformers serve; reports tokens/s, rounds/s and CPU ms per token per process, in the
    concurrency mode's reports. Default --concurrency 64."""
    _bench_load(locals(), ceiling=True)


@bench_app.command("structured")
def structured(
    questions: StructuredQuestions = STRUCTURED_PROMPTS,
    categories: Categories = None,
    limit: Limit = 10,
    max_new_tokens: MaxNewTokens = 128,
    seed: Seed = 0,
    target: Target = "smollm2",
    draft_model: DraftModel = "smollm2",
    dtype: Dtype = "auto",
    out: Out = Path("bench-out"),
    drafter: Drafter = None,
) -> None:
    """Structured output: JSON-schema prompts through constrained decoding and the pipeline, batch 1.

    The prompts of --questions through plain constrained decoding in process, the pipeline
    (adaptive K) with grammar-aware drafting, the same without it (--no-grammar-aware-drafting) and
    the same prompts unconstrained; reports schema-valid rate, identity, speedup, acceptance and
    free (forced) proposals in report-structured.json, report-structured.md and structured.png
    (see specdec_app.bench.structured)."""
    _bench_structured(locals())


@bench_app.command("conversation")
def conversation(
    conversation: Conversation,
    questions: Questions = SPEC_BENCH,
    categories: Categories = None,
    limit: Limit = 10,
    max_new_tokens: MaxNewTokens = 128,
    seed: Seed = 0,
    target: Target = "smollm2",
    draft_model: DraftModel = "smollm2",
    dtype: Dtype = "auto",
    out: Out = Path("bench-out"),
    drafter: Drafter = None,
    placement: Placements = None,
) -> None:
    """Prefix reuse: prefix caching in the time to first token, multi-turn or shared system prompt.

    Methods plain, the pipeline (adaptive K, --drafter) with prefix caching and @no-prefix-cache
    without it, on each --placement; reports TTFT, cached prompt tokens and the TTFT targets in
    report-<mode>.json, report-<mode>.md and <mode>.png (see specdec_app.bench.conversation)."""
    _bench_conversation(locals())


@bench_app.command("replicas")
def replicas(questions: Questions = SPEC_BENCH, out: Out = Path("bench-out")) -> None:
    """Replicas: every service a process on a loopback address of its own, against the mode's targets.

    Four scenarios (sessions spread over 3 verify and 2 draft replicas, prefix affinity, a slowed
    replica, a killed draft replica), in report-replicas.json and report-replicas.md; the
    scenarios fix everything but the prompts and the output folder (see
    specdec_app.bench.replicas)."""
    _bench_replicas(locals())


# ---- running a mode ----

INPUT_FIELDS = ("questions", "out", "limit", "max_new_tokens", "seed", "target", "draft_model", "dtype")


def _inputs(options: dict[str, Any]) -> dict[str, Any]:
    """The :class:`specdec_app.bench.run.BenchInputs` fields among a subcommand's ``options`` (its
    parameters are named as the fields; a field it lacks keeps the dataclass's default), the
    command line and the categories as a list."""
    inputs = {name: options[name] for name in INPUT_FIELDS if name in options}
    categories = options.get("categories")
    return inputs | {
        "command": shlex.join(["specdec", *sys.argv[1:]]),
        "categories": categories.split(",") if categories else None,
    }


def _network(options: dict[str, Any]) -> dict[str, Any]:
    """The :class:`specdec_app.bench.network.NetworkOptions` fields of a subcommand's
    ``--network-rtt-ms``, ``--network-jitter-ms`` and ``--network-topology`` (none given, or not
    options of the mode: no network). Raises ValueError naming the option to fix, also for the
    jitter or topology without the RTTs."""
    from specdec_app.bench.network import NetworkOptions, parse_rtts, parse_topologies

    rtt, jitter, topology = (options.get(f"network_{name}") for name in ("rtt_ms", "jitter_ms", "topology"))
    if rtt is None:
        if jitter is not None or topology is not None:
            raise ValueError("--network-jitter-ms and --network-topology need --network-rtt-ms")
        return {}
    network = NetworkOptions(network_rtts_ms=parse_rtts(rtt))
    if jitter is not None:
        network.network_jitter_ms = jitter
    if topology is not None:
        network.network_topologies = parse_topologies(topology)
    network.network()  # a jitter the RTTs allow (ValueError)
    return vars(network)


def _run_mode(run: Callable[[], T]) -> T:
    """What ``run()`` returns (the mode's report); a failed pipeline request, a bad option or a service that
    did not start is printed as an error and exits 1. SIGTERM stops the run as Ctrl-C does
    (SystemExit raised where it runs), so that the services, proxies and transformers serve it
    started are stopped by their ``finally`` blocks rather than left behind, in every mode."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run()
    except grpc.RpcError as err:
        stderr.print(f"[red]error: a pipeline request failed: {err.code().name}: {err.details()}[/red]")
        raise typer.Exit(1) from None
    except (ValueError, RuntimeError) as err:
        stderr.print(f"[red]error: {err}[/red]")
        raise typer.Exit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _print_mismatches(report: dict, reference: str) -> None:
    """Every output of the report that differs from ``reference``'s (the mode's plain decoding)."""
    for m in report["mismatches"]:
        phase = f" ({m['phase']} requests)" if "phase" in m else ""
        stderr.print(
            f"[red]{m['method']} differs from {reference} on question {m['question_id']}{phase} at token "
            f"{m['first_mismatch']}[/red]"
        )


def _bench_batch1(options: dict[str, Any]) -> None:
    """``specdec bench batch1``: see :mod:`specdec_app.bench.run`."""
    from specdec_app.bench.report import network_table, overall_table, speedup_table
    from specdec_app.bench.run import REPORT_FILES, BenchConfig, run_bench

    given = {"pipelines": options["pipeline"], "hf_k": options["hf_k"], "placements": options["placement"]}

    def run() -> tuple[dict, BenchConfig]:
        config = BenchConfig(
            **_inputs(options),
            **{name: value for name, value in given.items() if value},  # the rest: defaults
            **_network(options),
        )
        return run_bench(config, stderr), config

    report, config = _run_mode(run)
    print("\n".join([*speedup_table(report), "", *overall_table(report)]))
    if report.get("network"):
        print("\n" + "\n".join(network_table(report)))
    _print_mismatches(report, "plain")
    stderr.print(f"reports written to {config.out}/: {', '.join(REPORT_FILES)}")


def _bench_structured(options: dict[str, Any]) -> None:
    """``specdec bench structured``: see :mod:`specdec_app.bench.structured`."""
    from specdec_app.bench.structured import REPORT_FILES, StructuredConfig, run_structured, structured_table, targets

    config = StructuredConfig(**_inputs(options), drafter=options["drafter"] or "llama-cpp")
    report = _run_mode(lambda: run_structured(config, stderr))
    print("\n".join([*structured_table(report), "", *targets(report)]))
    _print_mismatches(report, "plain constrained decoding")
    stderr.print(f"reports written to {config.out}/: {', '.join(REPORT_FILES)}")


def _bench_conversation(options: dict[str, Any]) -> None:
    """``specdec bench conversation``: see :mod:`specdec_app.bench.conversation`."""
    from specdec_app.bench.conversation import (
        ConversationConfig,
        report_files,
        requests_table,
        run_conversation,
        targets_table,
    )
    from specdec_app.bench.run import DRAFTERS

    drafter = options["drafter"] or "llama-cpp"
    config = ConversationConfig(
        **_inputs(options),
        conversation=options["conversation"],
        drafter=drafter,
        placements=options["placement"] or ["shared"],
    )

    def run() -> dict:
        if drafter not in DRAFTERS:
            raise ValueError(f"--drafter {drafter!r}: use one of {', '.join(DRAFTERS)}")
        return run_conversation(config, stderr)

    report = _run_mode(run)
    print("\n".join([*requests_table(report, "summary"), "", *targets_table(report)]))
    _print_mismatches(report, "plain")
    stderr.print(f"reports written to {config.out}/: {', '.join(report_files(config.conversation))}")


def _bench_replicas(options: dict[str, Any]) -> None:
    """``specdec bench replicas``: see :mod:`specdec_app.bench.replicas`."""
    from specdec_app.bench.replicas import REPORT_FILES, ReplicasConfig, run_replicas, targets_summary

    inputs = _inputs(options)
    config = ReplicasConfig(inputs["questions"], inputs["out"], inputs["command"])
    report = _run_mode(lambda: run_replicas(config, stderr))
    print("\n".join(targets_summary(report)))
    stderr.print(f"reports written to {inputs['out']}/: {', '.join(REPORT_FILES)}")


def _bench_load(options: dict[str, Any], ceiling: bool) -> None:
    """``specdec bench concurrency`` and ``specdec bench ceiling``: see
    :mod:`specdec_app.bench.concurrency` and :mod:`specdec_app.bench.ceiling`. ``options``: the
    subcommand's, as given (None: not given)."""
    from specdec_app.bench import ceiling as ceiling_mode
    from specdec_app.bench.concurrency import REPORT_FILES, run_concurrency

    def run() -> tuple[dict, "ConcurrencyConfig"]:
        config = _load_config(options, ceiling)
        if ceiling:
            config = ceiling_mode.configure(config, stderr)
        report = run_concurrency(config, stderr)
        if ceiling:
            ceiling_mode.add_targets(report, config.out)
        return report, config

    report, config = _run_mode(run)
    _print_load_report(report, config.arrivals, ceiling)
    stderr.print(f"reports written to {config.out}/: {', '.join(REPORT_FILES)}")


def _load_config(options: dict[str, Any], ceiling: bool) -> "ConcurrencyConfig":
    """The :class:`specdec_app.bench.concurrency.ConcurrencyConfig` of a load mode's options, the
    mode's defaults for those not given. Raises ValueError naming the option to fix."""
    from specdec_app.bench import ceiling as ceiling_mode
    from specdec_app.bench.arrivals import ARRIVALS, CLOSED, parse_arrivals
    from specdec_app.bench.concurrency import DEFAULT_CONCURRENCY, ConcurrencyConfig, parse_concurrency
    from specdec_app.bench.load_methods import METHODS, parse_methods

    network = _network(options)  # its errors first, before the other options'
    default_n, default_methods, default_arrivals = (
        (ceiling_mode.DEFAULT_CONCURRENCY, ceiling_mode.METHODS, (CLOSED,))
        if ceiling
        else (DEFAULT_CONCURRENCY, METHODS, ARRIVALS)
    )
    n, methods, arrivals = options["concurrency"], options["methods"], options["arrivals"]
    config = ConcurrencyConfig(
        **_inputs(options),
        concurrency=parse_concurrency(n) if n else list(default_n),
        requests_per_client=2 if options["requests_per_client"] is None else options["requests_per_client"],
        methods=parse_methods(methods) if methods else list(default_methods),
        drafter=options.get("drafter") or "llama-cpp",
        api=options["api"] or "grpc",
        load_generator=options["load_generator"] or "",
        arrivals=parse_arrivals(arrivals) if arrivals else list(default_arrivals),
        request_rate=options["request_rate"],
        repeat=options["repeat"],
        **{name: options[name] for name in ("slo_ttft_ms", "slo_tpot_ms") if options[name] is not None},
        **network,
    )
    if config.drafter not in ("llama-cpp", "transformers", "ngram"):
        raise ValueError(f"--drafter {config.drafter!r}: use llama-cpp, transformers or ngram")
    return config


def _print_load_report(report: dict, patterns: list[str], ceiling: bool) -> None:
    """A load mode's tables, per arrival pattern then overall, and its mismatches and errors."""
    from specdec_app.bench import ceiling as ceiling_mode
    from specdec_app.bench.report import (
        comparison_tables,
        concurrency_network_table,
        concurrency_table,
        cpu_table,
        identity_table,
    )

    for arrivals in patterns:
        print(
            "\n".join(
                [
                    f"arrivals: {arrivals}",
                    *comparison_tables(report, arrivals),
                    *concurrency_table(report, arrivals),
                    "",
                ]
            )
        )
    print("\n".join([*cpu_table(report), "", *identity_table(report)]))
    if report.get("network"):
        print("\n" + "\n".join(concurrency_network_table(report)))
    if ceiling:
        print("\n" + "\n".join(ceiling_mode.markdown(report["ceiling_targets"])))
    if report.get("load_generator"):
        from specdec_app.bench.load_generator import markdown

        print("\n" + "\n".join(line for line in markdown(report["load_generator"]) if line.startswith("|")))
    for m in report["mismatches"]:
        stderr.print(
            f"[yellow]{m['method']} at N={m['concurrency']} ({m['arrivals']}) differs from the reference on question "
            f"{m['question_id']} at token {m['first_mismatch']} (margin {m.get('margin')})[/yellow]"
        )
    for cell in report["cells"]:
        for error in cell["errors"]:
            stderr.print(f"[red]{cell['method']} at N={cell['concurrency']} ({cell['arrivals']}): {error}[/red]")

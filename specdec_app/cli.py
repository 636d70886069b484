"""The ``specdec`` command line: run the services, stream completions, run the demo and the benchmark."""

import json
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from specdec.settings import ServiceSettings, parse_settings
from specdec_app.launcher import configured_api_key

app = typer.Typer(help="Speculative decoding as a distributed gRPC service.", no_args_is_help=True)
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
stderr = Console(stderr=True)

DEMO_PROMPT = "Summarize in two sentences why the sky is blue, then repeat your summary word for word."
# `serve <service>` leaves every argument, --help included, to pydantic-settings.
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _run_service(ctx: typer.Context, service: str) -> None:
    from specdec.observability.telemetry import configure_logging, configure_tracing

    main: Callable[[Any], None]  # each service's main takes its own settings class
    settings_cls: type[ServiceSettings]
    if service == "verify":
        from verify_service.service import main
        from verify_service.settings import VerifySettings as settings_cls
    elif service == "draft":
        from draft_service.service import main
        from draft_service.settings import DraftSettings as settings_cls
    else:
        from coordinator.service import main
        from coordinator.settings import CoordinatorSettings as settings_cls
    try:
        settings = parse_settings(settings_cls, ctx.args, prog=f"specdec serve {service}")
    except ValidationError as err:  # bad settings: what to change, without a traceback
        for error in err.errors():
            where = ".".join(map(str, error["loc"]))
            message = error["msg"].removeprefix("Value error, ")
            stderr.print(
                f"error: specdec serve {service}: {where + ': ' if where else ''}{message}",
                style="red",
                markup=False,
                soft_wrap=True,
            )
        raise typer.Exit(2) from None
    configure_tracing(service)
    configure_logging(service, settings.log_level, settings.log_format)
    main(settings)


@serve_app.command(context_settings=_PASS_THROUGH)
def verify(ctx: typer.Context) -> None:
    """The verify service (target model). `specdec serve verify --help` lists every setting."""
    _run_service(ctx, "verify")


@serve_app.command(context_settings=_PASS_THROUGH)
def draft(ctx: typer.Context) -> None:
    """The draft service (drafters). `specdec serve draft --help` lists every setting."""
    _run_service(ctx, "draft")


@serve_app.command(context_settings=_PASS_THROUGH)
def coordinator(ctx: typer.Context) -> None:
    """The coordinator (public Generate API). `specdec serve coordinator --help` lists every setting."""
    _run_service(ctx, "coordinator")


def _insecure_note(cluster, service: str) -> str:
    """What ``service``, started with --insecure, lets in (for the banner of `specdec up` and `demo`)."""
    if service == "coordinator":
        return (
            f"the coordinator at {cluster.address(service)} serves callers without an API key (SPECDEC_API_KEYS: keys)"
        )
    return f"the {service} service at {cluster.address(service)} takes calls without a client certificate (--tls: mTLS)"


def _cluster(
    coordinator_port: int,
    draft_port: int,
    verify_port: int,
    host: str,
    log_dir=None,
    metrics_ports=None,
    http_port: int = 0,
    tls=None,
):
    from specdec_app.launcher import LocalCluster

    cluster = LocalCluster(
        coordinator_port,
        draft_port,
        verify_port,
        host,
        log_dir=log_dir,
        metrics_ports=metrics_ports or {},
        http_port=http_port,
        tls=tls,
    )
    stderr.print("starting verify, draft and coordinator services (loading models)...")
    cluster.start_all()
    for service in ("coordinator", "draft", "verify"):
        metrics = cluster.metrics_url(service)
        stderr.print(
            f"  {service:<12} {cluster.address(service)}  pid {cluster.processes[service].pid}"
            + (f"  metrics {metrics}" if metrics else ""),
            soft_wrap=True,
        )
    if cluster.http_url:
        stderr.print(
            f"  {'HTTP API':<12} {cluster.http_url}  (OpenAI-compatible: /v1/chat/completions, /v1/completions)",
            soft_wrap=True,
        )
    if tls:
        stderr.print(
            f"  TLS: public APIs over TLS, mutual TLS inside; CA {tls.ca_file}\n"
            f"  specdec generate --coordinator {cluster.address('coordinator')} --tls-ca {tls.ca_file} 'Hi'",
            soft_wrap=True,
        )
    if "coordinator" not in cluster.insecure:
        stderr.print(
            "  API keys are set (SPECDEC_API_KEYS or the coordinator's key settings): clients send "
            "`Authorization: Bearer <key>` (gRPC: `authorization` metadata; specdec generate --api-key)",
            soft_wrap=True,
        )
    for service in cluster.insecure:
        stderr.print(f"  [yellow]insecure (--insecure):[/yellow] {_insecure_note(cluster, service)}", soft_wrap=True)
    return cluster


@app.command()
def up(
    coordinator_port: Annotated[int, typer.Option(help="Coordinator gRPC port.")] = 50051,
    http_port: Annotated[int, typer.Option(help="Coordinator OpenAI-compatible HTTP API port; 0 = off.")] = 8000,
    draft_port: Annotated[int, typer.Option(help="Draft service gRPC port.")] = 50052,
    verify_port: Annotated[int, typer.Option(help="Verify service gRPC port.")] = 50053,
    host: Annotated[str, typer.Option(help="Address the services listen on.")] = "127.0.0.1",
    coordinator_metrics_port: Annotated[
        int, typer.Option(help="Coordinator Prometheus /metrics port; 0 = off.")
    ] = 9091,
    draft_metrics_port: Annotated[int, typer.Option(help="Draft service Prometheus /metrics port; 0 = off.")] = 9092,
    verify_metrics_port: Annotated[int, typer.Option(help="Verify service Prometheus /metrics port; 0 = off.")] = 9093,
    tls: Annotated[
        bool,
        typer.Option(
            help="Make a local CA and certificates, run the public gRPC and HTTP APIs over TLS and the "
            "coordinator's links to the draft and verify services over mutual TLS, and print the CA "
            "file's path."
        ),
    ] = False,
    tls_dir: Annotated[
        Path | None,
        typer.Option(
            help="With --tls: the directory the CA and certificates are written to (ca.pem, server.pem, "
            "server-key.pem, client.pem, client-key.pem; default: a new temporary directory)."
        ),
    ] = None,
    restart_backoff_s: Annotated[
        float,
        typer.Option(
            help="Seconds before a service that exited is started again; doubled for each restart in a row, "
            "up to 30 s.",
            min=0.0,
        ),
    ] = 1.0,
    max_restarts_per_minute: Annotated[
        int,
        typer.Option(
            help="Restarts of one service in any 60 s after which it is left down (the others keep serving).", min=0
        ),
    ] = 5,
) -> None:
    """Start the three services as separate processes with the default models (each also reads
    its SPECDEC_* and OTEL_* variables), wait until all are healthy, print their gRPC, HTTP and
    metrics addresses, and serve until interrupted. A service that exits is restarted (with
    exponential backoff, at most --max-restarts-per-minute times a minute); the others keep
    serving meanwhile. Only Ctrl-C or SIGTERM stops them all."""
    import tempfile

    from specdec.observability.telemetry import configure_logging
    from specdec_app.launcher import RestartPolicy, Supervisor
    from specdec_app.local_ca import write_local_certificates

    if tls_dir is not None and not tls:
        stderr.print("[red]error: --tls-dir applies with --tls[/red]")
        raise typer.Exit(1)
    certificates = None
    if tls:
        certificates = write_local_certificates(tls_dir or Path(tempfile.mkdtemp(prefix="specdec-tls-")), [host])
    metrics_ports = {
        "coordinator": coordinator_metrics_port,
        "draft": draft_metrics_port,
        "verify": verify_metrics_port,
    }
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the children too, as on Ctrl-C
    cluster = _cluster(
        coordinator_port,
        draft_port,
        verify_port,
        host,
        metrics_ports=metrics_ports,
        http_port=http_port,
        tls=certificates,
    )
    stderr.print("all services SERVING; a service that exits is restarted; Ctrl-C (or SIGTERM) stops them")
    configure_logging("launcher", "INFO", "text")
    supervisor = Supervisor(cluster, RestartPolicy(backoff_s=restart_backoff_s, max_per_minute=max_restarts_per_minute))
    try:
        supervisor.run()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    restarts = {name: count for name, count in supervisor.restarts.items() if count}
    if restarts:
        stderr.print(f"restarts: {restarts}")


def _request(prompt: str | None, **fields):
    from specdec.v1 import coordinator_pb2

    request = coordinator_pb2.GenerateRequest()
    if prompt is not None:
        request.text = prompt
    for name, value in fields.items():
        if value is not None:
            if name == "stop":
                request.stop.extend(value)
            else:
                setattr(request, name, value)
    return request


def _print_metrics(completion) -> None:
    m = completion.metrics
    table = Table(
        title=f"finish_reason={completion.finish_reason}  drafter={m.drafter or '-'}  K={m.num_speculative_tokens}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("generated tokens", f"{m.num_generated_tokens}"),
        ("tokens/s", f"{m.tokens_per_second:.1f}"),
        ("draft_acceptance_rate", f"{m.draft_acceptance_rate:.3f}"),
        ("mean_acceptance_length", f"{m.mean_acceptance_length:.2f}"),
        ("num_spec_steps / target forwards", f"{m.num_spec_steps} / {m.num_target_forwards}"),
        ("acceptance_histogram", " ".join(map(str, m.acceptance_histogram))),
        ("time to first token (ms)", f"{m.time_to_first_token_ms:.0f}"),
        (
            "draft / verify / coordination (ms)",
            f"{m.draft_time_ms:.0f} / {m.verify_time_ms:.0f} / {m.coordination_time_ms:.0f}",
        ),
        ("rounds per K (K = 0: plain decode)", " ".join(map(str, m.rounds_per_k))),
        *(
            (
                f"{name}: rounds, accepted / drafted",
                f"{u.num_rounds}, {u.num_accepted_draft_tokens} / {u.num_draft_tokens}",
            )
            for name, u in sorted(m.drafter_usage.items())
        ),
        *(
            (label, str(value))
            for label, value in (
                ("resumed tokens", m.num_resumed_tokens),
                ("draft service failures", m.num_draft_failures),
                ("verify session rebuilds", m.num_verify_rebuilds),
            )
            if value
        ),
    ]
    for row in rows:
        table.add_row(*row)
    stderr.print(table)


def _print_logprobs(completion) -> None:
    table = Table(title="log-probabilities (raw, of the target)")
    table.add_column("token id", justify="right")
    table.add_column("logprob", justify="right")
    table.add_column("top alternatives (id: logprob)")
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
        top = zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True)
        table.add_row(str(token_id), f"{logprobs.logprob:.4f}", "  ".join(f"{i}: {lp:.4f}" for i, lp in top))
    stderr.print(table)


def _stream_to_stdout(
    address: str,
    request,
    as_json: bool,
    resumable: bool = False,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Streams the text to stdout, then the metrics table (or, ``as_json``, one JSON line), and
    the log-probabilities when asked for; with n > 1 each choice's text once it is complete, under
    a ``choice i`` line on stderr, and the JSON line ``{"choices": [...]}``. ``resumable``: also
    tells on stderr the request id (each choice's) to resume with; ``credentials``: TLS."""
    from coordinator.api.client import Completion, stream

    several = request.n > 1
    completions: dict[int, Completion] = {}
    try:
        for response in stream(address, request, api_key=api_key, credentials=credentials):
            if response.request_id and resumable and not as_json:
                stderr.print(f"request_id {response.request_id} (resume with --request-id and --resume-from)")
            completions.setdefault(response.index, Completion()).add(response)
            if not several:
                sys.stdout.write(response.text)
                sys.stdout.flush()
    except grpc.RpcError as err:
        sys.stdout.write("\n")
        stderr.print(f"[red]error: {err.code().name}: {err.details()}[/red]")
        raise typer.Exit(1) from None
    choices = [completions[index] for index in sorted(completions)]
    if several:
        for index, completion in enumerate(choices):
            stderr.print(f"choice {index}")
            sys.stdout.write(completion.text + "\n")
            sys.stdout.flush()
    else:
        sys.stdout.write("\n")
    if as_json:
        print(json.dumps({"choices": [c.to_json() for c in choices]} if several else choices[0].to_json()))
        return
    for completion in choices:
        _print_metrics(completion)
        if completion.logprobs:
            _print_logprobs(completion)


@app.command()
def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="The user message (or raw text with --raw); none when resuming.")
    ] = None,
    coordinator: Annotated[str, typer.Option(help="Coordinator host:port.")] = "127.0.0.1:50051",
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to generate at most (default 128).")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (default).")] = None,
    top_k: Annotated[int | None, typer.Option(help="0 = off (default).")] = None,
    top_p: Annotated[float | None, typer.Option(help="In (0, 1]; 1 = off (default).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed; a seed reproduces a sampled completion.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    num_speculative_tokens: Annotated[
        int | None, typer.Option("--num-speculative-tokens", "-k", help="K; 0 = plain decode.")
    ] = None,
    drafter: Annotated[str | None, typer.Option(help="llama-cpp, transformers, ngram or suffix.")] = None,
    raw: Annotated[bool, typer.Option(help="Send the prompt verbatim, without the chat template.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="After the stream, print one JSON object on the last line.")
    ] = False,
    request_id: Annotated[
        str | None, typer.Option(help="Name the request (default: the coordinator assigns one).")
    ] = None,
    resume_from: Annotated[
        int | None, typer.Option(help="Resume --request-id after this many received tokens.")
    ] = None,
    n: Annotated[
        int | None,
        typer.Option("--n", help="Choices: independent completions, choice i seeded with --seed + i (default 1)."),
    ] = None,
    logprobs: Annotated[
        bool, typer.Option(help="Report the target's log-probability of every generated token (raw).")
    ] = False,
    top_logprobs: Annotated[
        int | None, typer.Option(help="With --logprobs: also the N most likely tokens at each position.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="SPECDEC_API_KEY", help="API key, when the coordinator requires one (--api-key there)."),
    ] = None,
    tls: Annotated[
        bool,
        typer.Option(
            help="Connect over TLS, checking the coordinator's certificate against the system's roots "
            "(implied by --tls-ca)."
        ),
    ] = False,
    tls_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="SPECDEC_TLS_CA",
            help="PEM CA bundle the coordinator's certificate is checked against (specdec up --tls prints "
            "its CA file); connects over TLS.",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="SPECDEC_TLS_CERT",
            help="PEM client certificate, when the coordinator asks for one (its --tls-client-ca-file), "
            "with --tls-key.",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(envvar="SPECDEC_TLS_KEY", help="PEM private key of --tls-cert.")
    ] = None,
) -> None:
    """Stream a completion from a coordinator; the text goes to stdout, metrics to stderr. Traced
    (service name specdec-cli) when OTEL_TRACES_EXPORTER names an exporter. Resume a request cut
    off after N tokens with `--request-id ID --resume-from N` (no prompt)."""
    from specdec.observability.telemetry import configure_tracing
    from specdec.rpc.tls import TLSFileError, channel_credentials

    if prompt is None and resume_from is None:
        stderr.print("[red]error: give a PROMPT, or --request-id and --resume-from to resume a request[/red]")
        raise typer.Exit(1)
    credentials = None
    if tls or tls_ca or tls_cert or tls_key:
        ca_file, cert_file, key_file = (str(path or "") for path in (tls_ca, tls_cert, tls_key))
        try:
            credentials = channel_credentials(ca_file, cert_file, key_file, ("--tls-ca", "--tls-cert", "--tls-key"))
        except TLSFileError as err:
            stderr.print(f"[red]error: {err}[/red]")
            raise typer.Exit(1) from None
    configure_tracing("cli")
    request = _request(
        prompt,
        raw_prompt=raw or None,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop,
        num_speculative_tokens=num_speculative_tokens,
        drafter=drafter,
        request_id=request_id,
        resume_from=resume_from,
        n=n,
        logprobs=logprobs or None,
        top_logprobs=top_logprobs,
    )
    _stream_to_stdout(coordinator, request, as_json, resumable=True, api_key=api_key, credentials=credentials)


@app.command()
def demo(
    prompt: Annotated[str, typer.Argument(help="The user message.")] = DEMO_PROMPT,
    num_speculative_tokens: Annotated[int, typer.Option("--num-speculative-tokens", "-k")] = 4,
    max_new_tokens: Annotated[int, typer.Option()] = 128,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="SPECDEC_API_KEY",
            help="API key to send (default: the first key the demo's coordinator is given by "
            "SPECDEC_API_KEYS, SPECDEC_COORDINATOR_API_KEYS or SPECDEC_COORDINATOR_API_KEY_FILE; none "
            "when it has none).",
        ),
    ] = None,
) -> None:
    """The main job: start the three services on free ports with the default models, stream one
    completion through them, print it with its acceptance metrics, stop the services. The
    coordinator reads its SPECDEC_COORDINATOR_* variables; with API keys set there, the demo sends
    one."""
    import tempfile
    from pathlib import Path

    from specdec_app.launcher import free_port

    try:
        api_key = api_key or configured_api_key()
    except ValueError as err:  # e.g. an unreadable key file: the coordinator would not start either
        stderr.print(f"[red]error: {err}[/red]")
        raise typer.Exit(1) from None
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-demo-"))
    cluster = _cluster(free_port(), free_port(), free_port(), "127.0.0.1", log_dir=log_dir, http_port=free_port())
    try:
        stderr.print(f"prompt: {prompt}\n")
        request = _request(prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens)
        _stream_to_stdout(cluster.address("coordinator"), request, as_json=False, api_key=api_key)
    finally:
        cluster.stop()


SPEC_BENCH = Path("../shared/benchmarks/spec_bench/question.jsonl")
STRUCTURED_PROMPTS = Path("benchmarks/structured/prompts.jsonl")  # specdec bench --structured's default


@app.command()
def bench(
    questions: Annotated[
        Path,
        typer.Option(
            help="Question file in the Spec-Bench JSONL schema (with --structured: id, category, prompt and schema "
            "per line; default benchmarks/structured/prompts.jsonl)."
        ),
    ] = SPEC_BENCH,
    categories: Annotated[
        str | None, typer.Option(help="Comma-separated categories (default: all in the file).")
    ] = None,
    limit: Annotated[int, typer.Option(help="Prompts per category (the first N of each).")] = 10,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per prompt, the same for every method.")] = 128,
    seed: Annotated[int, typer.Option(help="Seed sent with every request.")] = 0,
    pipeline: Annotated[
        list[str] | None,
        typer.Option(
            help="DRAFTER:K of a pipeline method, K in 1..16 or auto (adaptive; repeatable; default ngram:4 "
            "ngram:8 llama-cpp:4 llama-cpp:8 ngram:auto llama-cpp:auto)."
        ),
    ] = None,
    hf_k: Annotated[
        list[int] | None,
        typer.Option(help="K of transformers' prompt lookup and assisted generation (repeatable; default 4)."),
    ] = None,
    placement: Annotated[
        list[str] | None,
        typer.Option(
            help="shared (default): every process on every core; split: the draft service pinned to one CPU "
            "and the verify service to another (one thread each), emulating a draft on its own device; "
            "plain then also runs pinned to the verify service's CPU (plain/verify-cpu). Repeatable: "
            "each placement gets its own services and every pipeline runs on each in the same run "
            "(methods named <method>@<placement>). Batch-1 benchmark and --conversation only."
        ),
    ] = None,
    target: Annotated[
        str, typer.Option(help="Target model (verify service and the transformers methods).")
    ] = "smollm2",
    draft_model: Annotated[
        str, typer.Option(help="Model of the llama-cpp and transformers drafters (and of hf-assisted).")
    ] = "smollm2",
    dtype: Annotated[
        str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.")
    ] = "auto",
    out: Annotated[
        Path, typer.Option(help="Directory for report.json, report.md, speedup.png and service logs.")
    ] = Path("bench-out"),
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="Load mode: comma-separated client counts N, e.g. 1,4,16,32 (the protocol's list). N "
            "closed-loop clients per cell, each sending its next prompt when the previous one "
            "finishes; methods pipeline/adaptive, pipeline/K=0 and transformers-serve (transformers "
            "serve --continuous-batching). Writes report-concurrency.json, report-concurrency.md and "
            "concurrency.png instead of the batch-1 reports."
        ),
    ] = None,
    requests_per_client: Annotated[
        int | None,
        typer.Option(help="With --concurrency: requests per client in each cell (default 2: N x 2 requests per cell)."),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option(
            help="With --concurrency: comma-separated methods of pipeline/adaptive, pipeline/K=<n> (n in 0..16: "
            "the pipeline at a fixed K, K=0 plain decode), transformers-serve (default pipeline/adaptive, "
            "pipeline/K=0, transformers-serve; with --ceiling pipeline/K=0, pipeline/K=4, transformers-serve)."
        ),
    ] = None,
    drafter: Annotated[
        str | None,
        typer.Option(
            help="With --concurrency, --structured or --conversation: the drafter pipeline/adaptive names "
            "(llama-cpp, transformers or ngram; default llama-cpp)."
        ),
    ] = None,
    api: Annotated[
        str | None,
        typer.Option(
            help="With --concurrency: the API the pipeline methods are driven through: grpc (Generate, "
            "default) or openai (the coordinator's OpenAI-compatible HTTP API, the same client code as "
            "transformers serve)."
        ),
    ] = None,
    load_generator: Annotated[
        str | None,
        typer.Option(
            help="With --concurrency: after the cells, also load every method's OpenAI-compatible endpoint "
            "(the coordinator's HTTP API, transformers serve's) with this third-party load generator "
            "at each N, the cells' prompts, request count and max tokens: guidellm. Its figures go "
            "into the reports."
        ),
    ] = None,
    arrivals: Annotated[
        str | None,
        typer.Option(
            help="With --concurrency: comma-separated arrival patterns, each with its own slice of the prompts: "
            "closed (N closed-loop clients), burst (N requests at once), poisson (N x --requests-per-client "
            "requests at a seeded Poisson rate of N x --request-rate). Default closed,burst,poisson "
            "(closed with --ceiling)."
        ),
    ] = None,
    request_rate: Annotated[
        float | None,
        typer.Option(
            help="With --arrivals poisson: requests/s per client (a cell of N arrives at N x this). Default: 1 / "
            "the mean latency of pipeline/K=0's requests in the closed loop at N=1 of the same run."
        ),
    ] = None,
    slo_ttft_ms: Annotated[
        float | None,
        typer.Option(
            help="With --concurrency: goodput's time-to-first-token objective, ms (default 2000): goodput counts the "
            "requests meeting it and --slo-tpot-ms, as vllm bench serve --goodput ttft:MS tpot:MS."
        ),
    ] = None,
    slo_tpot_ms: Annotated[
        float | None,
        typer.Option(help="With --concurrency: goodput's time-per-output-token objective, ms (default 200)."),
    ] = None,
    network_rtt_ms: Annotated[
        str | None,
        typer.Option(
            help="Batch-1 benchmark and --concurrency: a network between the services. Comma-separated round-trip "
            "times in ms, e.g. 0,5,20: the coordinator reaches the draft and verify services through delaying TCP "
            "proxies, and every pipeline method runs under each RTT (named <method>@rtt<RTT>ms-<topology>) on the "
            "same services; with it the batch-1 benchmark also runs pipeline/K=0 (plain decode through the "
            "services) under each. 0: the proxies without delay."
        ),
    ] = None,
    network_jitter_ms: Annotated[
        float | None,
        typer.Option(
            help="With --network-rtt-ms: each direction's delay drawn uniformly from RTT/2 +- this/2 ms (bytes never "
            "reordered; default 0, at most the smallest RTT above 0)."
        ),
    ] = None,
    network_topology: Annotated[
        str | None,
        typer.Option(
            help="With --network-rtt-ms: comma-separated topologies, each RTT above 0 run in each: apart (the RTT on "
            "the coordinator's links to the draft and to the verify service; default), beside-verify (the draft "
            "link only: the coordinator beside the verify service), beside-draft (the verify link only)."
        ),
    ] = None,
    ceiling: Annotated[
        bool,
        typer.Option(
            "--ceiling",
            help="Load mode on a near-free model the bench writes itself (random 2-layer Llama, hidden 64, "
            "SmolLM2's tokenizer): pipeline/K=0, pipeline/K=4 self-drafted by the transformers drafter on the "
            "same folder, and transformers serve; reports tokens/s, rounds/s and CPU ms per token per process. "
            "Default --concurrency 64.",
        ),
    ] = False,
    conversation: Annotated[
        str | None,
        typer.Option(
            help="Prefix-reuse mode: multi-turn (each question's second turn, after the method's own answer to "
            "the first and a follow-up from benchmarks/conversation/follow_ups.json) or shared-system-prompt "
            "(every question after benchmarks/conversation/system_prompt.txt). Methods plain, the pipeline "
            "(adaptive K, --drafter) with prefix caching and @no-prefix-cache without it, on each --placement; "
            "reports TTFT, cached prompt tokens and the TTFT targets in report-<mode>.json, report-<mode>.md and "
            "<mode>.png.",
        ),
    ] = None,
    structured: Annotated[
        bool,
        typer.Option(
            "--structured",
            help="Structured-output mode: the JSON-schema prompts of --questions (default "
            "benchmarks/structured/prompts.jsonl) through plain constrained decoding in process, the pipeline "
            "(adaptive K) with grammar-aware drafting, the same without it (--no-grammar-aware-drafting) and the "
            "same prompts unconstrained; reports schema-valid rate, identity, speedup, acceptance and free "
            "(forced) proposals in report-structured.json, report-structured.md and structured.png.",
        ),
    ] = False,
    replicas: Annotated[
        bool,
        typer.Option(
            "--replicas",
            help="Replicas mode: every service a process on a loopback address of its own, four scenarios (sessions "
            "spread over 3 verify and 2 draft replicas, prefix affinity, a slowed replica, a killed draft replica) "
            "against issue 47's targets, in report-replicas.json and report-replicas.md; takes --questions and --out "
            "only.",
        ),
    ] = False,
) -> None:
    """Benchmark plain decoding, transformers' prompt lookup and assisted generation, and the
    pipeline on the same Spec-Bench prompts (greedy, batch size 1), and write the reports.
    hf-assisted runs when a pipeline uses the transformers drafter (its model is the assistant).

    With --concurrency 1,4,16,32: the load benchmark instead. For each arrival pattern (--arrivals:
    N closed-loop clients sending --requests-per-client prompts each, a burst of N, Poisson arrivals)
    and each N, the same prompts at the same times (greedy, --max-new-tokens) go to every method: the
    pipeline with adaptive K, the pipeline at K=0 (plain decode through the same batched services),
    and transformers serve --continuous-batching on the same target through its OpenAI-compatible
    API. Reports total output tokens/s, rounds/s, TTFT and TPOT p50/p99, batch size, acceptance, K
    chosen, CPU ms per token per process and greedy identity against pipeline/K=0 at N=1 per
    pattern, method and N. With --ceiling: the same on a near-free model the bench writes, with
    pipeline/K=0, pipeline/K=4 self-drafted and transformers serve. With --structured: structured
    output (JSON schemas) at batch 1, see specdec_app.bench.structured. With --conversation:
    prefix caching in the time to first token, see specdec_app.bench.conversation. With
    --replicas: the services as replicas, see specdec_app.bench.replicas."""
    inputs: dict[str, Any] = {  # the fields of specdec_app.bench.run.BenchInputs, which both modes take
        "questions": questions,
        "out": out,
        "command": shlex.join(["specdec", *sys.argv[1:]]),
        "categories": categories.split(",") if categories else None,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "target": target,
        "draft_model": draft_model,
        "dtype": dtype,
    }
    load = {
        "requests_per_client": requests_per_client,
        "methods": methods,
        "api": api,
        "load_generator": load_generator,
        "arrivals": arrivals,
        "request_rate": request_rate,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
    }
    network = {"rtt": network_rtt_ms, "jitter": network_jitter_ms, "topology": network_topology}
    if (network_jitter_ms is not None or network_topology is not None) and network_rtt_ms is None:
        stderr.print("[red]error: --network-jitter-ms and --network-topology need --network-rtt-ms[/red]")
        raise typer.Exit(1)
    if replicas:
        defaults = (10, 128, 0, "smollm2", "smollm2", "auto")
        prompt_and_model = (limit, max_new_tokens, seed, target, draft_model, dtype)
        others: tuple[Any, ...] = (pipeline, hf_k, placement, categories, concurrency, conversation, drafter)
        others += (structured, ceiling, network_rtt_ms)
        if prompt_and_model != defaults or any(others) or any(v is not None for v in load.values()):
            stderr.print("[red]error: --replicas takes --questions and --out only (its scenarios fix the rest)[/red]")
            raise typer.Exit(1)
        _bench_replicas(inputs)
        return
    if conversation is not None:
        if (
            pipeline
            or hf_k
            or structured
            or concurrency is not None
            or ceiling
            or network_rtt_ms is not None
            or any(v is not None for v in load.values())
        ):
            stderr.print(
                "[red]error: --conversation takes --drafter, --placement and the prompt and model options only[/red]"
            )
            raise typer.Exit(1)
        _bench_conversation(inputs, conversation, drafter or "llama-cpp", placement or ["shared"])
        return
    if structured:
        if (
            pipeline
            or hf_k
            or placement
            or concurrency is not None
            or ceiling
            or network_rtt_ms is not None
            or any(v is not None for v in load.values())
        ):
            stderr.print("[red]error: --structured takes --drafter and the prompt and model options only[/red]")
            raise typer.Exit(1)
        if questions == SPEC_BENCH:
            inputs["questions"] = STRUCTURED_PROMPTS
        _bench_structured(inputs, drafter or "llama-cpp")
        return
    if concurrency is not None or ceiling:
        if pipeline or hf_k or placement:
            stderr.print(
                "[red]error: --pipeline, --hf-k and --placement apply to the batch-1 benchmark, not to "
                "--concurrency[/red]"
            )
            raise typer.Exit(1)
        if ceiling and (drafter or target != "smollm2" or draft_model != "smollm2"):
            stderr.print(
                "[red]error: --ceiling runs its own near-free model: leave out --target, --draft-model "
                "and --drafter[/red]"
            )
            raise typer.Exit(1)
        if ceiling and network_rtt_ms is not None:
            stderr.print(
                "[red]error: --network-rtt-ms applies to the batch-1 benchmark and --concurrency, not to "
                "--ceiling[/red]"
            )
            raise typer.Exit(1)
        _bench_concurrency(inputs, concurrency, load | {"drafter": drafter}, ceiling, network)
        return
    if drafter is not None or any(v is not None for v in load.values()):
        stderr.print(
            "[red]error: --requests-per-client, --methods, --drafter, --api, --load-generator, --arrivals, "
            "--request-rate, --slo-ttft-ms and --slo-tpot-ms apply with --concurrency[/red]"
        )
        raise typer.Exit(1)
    from specdec_app.bench.report import network_table, overall_table, speedup_table
    from specdec_app.bench.run import REPORT_FILES, BenchConfig, run_bench

    given: dict[str, Any] = {"pipelines": pipeline, "hf_k": hf_k, "placements": placement}  # the rest: defaults
    config = BenchConfig(
        **inputs, **{name: value for name, value in given.items() if value}, **_run_mode(lambda: _network(network))
    )
    report = _run_mode(lambda: run_bench(config, stderr))
    print("\n".join([*speedup_table(report), "", *overall_table(report)]))
    if report.get("network"):
        print("\n" + "\n".join(network_table(report)))
    _print_mismatches(report, "plain")
    stderr.print(f"reports written to {out}/: {', '.join(REPORT_FILES)}")


def _network(given: dict[str, Any]) -> dict[str, Any]:
    """The :class:`specdec_app.bench.network.NetworkOptions` fields of ``--network-rtt-ms``,
    ``--network-jitter-ms`` and ``--network-topology`` as given (None: not given). Raises
    ValueError naming the option to fix."""
    from specdec_app.bench.network import NetworkOptions, parse_rtts, parse_topologies

    if given["rtt"] is None:
        return {}
    options = NetworkOptions(network_rtts_ms=parse_rtts(given["rtt"]))
    if given["jitter"] is not None:
        options.network_jitter_ms = given["jitter"]
    if given["topology"] is not None:
        options.network_topologies = parse_topologies(given["topology"])
    options.network()  # a jitter the RTTs allow (ValueError)
    return vars(options)


def _run_mode(run: Callable[[], dict]) -> dict:
    """The report ``run()`` returns; a failed pipeline request, a bad option or a service that
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


def _bench_structured(inputs: dict[str, Any], drafter: str) -> None:
    """``specdec bench --structured``: see :mod:`specdec_app.bench.structured`."""
    from specdec_app.bench.structured import REPORT_FILES, StructuredConfig, run_structured, structured_table, targets

    report = _run_mode(lambda: run_structured(StructuredConfig(**inputs, drafter=drafter), stderr))
    print("\n".join([*structured_table(report), "", *targets(report)]))
    _print_mismatches(report, "plain constrained decoding")
    stderr.print(f"reports written to {inputs['out']}/: {', '.join(REPORT_FILES)}")


def _bench_conversation(inputs: dict[str, Any], conversation: str, drafter: str, placements: list[str]) -> None:
    """``specdec bench --conversation``: see :mod:`specdec_app.bench.conversation`."""
    from specdec_app.bench.conversation import (
        ConversationConfig,
        report_files,
        requests_table,
        run_conversation,
        targets_table,
    )
    from specdec_app.bench.run import DRAFTERS

    config = ConversationConfig(**inputs, conversation=conversation, drafter=drafter, placements=placements)

    def run() -> dict:
        if drafter not in DRAFTERS:
            raise ValueError(f"--drafter {drafter!r}: use one of {', '.join(DRAFTERS)}")
        return run_conversation(config, stderr)

    report = _run_mode(run)
    print("\n".join([*requests_table(report, "summary"), "", *targets_table(report)]))
    _print_mismatches(report, "plain")
    stderr.print(f"reports written to {inputs['out']}/: {', '.join(report_files(conversation))}")


def _bench_replicas(inputs: dict[str, Any]) -> None:
    """``specdec bench --replicas``: see :mod:`specdec_app.bench.replicas`."""
    from specdec_app.bench.replicas import REPORT_FILES, ReplicasConfig, run_replicas, targets_summary

    config = ReplicasConfig(inputs["questions"], inputs["out"], inputs["command"])
    report = _run_mode(lambda: run_replicas(config, stderr))
    print("\n".join(targets_summary(report)))
    stderr.print(f"reports written to {inputs['out']}/: {', '.join(REPORT_FILES)}")


def _bench_concurrency(
    inputs: dict[str, Any], concurrency: str | None, load: dict[str, Any], ceiling: bool, network: dict[str, Any]
) -> None:
    """``specdec bench --concurrency`` (and ``--ceiling``): see :mod:`specdec_app.bench.concurrency`
    and :mod:`specdec_app.bench.ceiling`. ``inputs``: the options both modes take, as
    :class:`specdec_app.bench.run.BenchInputs` fields; ``load``: the load options as given (None:
    not given); ``network``: the network options as given (:func:`_network`)."""
    from specdec_app.bench import ceiling as ceiling_mode
    from specdec_app.bench.arrivals import ARRIVALS, CLOSED, parse_arrivals
    from specdec_app.bench.concurrency import (
        DEFAULT_CONCURRENCY,
        REPORT_FILES,
        ConcurrencyConfig,
        parse_concurrency,
        run_concurrency,
    )
    from specdec_app.bench.load_methods import METHODS, parse_methods
    from specdec_app.bench.report import (
        comparison_tables,
        concurrency_network_table,
        concurrency_table,
        cpu_table,
        identity_table,
    )

    allowed = ceiling_mode.METHODS if ceiling else METHODS
    default_n = ceiling_mode.DEFAULT_CONCURRENCY if ceiling else DEFAULT_CONCURRENCY
    try:
        config = ConcurrencyConfig(
            **inputs,
            concurrency=parse_concurrency(concurrency) if concurrency else list(default_n),
            requests_per_client=2 if load["requests_per_client"] is None else load["requests_per_client"],
            methods=parse_methods(load["methods"], adaptive=not ceiling) if load["methods"] else list(allowed),
            drafter=load["drafter"] or "llama-cpp",
            api=load["api"] or "grpc",
            load_generator=load["load_generator"] or "",
            arrivals=parse_arrivals(load["arrivals"]) if load["arrivals"] else [CLOSED] if ceiling else list(ARRIVALS),
            request_rate=load["request_rate"],
            **{name: load[name] for name in ("slo_ttft_ms", "slo_tpot_ms") if load[name] is not None},
            **_network(network),
        )
        if config.drafter not in ("llama-cpp", "transformers", "ngram"):
            raise ValueError(f"--drafter {config.drafter!r}: use llama-cpp, transformers or ngram")
        if ceiling:
            config = ceiling_mode.configure(config, stderr)
        report = run_concurrency(config, stderr)
        if ceiling:
            ceiling_mode.add_targets(report, config.out)
    except (ValueError, RuntimeError) as err:
        stderr.print(f"[red]error: {err}[/red]")
        raise typer.Exit(1) from None
    for arrivals in config.arrivals:
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
    stderr.print(f"reports written to {config.out}/: {', '.join(REPORT_FILES)}")

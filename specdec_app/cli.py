"""The ``specdec`` command line: run the services, stream completions, run the demo and the benchmark."""

import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from pydantic import ValidationError
from rich.table import Table

from specdec_app.bench_cli import bench_app, stderr
from specdec_app.launcher import configured_api_key

app = typer.Typer(help="Speculative decoding as a distributed gRPC service.", no_args_is_help=True)
serve_app = typer.Typer(help="Run one service in the foreground.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(bench_app, name="bench")

DEMO_PROMPT = "Summarize in two sentences why the sky is blue, then repeat your summary word for word."
# `serve <service>` leaves every argument, --help included, to pydantic-settings.
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _exit_while_starting(_signum: int, _frame: Any) -> None:
    """SIGTERM before a service serves (while it imports and loads its models) ends the process
    with exit code 0, as one once it serves does; the service's own handler takes over then."""
    raise SystemExit(0)


def _run_service(ctx: typer.Context, service: str) -> None:
    signal.signal(signal.SIGTERM, _exit_while_starting)
    from specdec.observability.telemetry import configure_logging, configure_tracing
    from specdec.settings import ServiceSettings, parse_settings

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
    logging.getLogger("specdec").info("starting the %s service", service)
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


def _channel_credentials(
    tls: bool, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from a command's --tls, --tls-ca, --tls-cert and --tls-key (None: plaintext,
    none of them given); exits with code 1 saying what to fix when a file cannot be used."""
    from specdec.rpc.tls import TLSFileError, channel_credentials

    if not (tls or tls_ca or tls_cert or tls_key):
        return None
    ca_file, cert_file, key_file = (str(path or "") for path in (tls_ca, tls_cert, tls_key))
    try:
        return channel_credentials(ca_file, cert_file, key_file, ("--tls-ca", "--tls-cert", "--tls-key"))
    except TLSFileError as err:
        stderr.print(f"[red]error: {err}[/red]")
        raise typer.Exit(1) from None


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

    if prompt is None and resume_from is None:
        stderr.print("[red]error: give a PROMPT, or --request-id and --resume-from to resume a request[/red]")
        raise typer.Exit(1)
    credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
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


@app.command()
def health(
    address: Annotated[str, typer.Option(help="The service's host:port.")] = "127.0.0.1:50051",
    service: Annotated[
        str,
        typer.Option(help="The service whose status to ask (e.g. specdec.v1.DraftService); empty: the server's."),
    ] = "",
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the answer, connecting included.", min=0.001)
    ] = 5.0,
    tls: Annotated[
        bool,
        typer.Option(help="Connect over TLS, checking the server's certificate against the system's roots."),
    ] = False,
    tls_ca: Annotated[
        Path | None, typer.Option(help="PEM CA bundle the server's certificate is checked against; connects over TLS.")
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="PEM client certificate, when the server asks for one (mutual TLS), with --tls-key."),
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    server_name: Annotated[
        str,
        typer.Option(
            help="The name the server's certificate is checked against, when --address's host is not one of its "
            "names (127.0.0.1 inside a pod: the Service's name, e.g. specdec-draft)."
        ),
    ] = "",
) -> None:
    """Ask a server's gRPC health check (grpc.health.v1.Health/Check) and exit with code 0 when it
    answers SERVING, 1 otherwise (NOT_SERVING, an unknown --service, no answer within --timeout, a
    refused TLS handshake), printing the status or what failed. Kubernetes runs it as the probe of a
    service over TLS, which the kubelet's own gRPC probe does not speak."""
    from specdec.rpc.health_check import SERVING, health_status, status_name

    credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
    try:
        status = health_status(address, service, timeout, credentials, server_name)
    except grpc.RpcError as err:
        stderr.print(f"{address}: no health answer: {err.code().name}: {err.details()}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    print(f"{address}: {status_name(status)}")
    if status != SERVING:
        raise typer.Exit(1)

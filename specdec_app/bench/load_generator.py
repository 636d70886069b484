"""A third-party load generator, `guidellm <https://github.com/vllm-project/guidellm>`_, against any
OpenAI-compatible endpoint: the coordinator's HTTP API and ``transformers serve`` alike.

:func:`run_guidellm` writes a guidellm scenario (the endpoint, a concurrent profile of N streams,
``max_requests`` requests, the given prompts as an in-memory data set, a local tokenizer for its
token counts, ``max_tokens`` per request and extra body fields such as ``temperature``), runs
``guidellm run --scenario`` as a subprocess and reads its JSON report back;
:func:`summarize` takes from it what the bench reports per N: requests completed, errored and
incomplete, requests/s, output tokens/s, TTFT, ITL and TPOT percentiles.

guidellm never downloads anything here: the tokenizer is a local folder, the data set is in the
scenario, and the subprocess runs with ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1``
(guidellm has no telemetry or update check). The prompts carry no output token count, so guidellm
sends ``max_completion_tokens`` without vLLM's ``ignore_eos`` (which specdec refuses): a request may
stop on EOS before ``max_tokens``, as in the bench's own clients.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

GUIDELLM = "guidellm"
LOAD_GENERATORS = (GUIDELLM,)
DEFAULT_TIMEOUT_S = 3600.0
SAMPLE_SIZE = 4


@dataclass
class LoadTarget:
    """An OpenAI-compatible endpoint to load: ``base_url`` (``http://host:port/v1``), the
    ``model`` to name, the ``tokenizer`` guidellm counts prompt tokens with (a local folder or a
    tokenizer spec transformers loads offline), the ``api_key`` (None: none sent) and fields added
    to every request body (``extra_body``: e.g. ``temperature``, ``drafter``)."""

    name: str
    base_url: str
    model: str
    tokenizer: str
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)


def scenario(
    target: LoadTarget,
    prompts: list[str],
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    report_path: Path,
    request_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict:
    """The guidellm scenario of one run: ``concurrency`` streams (closed loop: each sends its next
    request when the previous one has finished) until ``num_requests`` requests were sent, each a
    streamed chat completion of one user message (a prompt of ``prompts``, in order) and at most
    ``max_tokens`` new tokens; the JSON report goes to ``report_path``."""
    backend = {
        "kind": "openai_http",
        "target": target.base_url,
        "model": target.model,
        "max_tokens": max_tokens,
        "request_format": "/v1/chat/completions",
        "timeout": request_timeout_s,
        "http2": False,
    }
    if target.api_key:
        backend["api_key"] = target.api_key
    if target.extra_body:
        backend["extras"] = {"body": dict(target.extra_body)}
    return {
        "metadata": {"name": f"specdec-{target.name}-N{concurrency}"},
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent", "streams": [concurrency]},
            "constraints": [{"kind": "max_requests", "count": num_requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": target.tokenizer},
            "data": [{"kind": "in_memory_dict_list", "data": [{"prompt": p} for p in prompts]}],
            "outputs": [{"kind": "json", "path": str(report_path)}],
            # every request's timings and token counts are kept for the statistics; the full records
            # (prompt, output, error text) of only this many per status, so reports stay small
            "metrics": {"kind": "generative", "sample_size": SAMPLE_SIZE},
        },
    }


def command(scenario_path: Path) -> list[str]:
    """The guidellm command line of a scenario file."""
    return [sys.executable, "-m", "guidellm", "run", "--scenario", str(scenario_path), "--disable-progress"]


def run_guidellm(
    target: LoadTarget,
    prompts: list[str],
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    out_dir: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict:
    """Runs guidellm against ``target`` (see :func:`scenario`); its scenario, log and JSON report go
    to ``out_dir`` as ``guidellm-<name>-N<concurrency>.{scenario.json,log,json}``. Returns the
    figures of :func:`summarize` plus ``report_file`` and ``command``. Raises RuntimeError (with
    the end of its log) when guidellm fails or writes no report, ValueError for no prompts."""
    if not prompts:
        raise ValueError("the load generator needs at least one prompt")
    out_dir = out_dir.resolve()  # guidellm runs in it: its paths must not be relative to ours
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"guidellm-{target.name.replace('/', '-')}-N{concurrency}"
    report_path, log_path = out_dir / f"{stem}.json", out_dir / f"{stem}.log"
    rows = [prompts[i % len(prompts)] for i in range(num_requests)]  # every request its own row, in order
    scenario_path = out_dir / f"{stem}.scenario.json"
    scenario_path.write_text(
        json.dumps(scenario(target, rows, concurrency, num_requests, max_tokens, report_path), indent=1)
    )
    env = dict(os.environ) | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "NO_PROXY": "127.0.0.1,localhost,::1",
        # one worker process: a closed loop of a few streams needs no more, and each spawned worker
        # imports torch and transformers again
        "GUIDELLM__MAX_WORKER_PROCESSES": os.environ.get("GUIDELLM__MAX_WORKER_PROCESSES", "1"),
    }
    cmd = command(scenario_path)
    with open(log_path, "wb") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=out_dir)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"guidellm did not finish within {timeout_s:.0f} s (see {log_path})") from None
    if done.returncode != 0 or not report_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"guidellm exited with code {done.returncode} against {target.base_url} (log {log_path}):\n{tail}"
        )
    summaries = summarize(json.loads(report_path.read_text()))
    if len(summaries) != 1:
        raise RuntimeError(f"guidellm's report {report_path} has {len(summaries)} benchmarks, expected 1")
    return summaries[0] | {"report_file": report_path.name, "command": " ".join(cmd[1:])}


def summarize(report: dict) -> list[dict]:
    """Per benchmark of a guidellm JSON report: ``concurrency``, ``num_completed``,
    ``num_errored``, ``num_incomplete`` (requests), ``duration_s``, ``requests_per_second``,
    ``output_tokens_per_second`` (completed requests' output tokens / the benchmark's duration),
    ``ttft_ms_p50/p99``, ``itl_ms_p50/p99`` (mean inter-token latency per request, ms),
    ``tpot_ms_p50/p99`` and ``latency_s_p50/p99``. Missing figures are None."""
    return [_summary(benchmark) for benchmark in report.get("benchmarks", [])]


def _successful(metrics: dict, name: str) -> dict:
    return (metrics.get(name) or {}).get("successful") or {}


def _percentile(distribution: dict, p: str) -> float | None:
    if not distribution.get("count"):
        return None
    return (distribution.get("percentiles") or {}).get(p)


def _summary(benchmark: dict) -> dict:
    metrics = benchmark.get("metrics", {})
    totals = metrics.get("request_totals", {})
    strategy = benchmark.get("config", {}).get("strategy", {})
    errored = (benchmark.get("requests") or {}).get("errored") or []
    summary = {
        "concurrency": strategy.get("streams"),
        "num_completed": totals.get("successful", 0),
        "num_errored": totals.get("errored", 0),
        "num_incomplete": totals.get("incomplete", 0),
        "duration_s": benchmark.get("duration"),
        # guidellm's rates: the mean over the benchmark, i.e. the total / its duration
        "requests_per_second": _successful(metrics, "requests_per_second").get("mean"),
        "output_tokens_per_second": _successful(metrics, "output_tokens_per_second").get("mean"),
        "num_output_tokens": _successful(metrics, "output_token_count").get("total_sum"),
        "errors": sorted({str((r.get("info") or {}).get("error")) for r in errored}),
    }
    for key, name in (
        ("ttft_ms", "time_to_first_token_ms"),
        ("itl_ms", "inter_token_latency_ms"),
        ("tpot_ms", "time_per_output_token_ms"),
        ("latency_s", "request_latency"),
    ):
        for p in ("p50", "p99"):
            summary[f"{key}_{p}"] = _percentile(_successful(metrics, name), p)
    return summary


def version() -> str | None:
    """guidellm's installed version; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(GUIDELLM)
    except PackageNotFoundError:
        return None


def check_installed(name: str) -> None:
    """Raises ValueError unless ``name`` is a load generator this module runs and it is installed."""
    if name not in LOAD_GENERATORS:
        raise ValueError(f"--load-generator {name!r}: use {', '.join(LOAD_GENERATORS)}")
    if version() is None:
        raise ValueError(
            f"--load-generator {name}: {name} is not installed: run scripts/setup.sh --test (it installs "
            "the test extra at the locked versions, guidellm among them)"
        )


def run_all(
    targets: list[LoadTarget],
    prompts: list[str],
    concurrency: list[int],
    requests_per_client: int,
    max_tokens: int,
    out_dir: Path,
    console,
) -> list[dict]:
    """guidellm against every target at every N of ``concurrency``, ``N * requests_per_client``
    requests each (the closed-loop cells' count and prompts, in the cells' order: request j of
    stream c gets prompt ``(j * N + c) mod len``), the targets' order rotating per N as the cells'
    methods do. A failed run is recorded with its ``error`` and the others go on. Returns one
    entry per (target, N): ``method``, ``concurrency`` and the figures of :func:`run_guidellm`."""
    runs = []
    for i, n in enumerate(concurrency):
        for target in targets[i % len(targets) :] + targets[: i % len(targets)]:
            console.print(f"guidellm: {target.name} at N={n}, {n * requests_per_client} requests...")
            try:
                summary = run_guidellm(target, prompts, n, n * requests_per_client, max_tokens, out_dir)
            except RuntimeError as err:
                console.print(f"[red]guidellm against {target.name} at N={n} failed: {err}[/red]")
                summary = {"concurrency": n, "error": str(err)}
            runs.append({"method": target.name} | summary)
    order = [t.name for t in targets]
    return sorted(runs, key=lambda run: (order.index(run["method"]), run["concurrency"] or 0))


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(section: dict) -> list[str]:
    """The report's Markdown section of the load generator's runs (``section``: the report's
    ``load_generator`` entry)."""
    lines = [
        f"## Load generator: guidellm {section.get('version') or ''}".rstrip(),
        "",
        "The same endpoints driven by guidellm (`guidellm run`, concurrent profile: N streams, each sending its "
        "next request when the previous one finished; the cells' prompts and max tokens; streamed chat "
        "completions, temperature 0), after the closed-loop cells. Figures are guidellm's: requests/s and "
        "output tokens/s over its benchmark's duration; TTFT, ITL (inter-token latency, per token after the "
        "first) and TPOT (per output token, the first included) in ms over completed requests.",
        "",
        "| method | N | completed | errored | incomplete | requests/s | output tokens/s | TTFT p50 | TTFT p99 "
        "| ITL p50 | ITL p99 | TPOT p50 | TPOT p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in section.get("runs", []):
        if run.get("error"):
            lines.append(
                f"| {run['method']} | {run['concurrency']} | failed: {run['error'].splitlines()[0]} |" + " |" * 10
            )
            continue
        lines.append(
            f"| {run['method']} | {run['concurrency']} | {run['num_completed']} | {run['num_errored']} "
            f"| {run['num_incomplete']} | {_fmt(run['requests_per_second'], 2)} "
            f"| {_fmt(run['output_tokens_per_second'])} "
            f"| {_fmt(run['ttft_ms_p50'], 0)} | {_fmt(run['ttft_ms_p99'], 0)} | {_fmt(run['itl_ms_p50'])} "
            f"| {_fmt(run['itl_ms_p99'])} | {_fmt(run['tpot_ms_p50'])} | {_fmt(run['tpot_ms_p99'])} |"
        )
    errors = sorted({e for run in section.get("runs", []) for e in run.get("errors", [])})
    if errors:
        lines += ["", "Errors guidellm recorded:", *(f"- {e}" for e in errors)]
    lines += ["", f"Raw guidellm reports, scenarios and logs: `{section.get('folder', 'guidellm')}/`."]
    return lines

"""Runs ``specdec bench``: every method on the same prompts, interleaved per prompt after a
warm-up, then the JSON, Markdown and PNG reports."""

import contextlib
import datetime
import os
import platform
import resource
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdec.engine.cpu_linear import cpu_runs
from specdec.engine.models import load_causal_lm
from specdec_app.bench.chart import write_chart
from specdec_app.bench.cpu_pinning import PINNED_PLAIN, CpuPinning, cpu_pinning
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.network import NetworkOptions, NetworkSetting
from specdec_app.bench.pipeline_method import OnNetwork, PipelineMethod, peak_rss_bytes, start_cluster
from specdec_app.bench.questions import Question, load_questions
from specdec_app.bench.report import BASELINE, network_rows, summarize, write_json, write_markdown
from specdec_app.bench.transformers_methods import TransformersMethod

DRAFTERS = ("llama-cpp", "transformers", "ngram", "suffix")
WARM_UP_TOKENS = 16
REPORT_FILES = ("report.json", "report.md", "speedup.png")


@dataclass
class BenchInputs:
    """What every mode of ``specdec bench`` takes: prompts, models, output folder (see
    ``specdec bench batch1 --help`` for each field)."""

    questions: Path
    out: Path
    command: str
    categories: list[str] | None = None
    limit: int | None = 10
    max_new_tokens: int = 128
    seed: int = 0
    target: str = "smollm2"
    draft_model: str = "smollm2"
    dtype: str = "auto"

    def load_questions(self) -> list[Question]:
        """The selected prompts. Raises ValueError naming the option to fix."""
        if self.max_new_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise ValueError("--max-new-tokens and --limit must be at least 1")
        questions = load_questions(self.questions, self.categories, self.limit)
        if not questions:
            raise ValueError(f"{self.questions} has no questions")
        return questions


@dataclass
class BenchConfig(BenchInputs, NetworkOptions):
    """What ``specdec bench`` (batch 1) runs; under a network (:class:`NetworkOptions`) every
    pipeline method on each placement runs under every setting."""

    pipelines: list[str] = field(
        default_factory=lambda: ["ngram:4", "ngram:8", "llama-cpp:4", "llama-cpp:8", "ngram:auto", "llama-cpp:auto"]
    )
    hf_k: list[int] = field(default_factory=lambda: [4])
    placements: list[str] = field(default_factory=lambda: ["shared"])


def parse_pipeline(spec: str) -> tuple[str, int | None]:
    """``DRAFTER:K`` (e.g. ``llama-cpp:4``) as ``(drafter, K)``; ``DRAFTER:auto`` as
    ``(drafter, None)``: the coordinator's adaptive K. Raises ValueError naming what to fix."""
    drafter, _, k = spec.partition(":")
    if drafter not in DRAFTERS or not (k == "auto" or (k.isdigit() and 1 <= int(k) <= 16)):
        raise ValueError(
            f"--pipeline {spec!r}: use DRAFTER:K with DRAFTER one of {', '.join(DRAFTERS)} and K in 1..16 or auto"
        )
    return drafter, None if k == "auto" else int(k)


# The /proc/cpuinfo flags a report names: the instructions the target's kernels run on
# (ATen's vectorized kernels, oneDNN's GEMMs). Step costs, and so which K wins, move with them.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512 BF16",
    "avx_ne_convert": "AVX-NE-CONVERT",
    "amx_tile": "AMX",
}


def cpu_isa(flags: set[str]) -> dict:
    """What this CPU runs the target on: the :data:`ISA_FLAGS` present in ``flags`` (/proc/cpuinfo),
    the kernels ATen dispatches to (``torch.backends.cpu.get_cpu_capability()``: ``AVX2``,
    ``AVX512``; ``ATEN_CPU_CAPABILITY`` lowers it) and whether oneDNN packs bfloat16 weights here
    (:func:`specdec.engine.cpu_linear.cpu_runs`)."""
    return {
        "flags": [name for flag, name in ISA_FLAGS.items() if flag in flags],
        "aten": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": cpu_runs(torch.bfloat16),
    }


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (none where it cannot be read)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        lines = cpuinfo.read().split("\n\n")[0].splitlines()
        return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}
    return {}


def machine_info() -> dict:
    """CPU model (its family and model numbers name the generation where a VM hides the name),
    instruction sets (:func:`cpu_isa`), cores, device and library versions, for the report."""
    fields = _cpuinfo()
    cpu = fields.get("model name", platform.processor() or platform.machine())
    if "cpu family" in fields:
        cpu += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return {
        "cpu": cpu,
        "isa": cpu_isa(set(fields.get("flags", "").split())),
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _transformers_methods(
    config: BenchConfig, pinned_cpus: frozenset[int] | None, use_assistant: bool, console: Console
) -> list[TransformersMethod]:
    """plain, plain/verify-cpu when ``pinned_cpus`` (the split placement's verify CPU), and the
    hf-* methods, on one transformers copy of the target."""
    transformers.utils.logging.disable_progress_bar()
    console.print(f"loading the target {config.target} in transformers (plain and hf-* methods)...")
    target, tokenizer = load_causal_lm(config.target, config.dtype)
    methods = [TransformersMethod(target, tokenizer)]
    if pinned_cpus:
        methods.append(TransformersMethod(target, tokenizer, cpus=pinned_cpus, name=PINNED_PLAIN))
    methods += [TransformersMethod(target, tokenizer, k, "hf-prompt-lookup") for k in config.hf_k]
    if use_assistant:
        assistant, _ = load_causal_lm(config.draft_model, config.dtype)
        methods += [TransformersMethod(target, tokenizer, k, "hf-assisted", assistant) for k in config.hf_k]
    return methods


def warm_up(methods, question: Question, config: BenchInputs) -> None:
    """One short unmeasured request per method (``WARM_UP_TOKENS``), so that no method's first
    measured request pays for loading kernels and connecting."""
    for method in methods:
        method.run(question, min(WARM_UP_TOKENS, config.max_new_tokens), config.seed)


def interleaved(methods, questions: list[Question], console: Console) -> Iterator[tuple[int, Question, Any]]:
    """``(index, question, method)`` for each question through every method, the order rotating per
    question so that machine noise hits all methods alike, under a progress bar that advances when
    the caller asks for the next one."""
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("bench", total=len(questions) * len(methods))
        for i, question in enumerate(questions):
            for method in methods[i % len(methods) :] + methods[: i % len(methods)]:
                progress.update(task, description=f"{question.category} #{question.question_id} {method.name:<22}")
                yield i, question, method
                progress.advance(task)


def run_all(
    methods, questions: list[Question], config: BenchInputs, console: Console, warm_up_with: Question | None = None
) -> list[Measurement]:
    """Warm-up on ``warm_up_with`` (None: the first question), then each question through every
    method (:func:`interleaved`), each compared with ``plain``'s token ids; in question order,
    then method order."""
    warm_up(methods, warm_up_with or questions[0], config)
    runs: list[dict[str, Measurement]] = [{} for _ in questions]
    for i, question, method in interleaved(methods, questions, console):
        runs[i][method.name] = method.run(question, config.max_new_tokens, config.seed)
    return compared_to_plain(runs, [method.name for method in methods])


def compared_to_plain(runs: list[dict[str, Measurement]], names: list[str]) -> list[Measurement]:
    """Each question's runs (by method name) compared with ``plain``'s token ids, in question order,
    then in the order of ``names``."""
    for by_method in runs:
        for m in by_method.values():
            m.compare_to(by_method[BASELINE].token_ids)
    return [by_method[name] for by_method in runs for name in names]


def parse_placements(names: list[str]) -> list[CpuPinning]:
    """The placements of ``--placement`` (:mod:`specdec_app.bench.cpu_pinning`). Raises ValueError
    for an unknown or repeated name, or none."""
    if not names or len(set(names)) < len(names):
        raise ValueError("--placement: name each placement once (shared, split or both)")
    return [cpu_pinning(name) for name in names]


def _validated(config: BenchConfig) -> tuple[list[Question], list[tuple[str, int | None]], list[CpuPinning]]:
    placements = parse_placements(config.placements)
    config.network()  # ValueError for a bad network setting
    return config.load_questions(), [parse_pipeline(spec) for spec in config.pipelines], placements


def _pipeline_methods(
    cluster, pipelines: list[tuple[str, int | None]], suffix: str, network: list[NetworkSetting]
) -> list:
    """The pipeline methods on ``cluster`` (``suffix``: its placement's, where a run has
    several); under a network, each under every setting (named ``<method><suffix><setting>``),
    and ``pipeline/K=0`` under each too: the reference at the same RTT."""
    address = cluster.address("coordinator")
    if not network:
        return [PipelineMethod(address, drafter, k, suffix) for drafter, k in pipelines]
    return [
        OnNetwork(PipelineMethod(address, drafter, k, suffix + setting.suffix), cluster.links, setting)
        for setting in network
        for drafter, k in [*pipelines, ("", 0)]
    ]


def _report(config, questions, methods, measurements, memory) -> dict:
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "machine": machine_info(),
        "num_questions": len(questions),
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "methods": [m.name for m in methods],
        "summary": summarize(measurements, {m.name: m.k for m in methods}),
        "peak_rss_bytes": memory,
        "mismatches": [m.to_json() for m in measurements if m.first_mismatch is not None],
        "measurements": [m.to_json() for m in measurements],
    }
    if config.network_rtts_ms:
        report["network"] = config.network_json()
        report["network"]["rows"] = network_rows(report)
    return report


def run_bench(config: BenchConfig, console: Console) -> dict:
    """Runs the benchmark and writes ``report.json``, ``report.md`` and ``speedup.png`` to
    ``config.out``; returns the report. With several placements, each gets a cluster of its own
    and every pipeline runs on each (named ``<method>@<placement>``), all in the same run, against
    the same plain baselines. Under a network (``config.network_rtts_ms``) each cluster's
    coordinator reaches its services through delaying proxies and every pipeline, and
    ``pipeline/K=0``, runs under every setting (:func:`_pipeline_methods`). Raises ValueError for
    bad options, RuntimeError when a service fails to start, grpc.RpcError when a pipeline request
    fails."""
    questions, pipelines, placements = _validated(config)
    network = config.network()
    config.out.mkdir(parents=True, exist_ok=True)
    drafters = list(dict.fromkeys(drafter for drafter, _ in pipelines))
    split = next((where for where in placements if where.cpus), None)
    methods: list = _transformers_methods(
        config, split.cpus["verify"] if split else None, "transformers" in drafters, console
    )
    clusters = {}
    try:
        for where in placements if pipelines else []:
            console.print(
                f"starting the coordinator, draft ({', '.join(drafters)}) and verify services ({where.name})..."
            )
            suffix = f"@{where.name}" if len(placements) > 1 else ""
            clusters[suffix] = start_cluster(
                config.target,
                config.draft_model,
                drafters,
                config.dtype,
                config.out / "logs" / where.name,
                placement=where,
                network=bool(network),
            )
            methods += _pipeline_methods(clusters[suffix], pipelines, suffix, network)
        measurements = run_all(methods, questions, config, console)
        memory = {
            f"{name}{suffix}": peak_rss_bytes(p.pid)
            for suffix, cluster in clusters.items()
            for name, p in cluster.processes.items()
        }
    finally:
        for cluster in clusters.values():
            cluster.stop()
    # ru_maxrss is in KiB on Linux
    memory["bench process (plain and hf-* methods)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = _report(config, questions, methods, measurements, memory)
    write_json(report, config.out / REPORT_FILES[0])
    write_markdown(report, config.out / REPORT_FILES[1])
    write_chart(report, config.out / REPORT_FILES[2])
    return report

"""The speculative pipeline as a benchmark method: the coordinator, draft and verify services as
separate processes on this machine, called over gRPC like any client would."""

import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.api.client import Completion, stream
from coordinator.observability.metrics import PLAIN
from specdec.timing import ms_since
from specdec_app.bench.cpu_pinning import SHARED, CpuPinning
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.network import LINKS, DelayedLinks, NetworkSetting
from specdec_app.bench.questions import Question, generate_request
from specdec_app.launcher import LocalCluster, free_port


@dataclass
class ProxiedCluster(LocalCluster):
    """A :class:`LocalCluster` whose coordinator reaches the draft and the verify service through
    delaying proxies (:class:`DelayedLinks`, on free ports), started before the services and
    stopped after them (the coordinator drains its calls through them)."""

    links: DelayedLinks | None = field(default=None, init=False)

    def service_process(self, service: str):
        """The coordinator is given the proxies' addresses in place of the services'."""
        process = super().service_process(service)
        if service == "coordinator" and self.links is not None:
            proxied = {self.address(link): address for link, address in self.links.addresses().items()}
            process.args = [proxied.get(arg, arg) for arg in process.args]
        return process

    def start_all(self, timeout_s: float = 600.0) -> None:
        self.links = DelayedLinks(
            {link: self.address(link) for link in LINKS}, {link: f"{self.host}:{free_port()}" for link in LINKS}
        )
        self.links.start()
        try:
            super().start_all(timeout_s)
        except BaseException:
            self.links.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        try:
            super().stop(grace_s)
        finally:
            if self.links is not None:
                self.links.stop()


class OnNetwork:
    """A benchmark method (:class:`PipelineMethod`) or load client
    (:class:`specdec_app.bench.concurrency.PipelineClient`) run under a network ``setting``: every
    ``run`` applies the setting to ``links`` first (for a load client, when the request's
    coroutine is made, just before it is awaited: a cell's requests all run under its method's
    setting). Every other attribute is the method's."""

    def __init__(self, method, links: DelayedLinks, setting: NetworkSetting):
        self.method, self.links, self.setting = method, links, setting
        self.name = method.name

    def __getattr__(self, name: str):
        return getattr(self.method, name)

    def run(self, *args, **kwargs):
        self.links.apply(self.setting)
        return self.method.run(*args, **kwargs)


def start_cluster(
    target: str,
    draft_model: str,
    drafters: list[str],
    dtype: str,
    log_dir: Path,
    http_port: int = 0,
    placement: CpuPinning = SHARED,
    extra_args: dict[str, list[str]] | None = None,
    prefix_caching: bool = False,
    network: bool = False,
) -> LocalCluster:
    """Starts the three services on free ports hosting ``drafters``; every model drafter loads
    ``draft_model``; the coordinator serves its HTTP API on ``http_port`` (0: off); the services
    run where ``placement`` puts them. The suffix lookups (the coordinator's and the draft
    service's) keep no cache of earlier outputs, and the services no prefix cache unless
    ``prefix_caching`` (the conversation mode, which measures it): the benchmark sends each prompt
    once per method, and the caches would hold this prompt, and its answer, from the methods before
    on the same services. With ``network``, a :class:`ProxiedCluster`: the coordinator's links to
    the draft and verify services through delaying proxies (``cluster.links``). Services also read
    their ``SPECDEC_*`` variables (e.g. ``SPECDEC_DRAFT_LLAMA_CPP_N_GPU_LAYERS``) and take
    ``extra_args`` (flags by service). Raises RuntimeError when one fails to start."""
    kind = ProxiedCluster if network else LocalCluster
    cluster = kind(free_port(), free_port(), free_port(), log_dir=log_dir, http_port=http_port, cpus=placement.cpus)
    pinning = placement.service_args
    cluster.extra_args = {
        "verify": ["--model", target, "--dtype", dtype, *pinning.get("verify", [])],
        "draft": [
            "--drafters",
            ",".join(drafters),
            "--default-drafter",
            drafters[0],
            "--llama-cpp-model",
            draft_model,
            "--transformers-model",
            draft_model,
            "--transformers-dtype",
            dtype,
            "--suffix-max-cached-requests",
            "0",
            *pinning.get("draft", []),
        ],
        "coordinator": ["--tokenizer", target, "--suffix-max-cached-requests", "0", *pinning.get("coordinator", [])],
    }
    if not prefix_caching:
        for service in ("verify", "draft"):
            cluster.extra_args[service].append("--no-enable-prefix-caching")
    for service, args in (extra_args or {}).items():
        cluster.extra_args[service] += args
    cluster.start_all()
    return cluster


def peak_rss_bytes(pid: int) -> int | None:
    """A process's peak resident set size (``VmHWM`` in /proc, bytes); None where /proc has none."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


PIPELINE = "pipeline"  # the name of a fixed-K method that names no drafter (pipeline/K=0: plain decode)


class PipelineMethod:
    """``<drafter>/K=<k><suffix>`` through the coordinator at ``address``; ``k`` None is
    ``<drafter>/adaptive``, the coordinator choosing K every round (``self.k`` is then 0: the
    report's formula needs a fixed K); a ``drafter`` of ``""`` names none (``pipeline/K=0``, plain
    decode through the services); ``suffix`` tells the placement apart (``@split``) where a run
    has several, and the network setting (``@rtt5ms-apart``). A question's schema constrains the
    output (``structured_output.json_schema``) unless ``constrained`` is False."""

    def __init__(self, address: str, drafter: str, k: int | None, suffix: str = "", constrained: bool = True):
        self.address, self.drafter, self.fixed_k, self.constrained = address, drafter, k, constrained
        self.k = k or 0
        self.name = (f"{drafter}/adaptive" if k is None else f"{drafter or PIPELINE}/K={k}") + suffix

    def run(self, question: Question, max_new_tokens: int, seed: int) -> Measurement:
        """Raises grpc.RpcError with the coordinator's status when the request fails, RuntimeError
        when the stream ends without a finish reason."""
        request = generate_request(question)
        request.max_new_tokens, request.drafter, request.seed = max_new_tokens, self.drafter, seed
        if self.fixed_k is not None:
            request.num_speculative_tokens = self.fixed_k
        if question.schema and self.constrained:
            request.structured_output.json_schema = question.schema
        completion, ttft_ms = Completion(), 0.0
        start = time.perf_counter()
        for response in stream(self.address, request, timeout_s=600):
            if response.token_ids and not completion.token_ids:
                ttft_ms = ms_since(start)
            completion.add(response)
        metrics = completion.metrics
        if metrics is None:
            raise RuntimeError(f"the stream for question {question.question_id} ended without a finish reason")
        return Measurement(
            method=self.name,
            question_id=question.question_id,
            category=question.category,
            token_ids=completion.token_ids,
            num_prompt_tokens=metrics.num_prompt_tokens,
            wall_ms=ms_since(start),
            ttft_ms=ttft_ms,
            num_target_forwards=metrics.num_target_forwards + 1,
            num_spec_steps=metrics.num_spec_steps,
            num_draft_tokens=metrics.num_draft_tokens,
            num_accepted_tokens=metrics.num_accepted_draft_tokens,
            acceptance_histogram=list(metrics.acceptance_histogram),
            draft_ms=metrics.draft_time_ms,
            verify_ms=metrics.verify_time_ms,
            num_verify_rounds=metrics.num_target_forwards,
            coordination_ms=metrics.coordination_time_ms,
            wire_bytes=metrics.round_wire_bytes,
            rounds_per_drafter={PLAIN: metrics.rounds_per_k[0] if metrics.rounds_per_k else 0}
            | {name: usage.num_rounds for name, usage in metrics.drafter_usage.items()},
            draft_ahead=(metrics.num_draft_ahead_proposals, metrics.num_draft_ahead_hits),
            draft_ahead_hits_per_branch=dict(metrics.draft_ahead_hits_per_branch),
            num_draft_ahead_branches=metrics.num_draft_ahead_branches,
            verify_costs=[[c.num_tokens, c.num_rounds, c.call_ms, c.forward_ms] for c in metrics.verify_costs],
            num_forced_draft_tokens=metrics.num_forced_draft_tokens,
            num_cached_prompt_tokens=metrics.num_cached_prompt_tokens,
            num_draft_cached_prompt_tokens=metrics.num_draft_cached_prompt_tokens,
        )

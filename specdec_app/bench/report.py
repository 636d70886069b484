"""The benchmark's arithmetic (per category and overall, per method) and its JSON and Markdown
reports. Rates are ratios of sums over the prompts of a group (tokens/s = all tokens / all
seconds), so long completions weigh more than short ones, as in a serving workload."""

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from specdec_app.bench.cpu_time import ms_per_token
from specdec_app.bench.load_methods import ADAPTIVE, base_method, best_fixed_k, is_fixed_k, requested_k
from specdec_app.bench.measurement import Measurement
from specdec_app.bench.network import NetworkSetting, split_setting

OVERALL = "overall"
BASELINE = "plain"


def expected_tokens_per_round(acceptance_rate: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a): tokens a round of K drafts commits when each draft token passes
    independently with probability a (Leviathan, Kalman & Matias 2023, eq. 1); K + 1 at a = 1."""
    if acceptance_rate >= 1.0:
        return k + 1.0
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)


def predicted_speedup(acceptance_rate: float, k: int, draft_cost_ratio: float, verify_cost_ratio: float) -> float:
    """The design brief's expected speedup: tokens per round / (K * c + v(K)), where c is a draft
    token's cost and v(K) a verify round's cost, both in plain target decode steps."""
    return expected_tokens_per_round(acceptance_rate, k) / (k * draft_cost_ratio + verify_cost_ratio)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _stats(runs: list[Measurement]) -> dict:
    tokens = sum(m.num_generated for m in runs)
    drafted = sum(m.num_draft_tokens for m in runs)
    accepted = sum(m.num_accepted_tokens for m in runs)
    steps = sum(m.num_spec_steps for m in runs)
    rounds = sum(m.num_verify_rounds for m in runs)
    histogram = [0] * max((len(m.acceptance_histogram) for m in runs), default=0)
    for m in runs:
        for j, count in enumerate(m.acceptance_histogram):
            histogram[j] += count
    coordination_ms = [m.coordination_ms for m in runs if m.coordination_ms is not None]
    wire_bytes = [m.wire_bytes for m in runs if m.wire_bytes is not None]
    pipeline = len(coordination_ms) == len(runs)
    rounds_per_drafter: dict[str, int] = {}
    for m in runs:
        for name, count in (m.rounds_per_drafter or {}).items():
            rounds_per_drafter[name] = rounds_per_drafter.get(name, 0) + count
    ahead = [m.draft_ahead for m in runs if m.draft_ahead]
    branch_hits: dict[str, int] = {}
    for m in runs:
        for branch, count in (m.draft_ahead_hits_per_branch or {}).items():
            branch_hits[branch] = branch_hits.get(branch, 0) + count
    return {
        "num_prompts": len(runs),
        "num_generated_tokens": tokens,
        "tokens_per_second": _ratio(tokens * 1000.0, sum(m.wall_ms for m in runs)),
        "tokens_per_target_forward": _ratio(tokens, sum(m.num_target_forwards for m in runs)),
        "mean_acceptance_length": 1.0 + accepted / steps if steps else None,
        "draft_acceptance_rate": _ratio(accepted, drafted),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_histogram": histogram,
        "identical_rate": sum(m.first_mismatch is None for m in runs) / len(runs),
        "time_to_first_token_ms": sum(m.ttft_ms for m in runs) / len(runs),
        "draft_ms_per_token": _ratio(sum(m.draft_ms for m in runs), drafted),
        "draft_ms_per_round": _ratio(sum(m.draft_ms for m in runs), rounds),
        "verify_ms_per_round": _ratio(sum(m.verify_ms for m in runs), rounds),
        # the tokens a decode-phase round committed (the prefill's first token of each prompt left out)
        "tokens_per_round": _ratio(tokens - len(runs), rounds),
        "coordination_ms_per_round": _ratio(sum(coordination_ms), rounds) if pipeline else None,
        "wire_bytes_per_round": _ratio(sum(wire_bytes), rounds) if pipeline else None,
        "rounds_per_drafter": rounds_per_drafter if pipeline else None,
        "draft_ahead_hit_rate": _ratio(sum(hits for _, hits in ahead), sum(checked for checked, _ in ahead)),
        # the hit rate of each branch, over the proposals checked
        "draft_ahead_hit_rate_per_branch": {
            branch: _ratio(count, sum(checked for checked, _ in ahead)) for branch, count in sorted(branch_hits.items())
        },
        # what the branches besides the main one bought: their hits per proposal drafted for them
        "hits_per_extra_branch": _ratio(
            sum(count for branch, count in branch_hits.items() if branch != "main"),
            sum(m.num_draft_ahead_branches or 0 for m in runs),
        ),
        "verify_costs": _verify_costs(runs),
    }


def _verify_costs(runs: list[Measurement]) -> dict[int, dict]:
    """Per number of new tokens of a decode-phase target forward: its rounds, and the mean ms of a
    verify call and of its forward (see :attr:`Measurement.verify_costs`)."""
    sums: dict[int, list[float]] = {}
    for m in runs:
        for n, rounds, call_ms, forward_ms in m.verify_costs:
            total = sums.setdefault(n, [0, 0.0, 0.0])
            total[0] += rounds
            total[1] += call_ms
            total[2] += forward_ms
    return {
        n: {"rounds": rounds, "call_ms": call_ms / rounds, "forward_ms": forward_ms / rounds}
        for n, (rounds, call_ms, forward_ms) in sorted(sums.items())
    }


def speedup_bound(tokens_per_round: float | None, step_ms: float | None, verify_ms: float | None) -> float | None:
    """The speedup over plain decoding if drafting and coordination took no time (the draft hidden
    behind verification): ``tokens_per_round`` (measured, so at the measured acceptance) times the
    plain decode step ``step_ms`` over the method's verify round ``verify_ms`` (both in ms). 1.0 for
    plain decoding; None where a figure is missing."""
    return _ratio(tokens_per_round * step_ms if tokens_per_round and step_ms else None, verify_ms)


def _against_baseline(stats: dict, plain: dict, k: int) -> dict:
    """Adds the speedup over plain, its bound and the share of the bound reached, and the formula's
    prediction (None for plain, or without drafts)."""
    stats["speedup"] = _ratio(stats["tokens_per_second"], plain["tokens_per_second"])
    step_ms = plain["verify_ms_per_round"]
    stats["speedup_bound"] = speedup_bound(stats["tokens_per_round"], step_ms, stats["verify_ms_per_round"])
    stats["share_of_bound"] = _ratio(stats["speedup"], stats["speedup_bound"])
    stats["predicted_speedup"] = None
    if k > 0 and stats["draft_acceptance_rate"] is not None and step_ms:
        stats["predicted_speedup"] = predicted_speedup(
            stats["draft_acceptance_rate"],
            k,
            (stats["draft_ms_per_token"] or 0.0) / step_ms,
            stats["verify_ms_per_round"] / step_ms,
        )
    return stats


def summarize(measurements: list[Measurement], method_ks: dict[str, int]) -> dict[str, dict[str, dict]]:
    """``{group: {method: stats}}`` for each category (in order of appearance) and ``overall``.
    ``method_ks`` maps each method to its K (0 for plain); it must include ``plain``."""
    groups: dict[str, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault(m.category, []).append(m)
    groups[OVERALL] = measurements
    summary = {}
    for group, runs in groups.items():
        plain = _stats([m for m in runs if m.method == BASELINE])
        summary[group] = {
            method: _against_baseline(_stats([m for m in runs if m.method == method]), plain, k)
            for method, k in method_ks.items()
        }
    return summary


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")


def _cell(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def speedup_table(report: dict) -> list[str]:
    """Methods x (categories, overall): speedup over plain; the plain row gives its tokens/s."""
    summary, groups = report["summary"], [*report["categories"], OVERALL]
    rows = []
    for method in report["methods"]:
        if method == BASELINE:
            rows.append(
                [f"{BASELINE} (tokens/s)", *(_cell(summary[g][method]["tokens_per_second"], ".1f") for g in groups)]
            )
        else:
            rows.append([method, *(_cell(summary[g][method]["speedup"], ".2f", "x") for g in groups)])
    return _table(["method", *groups], rows)


def overall_table(report: dict) -> list[str]:
    rows = []
    for method, s in report["summary"][OVERALL].items():
        rows.append(
            [
                method,
                _cell(s["tokens_per_second"], ".1f"),
                _cell(s["speedup"], ".2f", "x"),
                _cell(s["predicted_speedup"], ".2f", "x"),
                _cell(s.get("speedup_bound"), ".2f", "x"),
                _cell(s.get("share_of_bound"), ".0%"),
                _cell(s["tokens_per_target_forward"], ".2f"),
                _cell(s["draft_acceptance_rate"], ".3f"),
                _cell(s["identical_rate"], ".0%"),
                _cell(s["time_to_first_token_ms"], ".0f"),
            ]
        )
    return _table(
        [
            "method",
            "tokens/s",
            "speedup",
            "predicted",
            "bound",
            "share of bound",
            "tokens/target forward",
            "acceptance rate",
            "identical to plain",
            "TTFT ms",
        ],
        rows,
    )


def round_cost_table(report: dict) -> list[str]:
    rows = []
    for method, s in report["summary"][OVERALL].items():
        rows.append(
            [
                method,
                _cell(s["draft_ms_per_round"], ".1f"),
                _cell(s["verify_ms_per_round"], ".1f"),
                _cell(s["coordination_ms_per_round"], ".1f"),
                _cell(s["wire_bytes_per_round"], ".0f"),
                " ".join(map(str, s["acceptance_histogram"])) or "-",
                _drafter_shares(s["rounds_per_drafter"]),
                _cell(s["draft_ahead_hit_rate"], ".0%"),
                _branch_hits(s),
            ]
        )
    return _table(
        [
            "method",
            "draft ms",
            "verify ms",
            "coordination ms",
            "bytes",
            "acceptance histogram",
            "rounds by drafter",
            "draft-ahead hits",
            "by branch (hits per extra branch drafted)",
        ],
        rows,
    )


def _branch_hits(summary: dict) -> str:
    """``main 60%, bonus 5%, recovered 7% (0.31)``: each branch's hit rate, and the hits the extra
    branches bought per branch drafted; ``-`` without draft-ahead."""
    rates = summary.get("draft_ahead_hit_rate_per_branch") or {}
    if not rates:
        return "-"
    shares = ", ".join(f"{branch} {_cell(rate, '.0%')}" for branch, rate in rates.items())
    return f"{shares} ({_cell(summary.get('hits_per_extra_branch'), '.2f')})"


def verify_cost_table(report: dict, min_share: float = 0.2) -> list[str]:
    """Methods x tokens per forward (those making at least ``min_share`` of some method's rounds):
    the mean forward ms, and for the pipeline the verify call's ms after it."""
    summary = report["summary"][OVERALL]
    columns = set()
    for s in summary.values():
        total = sum(cost["rounds"] for cost in s["verify_costs"].values())
        columns |= {int(n) for n, cost in s["verify_costs"].items() if cost["rounds"] >= min_share * total}
    rows = []
    for method, s in summary.items():
        costs = {int(n): cost for n, cost in s["verify_costs"].items()}
        pipeline = s["coordination_ms_per_round"] is not None
        rows.append([method, *(_verify_cost_cell(costs.get(n), pipeline) for n in sorted(columns))])
    return _table(["method", *(f"{n} token{'s' * (n > 1)}" for n in sorted(columns))], rows)


def _verify_cost_cell(cost: dict | None, pipeline: bool) -> str:
    if cost is None:
        return "-"
    return f"{cost['forward_ms']:.1f} ({cost['call_ms']:.1f})" if pipeline else f"{cost['forward_ms']:.1f}"


def _drafter_shares(rounds_per_drafter: dict[str, int] | None) -> str:
    """``plain 10%, ngram 30%, llama-cpp 60%``: the share of rounds each drafter proposed in."""
    shares = rounds_per_drafter or {}
    total = sum(shares.values())
    if not total:
        return "-"
    return ", ".join(f"{name} {count / total:.0%}" for name, count in sorted(shares.items()) if count)


def machine_line(machine: dict) -> str:
    """The host as every report names it: CPU, cores, the instructions its kernels run on
    (:func:`specdec_app.bench.run.cpu_isa`; reports written before it lack them), device and
    versions. Step costs, and so every ratio, move with the instruction set: a figure is
    comparable only to one of the same host."""
    isa = machine.get("isa")
    kernels = ""
    if isa:
        bf16 = "yes" if isa["onednn_bf16"] else "no"
        kernels = f", {' '.join(isa['flags']) or 'no AVX2'} (ATen {isa['aten']} kernels, oneDNN bfloat16: {bf16})"
    return (
        f"{machine['cpu']}, {machine['cpu_count']} cores{kernels}, {machine['device']}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}"
    )


def _header(report: dict, title: str, details: str) -> list[str]:
    """A report's Markdown title, command and the line naming machine, models and ``details``."""
    machine, config = report["machine"], report["config"]
    return [
        f"# {title}",
        "",
        f"`{config['command']}`",
        "",
        f"{machine_line(machine)}; target `{config['target']}`, draft `{config['draft_model']}`, "
        f"{config['max_new_tokens']} new tokens, greedy{details}",
    ]


PLACEMENT_TEXTS = {
    "shared": "shared: every process on every core",
    "split": "split: draft service on one CPU, verify service on another, one thread each; plain on every core, "
    "plain/verify-cpu pinned to the verify service's CPU",
}


def _placement(report: dict) -> str:
    """The line saying where the processes ran (see :mod:`specdec_app.bench.cpu_pinning`)."""
    names = report["config"]["placements"]
    if len(names) == 1:
        return f"placement {PLACEMENT_TEXTS[names[0]]}"
    return "placements (pipeline `<method>@<placement>`): " + "; ".join(PLACEMENT_TEXTS[name] for name in names)


# A network between the services (specdec_app.bench.network): methods named <method><@placement><@rtt...>.

K0_METHOD = "pipeline/K=0"  # the pipeline's plain decode: the reference at the same RTT
NETWORK_NOTES = [
    "Each pipeline method ran under each network setting on the same services: the coordinator reaches the "
    "draft and the verify service through delaying TCP proxies (specdec_app/bench/network.py), each direction "
    "of a delayed link held RTT/2 (+- jitter/2); RTT 0: the same proxies without delay. The client's link to "
    "the coordinator is not delayed.",
    "vs K=0: tokens/s over pipeline/K=0's under the same setting (and placement; in the load mode the same "
    "arrival pattern and N).",
    "coordination ms/round: RequestMetrics.coordination_time_ms summed / rounds (Verify and Decode calls): a "
    "round's wall time less the time it waited for its draft proposal and less the verify service's compute, "
    "at least 0 (a Decode sent ahead ran before its round began). It holds the Verify or Decode call's round "
    "trip, a Propose asked for in the round (on a draft-ahead miss), gRPC and the coordinator's work; the part "
    "of a drafted-ahead Propose's round trip that the verify did not hide is in the draft wait instead. over "
    "RTT 0: the same method's coordination ms/round at RTT 0 subtracted (what the delay added to each round); "
    "/ RTT: that in round trips.",
    "bytes/round: RequestMetrics.round_wire_bytes summed / rounds: the rounds' Propose, Verify and Decode "
    "protobuf payloads both ways (no gRPC framing, prefill not included).",
]


def _renamed(name: str, base: str) -> str:
    """``name`` with its base (the part before the first ``@``) replaced by ``base``."""
    return base + name[len(name.partition("@")[0]) :]


def _network_figures(stats: dict, k0: dict | None, zero: dict | None, setting: NetworkSetting) -> dict:
    """The figures every network row gives: the setting, tokens/s, the ratio to ``k0`` (the
    pipeline's K = 0 under the same setting), coordination ms per round and what it adds over
    ``zero`` (the same method at RTT 0), in ms and in RTTs, and bytes per round."""
    coordination = stats.get("coordination_ms_per_round")
    at_zero = (zero or {}).get("coordination_ms_per_round")
    added = coordination - at_zero if coordination is not None and at_zero is not None else None
    return {
        "rtt_ms": setting.rtt_ms,
        "topology": setting.topology if setting.rtt_ms else None,
        "tokens_per_second": stats.get("tokens_per_second"),
        "k0_ratio": _ratio(stats.get("tokens_per_second"), (k0 or {}).get("tokens_per_second")),
        "coordination_ms_per_round": coordination,
        "coordination_over_rtt0_ms": added,
        "coordination_over_rtt0_rtts": _ratio(added, setting.rtt_ms) if added is not None else None,
        "wire_bytes_per_round": stats.get("wire_bytes_per_round"),
    }


def network_rows(report: dict) -> list[dict]:
    """Batch 1 under a network: per pipeline method (placement included) and setting, overall:
    :func:`_network_figures`, the speedup over plain decoding in process, TTFT, and a round's
    mean ms (draft wait + verify compute + coordination) and draft wait ms."""
    overall = report["summary"][OVERALL]
    rows = []
    for method in report["methods"]:
        rest, setting = split_setting(method)
        if setting is None:
            continue
        s = overall[method]
        parts = [s.get(key) for key in ("draft_ms_per_round", "verify_ms_per_round", "coordination_ms_per_round")]
        k0, zero = overall.get(_renamed(rest, K0_METHOD) + setting.suffix), overall.get(rest + "@rtt0ms")
        rows.append(
            {"method": rest}
            | _network_figures(s, k0, zero, setting)
            | {
                "speedup": s.get("speedup"),
                "ttft_ms": s.get("time_to_first_token_ms"),
                "round_ms": sum(parts) if None not in parts else None,  # type: ignore[arg-type]
                "draft_wait_ms_per_round": s.get("draft_ms_per_round"),
            }
        )
    return rows


def concurrency_network_rows(report: dict) -> list[dict]:
    """The load mode under a network: per cell of a method run under a setting
    (:func:`_network_figures` against K = 0 and RTT 0 in the same pattern and N), TTFT and ITL p50;
    over repeats on the medians (:func:`cell_summaries`)."""
    stats = {(c["arrivals"], c["method"], c["concurrency"]): c["stats"] for c in cell_summaries(report)}
    rows = []
    for (arrivals, method, n), s in stats.items():
        rest, setting = split_setting(method)
        if setting is None:
            continue
        k0 = stats.get((arrivals, K0_METHOD + setting.suffix, n))
        zero = stats.get((arrivals, rest + "@rtt0ms", n))
        rows.append(
            {"arrivals": arrivals, "concurrency": n, "method": rest}
            | _network_figures(s, k0, zero, setting)
            | {"ttft_ms_p50": s.get("ttft_ms_p50"), "itl_ms_p50": s.get("itl_ms_p50")}
        )
    return rows


def _network_cells(row: dict) -> list[str]:
    return [
        _cell(row["rtt_ms"], "g"),
        row["topology"] or "-",
        _cell(row["tokens_per_second"], ".1f"),
        _cell(row["k0_ratio"], ".2f", "x"),
        _cell(row["coordination_ms_per_round"], ".1f"),
        _cell(row["coordination_over_rtt0_ms"], "+.1f"),
        _cell(row["coordination_over_rtt0_rtts"], ".2f"),
        _cell(row["wire_bytes_per_round"], ".0f"),
    ]


_NETWORK_HEADER = [
    "RTT ms",
    "topology",
    "tokens/s",
    "vs K=0",
    "coordination ms/round",
    "over RTT 0",
    "/ RTT",
    "bytes/round",
]


def network_table(report: dict) -> list[str]:
    """Batch 1: :func:`network_rows` as a table."""
    rows = [
        [
            row["method"],
            *_network_cells(row),
            _cell(row["speedup"], ".2f", "x"),
            _cell(row["ttft_ms"], ".0f"),
            _cell(row["round_ms"], ".1f"),
            _cell(row["draft_wait_ms_per_round"], ".1f"),
        ]
        for row in report.get("network", {}).get("rows", [])
    ]
    header = ["method", *_NETWORK_HEADER, "speedup over plain", "TTFT ms", "round ms", "draft wait ms/round"]
    return _table(header, rows)


def concurrency_network_table(report: dict) -> list[str]:
    """The load mode: :func:`concurrency_network_rows` as a table."""
    rows = [
        [
            row["arrivals"],
            str(row["concurrency"]),
            row["method"],
            *_network_cells(row),
            _cell(row["ttft_ms_p50"], ".0f"),
            _cell(row["itl_ms_p50"], ".1f"),
        ]
        for row in report.get("network", {}).get("rows", [])
    ]
    return _table(["arrivals", "N", "method", *_NETWORK_HEADER, "TTFT p50 ms", "ITL p50 ms"], rows)


def network_section(report: dict, table: list[str]) -> list[str]:
    """The Markdown section of a report run under a network (none without one)."""
    network = report.get("network")
    if not network:
        return []
    jitter = f", jitter {network['jitter_ms']:g} ms" if network["jitter_ms"] else ""
    return [
        "## A network between the services",
        "",
        f"RTTs {', '.join(f'{rtt:g}' for rtt in network['rtts_ms'])} ms{jitter}; topologies "
        f"{', '.join(network['topologies'])}.",
        "",
        *(f"- {note}" for note in NETWORK_NOTES),
        "",
        *table,
        "",
    ]


def to_markdown(report: dict) -> str:
    """The report as Markdown: speedups per category, the overall figures, round costs, memory."""
    lines = [
        *_header(report, "specdec bench", f", {report['num_questions']} prompts; {_placement(report)}."),
        "",
        "## Speedup over plain decoding (ratio of tokens/s)",
        "",
        *speedup_table(report),
        "",
        "## Overall",
        "",
        "`predicted`: the design brief's formula from the measured acceptance rate and step costs. "
        "`bound`: the speedup on this host if drafting and coordination took no time (tokens per decode "
        "round * plain's step ms / the method's verify ms per round); `share of bound`: speedup / bound.",
        "",
        *overall_table(report),
        "",
        "## Per round (overall): ms per target forward after prefill, protobuf bytes per round",
        "",
        "`draft ms`: the time a round waited for its proposal (0 when it was drafted ahead during the "
        "previous round's verification and ready); `verify ms`: the pipeline's Verify or Decode call in the "
        "verify service, against the in-process forward of `plain` and the `hf-*` methods; `draft-ahead hits`: "
        "the share of proposals drafted ahead that the next round could use.",
        "",
        *round_cost_table(report),
        "",
        "## Verify cost by tokens per forward (overall, ms)",
        "",
        "The mean forward of the target over that many new tokens: in process for `plain` and the `hf-*` "
        "methods, in the verify service's step for the pipeline, followed by the service's handling of the call "
        "(queue included) in brackets. The gRPC hop and the coordinator's work are the `coordination ms` above.",
        "",
        *verify_cost_table(report),
        "",
        *network_section(report, network_table(report)),
        "## Peak resident memory",
        "",
        *(
            f"- {name}: {_cell(value and value / 2**20, '.0f', ' MiB')}"
            for name, value in report["peak_rss_bytes"].items()
        ),
        "",
    ]
    if report["mismatches"]:
        lines += ["## Token ids that differ from plain decoding", ""]
        lines += [
            f"- {m['method']} on question {m['question_id']} ({m['category']}): first at token {m['first_mismatch']}"
            for m in report["mismatches"]
        ]
        lines.append("")
    return "\n".join(lines)


def write_markdown(report: dict, path: Path) -> None:
    path.write_text(to_markdown(report))


# ``specdec bench concurrency``: load, one cell per (arrival pattern, method, N). The functions below
# read the JSON request records of specdec_app.bench.concurrency (plain dicts), so a report can be
# recomputed from report-concurrency.json alone.


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def weighted_mean(pairs: list[tuple[float | None, float]]) -> float | None:
    """sum(value * weight) / sum(weight) over the pairs whose value is not None; None when no
    weight remains (e.g. every value None: a method that does not report it)."""
    kept = [(value, weight) for value, weight in pairs if value is not None]
    total = sum(weight for _, weight in kept)
    return sum(value * weight for value, weight in kept) / total if total else None


def merge_rounds_per_k(histograms: list[list[int] | None]) -> list[int]:
    """Element-wise sum of ``rounds_per_k`` lists (index K: rounds that asked for K drafts)."""
    merged: list[int] = []
    for histogram in histograms:
        for k, count in enumerate(histogram or []):
            if k == len(merged):
                merged.append(0)
            merged[k] += count
    return merged


def merge_drafter_usage(usages: list[dict[str, list[int]] | None]) -> dict[str, list[int]]:
    """Per drafter, the sum of ``drafter_usage`` entries ([rounds, draft tokens, accepted tokens])."""
    merged: dict[str, list[int]] = {}
    for usage in usages:
        for name, counts in (usage or {}).items():
            merged[name] = [a + b for a, b in zip(merged.get(name, [0, 0, 0]), counts, strict=True)]
    return dict(sorted(merged.items()))


def mean_k(rounds_per_k: list[int]) -> float | None:
    """The mean K over rounds, plain rounds (K = 0) included; None without rounds."""
    rounds = sum(rounds_per_k)
    return sum(k * count for k, count in enumerate(rounds_per_k)) / rounds if rounds else None


@dataclass(frozen=True)
class Slo:
    """The service-level objectives of goodput, ms: a request is good when its TTFT and its TPOT
    are each at most these (``vllm bench serve --goodput ttft:<ms> tpot:<ms>``)."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0

    def met_by(self, record: dict) -> bool:
        """Whether a completed request record meets both; a request of one token has TPOT 0 (as
        in vLLM), one without a token has no TTFT and does not."""
        ttft, tpot = record["ttft_ms"], record["tpot_ms"] or 0.0
        return ttft is not None and ttft <= self.ttft_ms and tpot <= self.tpot_ms


DEFAULT_SLO = Slo()


def goodput(done: list[dict], wall_ms: float, slo: Slo) -> dict:
    """The completed requests ``done`` that meet ``slo``: their count, and per second of
    ``wall_ms`` the requests and their output tokens."""
    good = [r for r in done if slo.met_by(r)]
    return {
        "num_good": len(good),
        "goodput_requests_per_second": _ratio(len(good) * 1000.0, wall_ms),
        "goodput_tokens_per_second": _ratio(sum(r["num_tokens"] for r in good) * 1000.0, wall_ms),
    }


def concurrency_cell_stats(
    records: list[dict], wall_ms: float, cpu_s: dict[str, float | None] | None = None, slo: Slo = DEFAULT_SLO
) -> dict:
    """One (arrival pattern, method, N) cell from its request records (see ``RequestRecord`` in
    specdec_app.bench.concurrency), its wall time (first request sent to last one finished),
    the CPU seconds each process used during it (``cpu_s``, process name -> s; None: not read) and
    the goodput's objectives (``slo``):

    - ``tokens_per_second``: every completed request's output tokens / the cell's wall time;
    - ``rounds_per_second``: the pipeline's rounds (Verify and Decode calls) / the wall time;
    - ``cpu_ms_per_token``: per process, its CPU ms / the cell's output tokens;
    - ``requests_per_second``: completed requests / the wall time;
    - ``ttft_ms_p50``/``p99``, ``tpot_ms_p50``/``p99``: per-request percentiles (TPOT = the time
      after the first token / the tokens after the first; requests of one token have none);
    - ``itl_ms_p50``/``p99``: percentiles of every request's ``itl_ms`` pooled (vLLM's ITL: one
      gap per streamed message after the first, whatever its number of tokens);
    - ``num_good``, ``goodput_requests_per_second``, ``goodput_tokens_per_second``: :func:`goodput`;
    - ``coordination_ms_per_round``, ``wire_bytes_per_round``: the pipeline's
      ``coordination_time_ms`` and ``round_wire_bytes`` summed over the cell / its rounds (the
      rounds' time besides the draft's and the verify's compute; their protobuf bytes);
    - ``mean_batch_size``, ``mean_batched_tokens``: the pipeline's per-request means weighted by
      the request's rounds (``num_rounds``: Verify and Decode calls); ``queue_ms_per_round``: all
      queue time / all rounds; None where the method does not report them;
    - ``acceptance_rate``: accepted / drafted tokens over the cell; ``mean_k`` over all rounds;
      ``drafter_usage``: per drafter, [rounds, draft tokens, accepted tokens] over the cell;
    - ``identical_rate``: share of the requests compared with the reference that are identical.
    Failed requests (``error`` set) count only in ``num_failed``."""
    done = [r for r in records if not r.get("error")]
    tokens = sum(r["num_tokens"] for r in done)
    ttft = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in done if r["tpot_ms"] is not None]
    itl = [gap for r in done for gap in r.get("itl_ms") or []]
    coordination = [r["coordination_ms"] for r in done if r.get("coordination_ms") is not None]
    wire = [r["wire_bytes"] for r in done if r.get("wire_bytes") is not None]
    drafted = sum(r["num_draft_tokens"] or 0 for r in done)
    accepted = sum(r["num_accepted_tokens"] or 0 for r in done)
    rounds = sum(r["num_rounds"] or 0 for r in done)
    queue = [r["queue_time_ms"] for r in done if r["queue_time_ms"] is not None]
    rounds_per_k = merge_rounds_per_k([r["rounds_per_k"] for r in done])
    compared = [r["identical"] for r in done if r["identical"] is not None]
    pipeline = any(r["num_rounds"] is not None for r in done)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(done),
        "num_tokens": tokens,
        "wall_ms": wall_ms,
        "tokens_per_second": _ratio(tokens * 1000.0, wall_ms),
        "requests_per_second": _ratio(len(done) * 1000.0, wall_ms),
        "rounds_per_second": _ratio(rounds * 1000.0, wall_ms) if pipeline else None,
        "cpu_ms_per_token": ms_per_token(cpu_s or {}, tokens),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p99": percentile(itl, 99),
        **goodput(done, wall_ms, slo),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "coordination_ms_per_round": _ratio(sum(coordination), rounds) if coordination else None,
        "wire_bytes_per_round": _ratio(sum(wire), rounds) if wire else None,
        "latency_ms_p50": percentile([r["latency_ms"] for r in done], 50),
        "mean_batch_size": weighted_mean([(r["mean_batch_size"], r["num_rounds"] or 0) for r in done]),
        "mean_batched_tokens": weighted_mean([(r["mean_batched_tokens"], r["num_rounds"] or 0) for r in done]),
        "queue_ms_per_round": _ratio(sum(queue), rounds) if queue else None,
        "num_draft_tokens": drafted if pipeline else None,
        "num_accepted_tokens": accepted if pipeline else None,
        "acceptance_rate": _ratio(accepted, drafted),
        "rounds_per_k": rounds_per_k if pipeline else None,
        "mean_k": mean_k(rounds_per_k),
        "drafter_usage": merge_drafter_usage([r.get("drafter_usage") for r in done]) if pipeline else None,
        "num_compared": len(compared),
        "identical_rate": sum(compared) / len(compared) if compared else None,
    }


# Repeats (``--repeat R``): every (arrival pattern, method, N) ran R times, the methods interleaved
# (A B C, A B C, ...). The tables read each as its repeats' medians (:func:`summarize_repeats`), and
# a ratio of two methods repeat by repeat (:func:`repeat_ratio`). A report from before repeats has
# one cell per (arrival pattern, method, N), read as its only repeat.

# the figures of a cell's stats that count (requests, tokens): summed over the repeats, not medians
SUMMED_FIGURES = (
    "num_requests",
    "num_failed",
    "num_tokens",
    "num_good",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_compared",
)


class Spread(TypedDict):
    """A figure over the repeats of a cell: its median, its range (``min``-``max``) and the
    number of repeats that had it."""

    median: float
    min: float
    max: float
    num_repeats: int


def spread(values: Iterable[float | None]) -> Spread | None:
    """The :class:`Spread` of ``values`` (one per repeat) that are not None; the median of an
    even number of values is the mean of the middle two. None when every value is None."""
    kept = [value for value in values if value is not None]
    return _spread(kept) if kept else None


def _spread(values: list[float]) -> Spread:
    """:func:`spread` of values that are all there (at least one)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "num_repeats": len(values)}


def _repeat(cell: dict) -> int:
    """A cell's repeat index (0-based; 0 in a report from before repeats)."""
    return cell.get("repeat", 0)


def cell_repeats(report: dict, arrivals: str | None = None) -> dict[tuple[str, str, int], list[dict]]:
    """The report's cells of the arrival pattern ``arrivals`` (None: every pattern) grouped by
    (arrival pattern, method, N), in the order the report first lists them, each group's cells
    in repeat order. A cell without ``arrivals`` is a closed-loop cell (a report from before the
    patterns)."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for cell in report["cells"]:
        pattern = cell.get("arrivals", "closed")
        if arrivals is None or pattern == arrivals:
            groups.setdefault((pattern, cell["method"], cell["concurrency"]), []).append(cell)
    return {key: sorted(cells, key=_repeat) for key, cells in groups.items()}


def summarize_repeats(cells: list[dict]) -> dict:
    """One (arrival pattern, method, N) over its repeats ``cells`` (a group of
    :func:`cell_repeats`): ``stats`` in the shape of one cell's (:func:`concurrency_cell_stats`),
    with the counts of :data:`SUMMED_FIGURES`, ``rounds_per_k`` and ``drafter_usage`` summed over
    the repeats, ``identical_rate`` over every repeat's compared requests (an output that differs
    in any repeat shows), and every other figure the median over the repeats (per process for
    ``cpu_ms_per_token``); ``spreads``: each scalar median figure's :class:`Spread`;
    ``num_repeats``; ``errors``: every repeat's. One repeat reads as the cell itself."""
    stats = [cell["stats"] for cell in cells]
    medians: dict = {}
    spreads: dict[str, Spread] = {}
    for key in dict.fromkeys(key for s in stats for key in s):
        kept = [s[key] for s in stats if s.get(key) is not None]
        if not kept:
            medians[key] = None
        elif key in SUMMED_FIGURES:
            medians[key] = sum(kept)
        elif key == "rounds_per_k":
            medians[key] = merge_rounds_per_k(kept)
        elif key == "drafter_usage":
            medians[key] = merge_drafter_usage(kept)
        elif key == "identical_rate":
            medians[key] = weighted_mean([(s.get(key), s.get("num_compared", 1)) for s in stats])
        elif isinstance(kept[0], dict):  # per process (cpu_ms_per_token), or the SLOs
            names = dict.fromkeys(name for value in kept for name in value)
            medians[key] = {name: _median(value.get(name) for value in kept) for name in names}
        else:
            spreads[key] = _spread(kept)
            medians[key] = spreads[key]["median"]
    first = cells[0]
    return {
        "arrivals": first.get("arrivals", "closed"),
        "method": first["method"],
        "concurrency": first["concurrency"],
        "num_repeats": len(cells),
        "stats": medians,
        "spreads": spreads,
        "errors": sorted({error for cell in cells for error in cell.get("errors", [])}),
    }


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None for none)."""
    found = spread(values)
    return found["median"] if found else None


def cell_summaries(report: dict) -> list[dict]:
    """:func:`summarize_repeats` of every (arrival pattern, method, N) of the report, in its
    order: what every table of the load report reads (``cell_summaries`` in its JSON)."""
    return [summarize_repeats(cells) for cells in cell_repeats(report).values()]


def tokens_per_second(stats: dict) -> float | None:
    """A cell's output tokens/s (the figure :func:`repeat_ratio` compares by default)."""
    return stats.get("tokens_per_second")


def repeat_ratio(
    numerator: list[dict], denominator: list[dict], figure: Callable[[dict], float | None] = tokens_per_second
) -> Spread | None:
    """``figure`` of the cells ``numerator`` over that of the cells ``denominator`` (the repeats
    of two methods at one arrival pattern and N), repeat by repeat: the ratio of the two cells of
    each repeat index, which ran side by side in the interleaved order, then their
    :class:`Spread`. Not the ratio of the medians: what slowed one repeat of both methods alike
    (the machine's noise) cancels within the repeat. None without a repeat both have."""
    below = {_repeat(cell): figure(cell["stats"]) for cell in denominator}
    return spread(_ratio(figure(cell["stats"]), below.get(_repeat(cell))) for cell in numerator)


def _spread_text(found: Spread | None, spec: str, suffix: str = "") -> str:
    """``45.1 (43.0-46.2)``: the median and, over two repeats or more, the range; ``-`` for None."""
    if found is None:
        return "-"
    text = f"{found['median']:{spec}}{suffix}"
    if found["num_repeats"] > 1:
        text += f" ({found['min']:{spec}}-{found['max']:{spec}}{suffix})"
    return text


def concurrency_table(report: dict, arrivals: str | None = None) -> list[str]:
    """One row per (method, N) of the pattern ``arrivals`` (None: every cell): throughput, latency
    percentiles, batching, acceptance, identity; over repeats the medians
    (:func:`summarize_repeats`: the requests of every repeat), tokens/s with its range."""
    rows = []
    for summary in map(summarize_repeats, cell_repeats(report, arrivals).values()):
        s = summary["stats"]
        rows.append(
            [
                summary["method"],
                str(summary["concurrency"]),
                f"{s['num_requests'] - s['num_failed']}/{s['num_requests']}",
                _spread_text(summary["spreads"].get("tokens_per_second"), ".1f"),
                _cell(s.get("rounds_per_second"), ".1f"),
                _cell(s["tpot_ms_p50"], ".1f"),
                _cell(s["tpot_ms_p99"], ".1f"),
                _cell(s["ttft_ms_p50"], ".0f"),
                _cell(s["ttft_ms_p99"], ".0f"),
                _cell(s.get("itl_ms_p50"), ".1f"),
                _cell(s.get("itl_ms_p99"), ".1f"),
                _cell(s.get("goodput_requests_per_second"), ".2f"),
                _cell(s.get("goodput_tokens_per_second"), ".1f"),
                _cell(s["mean_batch_size"], ".2f"),
                _cell(s["mean_batched_tokens"], ".1f"),
                _cell(s["queue_ms_per_round"], ".1f"),
                _cell(s["acceptance_rate"], ".3f"),
                _cell(s["mean_k"], ".2f"),
                _cell(s["identical_rate"], ".0%"),
            ]
        )
    return _table(
        [
            "method",
            "N",
            "requests ok",
            "tokens/s",
            "rounds/s",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "goodput req/s",
            "goodput tokens/s",
            "batch size",
            "batched tokens",
            "queue ms/round",
            "acceptance",
            "mean K",
            "identical",
        ],
        rows,
    )


def _short(method: str) -> str:
    return base_method(method).removeprefix("pipeline/").replace("transformers-serve", "serve")


def _suffix(method: str) -> str:
    """What follows a method's base name (``@rtt5ms-apart``: its network setting); empty for none."""
    return method[len(base_method(method)) :]


def _cell_group(report: dict, arrivals: str, suffix: str | None) -> tuple[list[str], dict[tuple[str, int], list[dict]]]:
    """The methods of the pattern ``arrivals`` that ran under the network setting ``suffix``
    (and those that ran without one, transformers serve; None: every method), in the report's
    order, and their cells by (method, N), each in repeat order (:func:`cell_repeats`)."""
    groups = cell_repeats(report, arrivals)
    methods = [
        m
        for m in report["methods"]
        if any(method == m for _, method, _ in groups) and (suffix is None or _suffix(m) in ("", suffix))
    ]
    return methods, {(m, n): cells for (_, m, n), cells in groups.items() if m in methods}


def best_fixed_k_cells(report: dict, arrivals: str, suffix: str | None = None) -> list[dict]:
    """Per N of the pattern ``arrivals`` (under the network setting ``suffix``): the fixed-K
    pipeline method with the most tokens/s (:func:`load_methods.best_fixed_k`) on the medians
    over the repeats, its median tokens/s, and ``pipeline/adaptive``'s tokens/s over it repeat
    by repeat (:func:`repeat_ratio`): ``adaptive_ratio`` the median, ``adaptive_ratio_spread``
    its :class:`Spread` (both None where adaptive did not run). Empty without a fixed-K method."""
    methods, groups = _cell_group(report, arrivals, suffix)
    adaptive = next((m for m in methods if base_method(m) == ADAPTIVE), None)
    found = []
    for n in sorted({n for _, n in groups}):
        rates = {m: _median(tokens_per_second(c["stats"]) for c in groups.get((m, n), [])) for m in methods}
        best = best_fixed_k(rates)
        if best is not None:
            ratio = repeat_ratio(groups.get((adaptive, n), []), groups[(best, n)]) if adaptive else None
            found.append(
                {
                    "arrivals": arrivals,
                    "network": suffix or None,
                    "concurrency": n,
                    "method": best,
                    "k": requested_k(best),
                    "tokens_per_second": rates[best],
                    "adaptive_ratio": ratio["median"] if ratio else None,
                    "adaptive_ratio_spread": ratio,
                }
            )
    return found


def _ratio_pairs(report: dict, methods: list[str]) -> list[tuple[str, str]]:
    """The (numerator, denominator) pairs of ``report["ratios"]`` whose methods are both in ``methods``."""
    return [(a, b) for a, b in report.get("ratios", []) if a in methods and b in methods]


def ratio_cells(report: dict, arrivals: str, suffix: str | None = None) -> list[dict]:
    """Per N of the pattern ``arrivals`` (under the network setting ``suffix``; None: every
    method) and pair of ``report["ratios"]`` whose methods both ran: the numerator's tokens/s over
    the denominator's repeat by repeat (:func:`repeat_ratio`), as ``tokens_per_second_ratio``
    (None without a repeat both ran)."""
    methods, groups = _cell_group(report, arrivals, suffix)
    pairs = _ratio_pairs(report, methods)
    return [
        {
            "arrivals": arrivals,
            "concurrency": n,
            "numerator": a,
            "denominator": b,
            "tokens_per_second_ratio": repeat_ratio(groups.get((a, n), []), groups.get((b, n), [])),
        }
        for n in sorted({n for _, n in groups})
        for a, b in pairs
    ]


def comparison_table(report: dict, arrivals: str, suffix: str | None = None) -> list[str]:
    """One row per N of the pattern ``arrivals`` (under the network setting ``suffix``; None:
    every method): each method's tokens/s and TTFT p50, the tokens/s ratios of
    ``report["ratios"]`` (pairs of methods that both ran, :func:`ratio_cells`), with two fixed Ks
    or more the best fixed K and adaptive's ratio to it (:func:`best_fixed_k_cells`), and each
    method's share of requests identical to the reference. Over repeats: the medians
    (:func:`summarize_repeats`), tokens/s and the ratios with their ranges."""
    methods, groups = _cell_group(report, arrivals, suffix)
    summaries = {key: summarize_repeats(cells) for key, cells in groups.items()}
    ratios = _ratio_pairs(report, methods)
    ratio = {
        (r["concurrency"], r["numerator"], r["denominator"]): r["tokens_per_second_ratio"]
        for r in ratio_cells(report, arrivals, suffix)
    }
    best = {b["concurrency"]: b for b in best_fixed_k_cells(report, arrivals, suffix)}
    with_best = sum(is_fixed_k(m) for m in methods) >= 2
    rows = []
    for n in sorted({n for _, n in groups}):
        got = {m: summaries.get((m, n)) or {"stats": {}, "spreads": {}} for m in methods}
        found = best.get(n) or {}
        rows.append(
            [
                str(n),
                *(_spread_text(got[m]["spreads"].get("tokens_per_second"), ".1f") for m in methods),
                *(_cell(got[m]["stats"].get("ttft_ms_p50"), ".0f") for m in methods),
                *(_spread_text(ratio[(n, a, b)], ".2f", "x") for a, b in ratios),
                *(
                    [_cell(found.get("k"), "d"), _spread_text(found.get("adaptive_ratio_spread"), ".2f", "x")]
                    if with_best
                    else []
                ),
                *(_cell(got[m]["stats"].get("identical_rate"), ".0%") for m in methods),
            ]
        )
    return _table(
        [
            "N",
            *(f"{base_method(m)} tokens/s" for m in methods),
            *(f"{_short(m)} TTFT p50 ms" for m in methods),
            *(f"{_short(a)} / {_short(b)}" for a, b in ratios),
            *(["best fixed K", "adaptive / best fixed K"] if with_best else []),
            *(f"{_short(m)} identical" for m in methods),
        ],
        rows,
    )


def cpu_table(report: dict) -> list[str]:
    """One row per (arrival pattern, method, N): tokens/s, rounds/s and each process's CPU ms per
    generated token during the cell; over repeats the medians (:func:`summarize_repeats`),
    tokens/s with its range."""
    summaries = cell_summaries(report)
    processes = list(dict.fromkeys(p for c in summaries for p in c["stats"].get("cpu_ms_per_token") or {}))
    rows = [
        [
            c["arrivals"],
            c["method"],
            str(c["concurrency"]),
            _spread_text(c["spreads"].get("tokens_per_second"), ".1f"),
            _cell(c["stats"].get("rounds_per_second"), ".1f"),
            *(_cell((c["stats"].get("cpu_ms_per_token") or {}).get(p), ".3f") for p in processes),
        ]
        for c in summaries
    ]
    return _table(["arrivals", "method", "N", "tokens/s", "rounds/s", *(f"{p} CPU ms/token" for p in processes)], rows)


def identity_table(report: dict) -> list[str]:
    """Per method: the share of its requests (all N) identical to the reference, and of those
    whose prompt had as many tokens as the reference's (the same chat template applied)."""
    rows = [
        [method, str(s["num_compared"]), _cell(s["identical_rate"], ".0%"), _cell(s["prompt_tokens_agree_rate"], ".0%")]
        for method, s in report["identity"].items()
    ]
    return _table(["method", "requests compared", "identical to the reference", "same prompt length"], rows)


ARRIVAL_TEXTS = {
    "closed": "N clients, each sending its next request when its previous one finished",
    "burst": "N requests sent at once; the cell ends when the last finishes",
    "poisson": "N x requests-per-client requests arriving at a Poisson rate of N x {rate} requests/s (seeded: the "
    "same arrival times for every method)",
}


def arrival_patterns(report: dict) -> list[str]:
    """The report's arrival patterns in their order (a report from before them: closed)."""
    return (report.get("arrivals") or {}).get("patterns") or ["closed"]


def _pattern_section(report: dict, arrivals: str) -> list[str]:
    """The Markdown section of one arrival pattern: what it is, the comparison across methods per
    N, then every cell's figures."""
    rate = (report.get("arrivals") or {}).get("poisson_rate_per_client_hz")
    prompts = ((report.get("arrivals") or {}).get("prompts") or {}).get(arrivals)
    return [
        f"## Arrivals: {arrivals}",
        "",
        ARRIVAL_TEXTS[arrivals].format(rate=_cell(rate, ".4f"))
        + (f"; its own {len(prompts)} prompts (question ids {', '.join(map(str, prompts))})." if prompts else "."),
        "",
        *comparison_tables(report, arrivals),
        *concurrency_table(report, arrivals),
        "",
    ]


def comparison_tables(report: dict, arrivals: str) -> list[str]:
    """:func:`comparison_table` of the pattern ``arrivals``: one, or under a network one per
    setting (its methods and those that ran without one), each under the setting's label."""
    settings = (report.get("network") or {}).get("settings")
    if not settings:
        return [*comparison_table(report, arrivals), ""]
    return [
        line
        for setting in settings
        for line in [f"### {setting['label']}", "", *comparison_table(report, arrivals, setting["suffix"]), ""]
    ]


def _slo_text(config: dict) -> str:
    """``; goodput SLOs TTFT <= 2000 ms, TPOT <= 200 ms`` (empty for a report from before them)."""
    if "slo_ttft_ms" not in config:
        return ""
    return f"; goodput SLOs TTFT <= {config['slo_ttft_ms']:g} ms, TPOT <= {config['slo_tpot_ms']:g} ms"


def _num_repeats(config: dict) -> int:
    """The repeats of each cell (``--repeat``; 1 in a report from before repeats)."""
    return config.get("repeat", 1)


def _repeats_text(config: dict) -> str:
    """``; every cell 3 times, ...``: how the tables read the repeats (empty for one)."""
    repeats = _num_repeats(config)
    if repeats == 1:
        return ""
    return (
        f"; every cell {repeats} times, the methods interleaved: each figure the median over the repeats, "
        "tokens/s and the ratios followed by their range (min-max), each ratio taken within a repeat"
    )


def concurrency_markdown(report: dict) -> str:
    """The ``specdec bench concurrency`` report as Markdown: command, machine, the per-cell table, identity
    per method, the prompts that differ (with the target's top-2 logit margin there), memory."""
    config = report["config"]
    lines = [
        *_header(
            report,
            "specdec bench concurrency",
            f"; drafter `{config['drafter']}`; pipeline API `{config.get('api', 'grpc')}`; arrivals "
            f"{', '.join(arrival_patterns(report))}; {config['requests_per_client']} requests per client "
            f"per cell, over {report['num_questions']} prompts (categories round-robin){_slo_text(config)}"
            f"{_repeats_text(config)}.",
        ),
        "",
        *(f"- {note}" for note in report["notes"]),
        "",
        *(line for arrivals in arrival_patterns(report) for line in _pattern_section(report, arrivals)),
        *network_section(report, concurrency_network_table(report)),
        "## CPU time per generated token, per process",
        "",
        *cpu_table(report),
        "",
        f"## Greedy identity (reference: {report['reference']['method']} at N=1)",
        "",
        *(
            identity_table(report)
            if report["reference"]["num_prompts"]
            else ["No reference: the pipeline did not run (identity needs its K=0 outputs)."]
        ),
        "",
    ]
    if report["mismatches"]:
        lines += [
            "## Outputs that differ from the reference",
            "",
            "`margin`: the target's top-2 logit difference at the first differing position (one forward "
            "over the prompt and the reference's tokens before it, in the bench process).",
            "",
        ]
        repeats = _num_repeats(config) > 1  # (a column of its own only then)
        rows = [
            [
                m.get("arrivals", "closed"),
                m["method"],
                str(m["concurrency"]),
                *([str(m.get("repeat", 0))] * repeats),
                str(m["question_id"]),
                str(m["first_mismatch"]),
                _cell(m.get("margin"), ".4f"),
                _cell(m.get("reference_token"), "d"),
                _cell(m.get("token"), "d"),
            ]
            for m in report["mismatches"]
        ]
        lines += _table(
            [
                "arrivals",
                "method",
                "N",
                *(["repeat"] * repeats),
                "question",
                "first differing token",
                "margin",
                "reference token",
                "its token",
            ],
            rows,
        )
        lines.append("")
    lines += [
        "## Peak resident memory",
        "",
        *(
            f"- {name}: {_cell(value and value / 2**20, '.0f', ' MiB')}"
            for name, value in report["peak_rss_bytes"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def write_concurrency_markdown(report: dict, path: Path) -> None:
    path.write_text(concurrency_markdown(report))

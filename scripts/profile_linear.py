"""The verify service's forward by new tokens, with transformers' linear layers (aten) and with
them on oneDNN with packed weights (:mod:`specdec.engine.cpu_linear`); findings in
docs/profiles.md#the-targets-linear-layers-on-a-cpu.

Loads the target twice (one copy packed), gives each a sequence of ``--context`` cached tokens in
the verify service's KV store (:class:`specdec.engine.ragged_lm.RaggedLM`), and times one forward of n
new tokens after it (rolled back after each), the two interleaved, for each n; prints the median
of ``--repeats`` in ms and the largest logit difference between the two after the context.

    .venv/bin/python scripts/profile_linear.py [--model smollm2] [--threads 2] [--tokens 1,2,3,5,9,17,99]

With ``--layers``, times each distinct linear layer shape of the model alone instead, aten against
packed (packed whatever its size), at ``--tokens`` rows: the microseconds a call behind
:data:`specdec.engine.cpu_linear.MIN_PACKED_ELEMENTS` (fastest of ``--repeats`` runs of 50 calls).
"""

import argparse
import statistics
import time

import torch

from specdec.engine.batching import SequenceStep
from specdec.engine.cpu_linear import PackedLinear, pack_linears
from specdec.engine.models import load_causal_lm
from specdec.engine.ragged_lm import RaggedLM
from specdec.timing import min_ms, ms_since


def forward_ms(lm: RaggedLM, seq_id: int, context: int, token_ids: list[int]) -> float:
    start = time.perf_counter()
    lm.forward([SequenceStep(seq_id, token_ids, len(token_ids))])
    ms = ms_since(start)
    lm.truncate(seq_id, context)
    return ms


def layer_us(linear: torch.nn.Module, rows: int, repeats: int) -> float:
    x = torch.randn(rows, linear.in_features)
    linear(x)  # warm-up
    return min_ms(lambda: [linear(x) for _ in range(50)], repeats) * 1000 / 50


def print_layers(model: torch.nn.Module, counts: list[int], repeats: int) -> None:
    """Per distinct (in, out) shape of ``model``'s linear layers, microseconds a call on aten and
    packed, at each of ``counts`` rows."""
    shapes = {(m.in_features, m.out_features): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    print("in x out | weights | rows | aten us | packed us | packed / aten")
    with torch.inference_mode():
        for (n_in, n_out), linear in sorted(shapes.items()):
            packed = PackedLinear(linear)
            for rows in counts:
                aten, oned = layer_us(linear, rows, repeats), layer_us(packed, rows, repeats)
                print(f"{n_in} x {n_out} | {n_in * n_out} | {rows} | {aten:.1f} | {oned:.1f} | {oned / aten:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--tokens", default="1,2,3,5,9,17,99")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--layers", action="store_true", help="Time each linear layer shape alone.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.tokens.split(",")]
    if args.layers:
        print_layers(load_causal_lm(args.model, "float32")[0], counts, args.repeats)
        return
    models = {"aten": load_causal_lm(args.model, "float32")[0], "oneDNN": load_causal_lm(args.model, "float32")[0]}
    pack_linears(models["oneDNN"])
    vocab = models["aten"].config.vocab_size
    token_ids = [(7919 * i + 13) % vocab for i in range(args.context + max(counts))]
    lms = {name: RaggedLM(model) for name, model in models.items()}
    seqs = {name: lm.allocate() for name, lm in lms.items()}
    logits = {name: lm.forward([SequenceStep(seqs[name], token_ids[: args.context], 1)])[0] for name, lm in lms.items()}
    difference = (logits["aten"] - logits["oneDNN"]).abs().max()
    print(f"largest logit difference after {args.context} tokens: {difference:.2e}")
    print("new tokens | " + " | ".join(lms))
    for n in counts:
        new = token_ids[args.context : args.context + n]
        times: dict[str, list[float]] = {name: [] for name in lms}
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            for name, lm in lms.items():
                times[name].append(forward_ms(lm, seqs[name], args.context, new))
        print(f"{n} | " + " | ".join(f"{statistics.median(ms[1:]):.0f}" for ms in times.values()))


if __name__ == "__main__":
    main()

"""The verify service's batched step by how its sequences' new tokens mix (decodes alone,
beside verifies of K + 1 tokens, beside a prefill chunk), and the decodes' step beside a draft's
prefill on the same cores at each of ``--draft-nice``; findings in specdec/engine/ragged_lm.py's module
docstring, draft_service/settings.py's ``nice`` and coordinator/speculation/policy/step_costs.py's
``StepCosts.step_ms``.

Loads the target as the verify service does (float32, linear layers packed on the CPU), prefills
``--sequences`` sequences of random tokens with contexts drawn from ``--contexts``, then times one
step per mix (each sequence's new tokens rolled back after it), the mixes interleaved; prints the
median of ``--repeats`` in ms. Beside a draft: a child process prefills 700 tokens again and again
in llama.cpp (the default draft, Q8_0, one thread) at that niceness while the decodes' steps run.

    .venv/bin/python scripts/profile_step.py [--model smollm2] [--threads 2] [--sequences 14] [--draft-nice 0,19]
"""

import argparse
import random
import statistics
import subprocess
import sys
import time

import torch

from specdec.engine.batching import SequenceStep
from specdec.engine.cpu_linear import pack_linears
from specdec.engine.models import load_causal_lm
from specdec.engine.ragged_lm import RaggedLM
from specdec.timing import ms_since


def mixes(num_sequences: int) -> dict[str, tuple[list[int], int]]:
    """Each mix's draft tokens per sequence (K; 0: a decode) and the tokens of a prefill chunk
    beside them (0: none)."""
    decodes = [0] * num_sequences
    return {
        "decodes": (decodes, 0),
        "one verify of K = 4": ([4, *decodes[1:]], 0),
        "three verifies of K = 2": ([2, 2, 2, *decodes[3:]], 0),
        "every sequence K = 1": ([1] * num_sequences, 0),
        "decodes and a prefill chunk of 32": (decodes, 32),
        "decodes and a prefill chunk of 128": (decodes, 128),
        "K = 1 and a prefill chunk of 128": ([1] * num_sequences, 128),
    }


def draft_prefills() -> None:
    """The child: prints ``ready`` once loaded, then prefills 700 tokens in a loop until killed."""
    from llama_cpp import Llama

    from draft_service.drafters.llama_cpp import requantized
    from specdec.engine.model_files import resolve_model

    ref = resolve_model("smollm2")
    llm = Llama(model_path=requantized(ref.gguf_path, "q8_0"), n_threads=1, n_ctx=2048, verbose=False)
    tokens = [random.randrange(1000, 40000) for _ in range(700)]
    print("ready", flush=True)
    while True:
        llm.reset()
        llm.eval(tokens)


def main() -> None:
    if sys.argv[1:] == ["--draft-prefills"]:
        return draft_prefills()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=14)
    parser.add_argument("--contexts", default="300,900", help="the smallest and largest context, in tokens")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--draft-nice", default="", help="niceness of a draft prefilling beside the decodes, e.g. 0,19")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_causal_lm(args.model, "float32")[0]
    pack_linears(model)
    lm, rng = RaggedLM(model), random.Random(0)
    vocab = model.config.vocab_size
    low, high = (int(n) for n in args.contexts.split(","))
    contexts = [rng.randint(low, high) for _ in range(args.sequences)]
    seqs = [lm.allocate() for _ in contexts]
    for seq, context in zip(seqs, contexts, strict=True):
        lm.forward([SequenceStep(seq, [rng.randrange(vocab) for _ in range(context)], 1)])

    prefilled = lm.allocate()  # the sequence whose prompt a mix's prefill chunk opens

    def step_ms(draft_tokens: list[int], prefill: int = 0) -> float:
        steps = [
            SequenceStep(seq, [rng.randrange(vocab) for _ in range(k + 1)], k + 1)
            for seq, k in zip(seqs, draft_tokens, strict=True)
        ]
        if prefill:
            steps.append(SequenceStep(prefilled, [rng.randrange(vocab) for _ in range(prefill)], 0))
        start = time.perf_counter()
        lm.forward(steps)
        ms = ms_since(start)
        for seq, context in [*zip(seqs, contexts, strict=True), (prefilled, 0)]:
            lm.truncate(seq, context)
        return ms

    by_mix = mixes(args.sequences)
    times: dict[str, list[float]] = {name: [] for name in by_mix}
    for repeat in range(args.repeats + 1):  # the first of each is a warm-up
        for name, (draft_tokens, prefill) in by_mix.items():
            ms = step_ms(draft_tokens, prefill)
            if repeat:
                times[name].append(ms)
    print(f"{args.sequences} sequences, contexts {low} to {high} tokens; mix | new tokens | step ms")
    for name, (draft_tokens, prefill) in by_mix.items():
        print(f"{name} | {sum(k + 1 for k in draft_tokens) + prefill} | {statistics.median(times[name]):.0f}")
    decodes = by_mix["decodes"][0]
    for nice in [int(n) for n in args.draft_nice.split(",") if n]:
        child = subprocess.Popen(
            ["nice", "-n", str(nice), sys.executable, __file__, "--draft-prefills"], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        beside = statistics.median(step_ms(decodes) for _ in range(args.repeats))
        child.kill()
        child.wait()
        print(f"decodes beside a draft prefill at niceness {nice} | {args.sequences} | {beside:.0f}")


if __name__ == "__main__":
    main()

"""What token trees could add at batch 1: where the llama.cpp draft disagrees with the target, how
close its own first and second choices were, and how many more tokens a K-token round would commit
with one extra branch; findings in docs/profiles.md#token-trees-what-one-branch-a-round-would-add.

The target (transformers, float32) decodes each Spec-Bench prompt greedily; the draft (the
llama-cpp drafter's model, Q8_0, as the draft service runs it) then reads the prompt and that
output in one forward, so its logits at every position are those it would have after the target's
own tokens, which is what each draft position sees in a greedy round up to its first rejection.
Greedy rounds of ``--k`` drafts are then replayed on those logits:

- a chain (today's rounds): the draft's first choices up to the first one the target rejects, plus
  the target's own token there;
- a chain plus one branch at the first drafted position whose top-1 / top-2 logit margin is below a
  threshold: the draft's second choice there, continued with its first choices up to the round's
  depth; where the rejection lies at that position and the second choice is the target's token, the
  round also commits the branch's accepted tokens and the token after them.

Positions past a round's first rejection are not on the target's path, so their margins are not
known here; a branch placed there is counted as placed at the first small margin before it. The
figures are therefore an upper bound on what one branch a round could add, before its costs (the
draft's forwards of the branch, the verify's extra tokens).

    .venv/bin/python scripts/draft_margins.py [--limit 10] [--max-new-tokens 128] [--k 8]
"""

import argparse
from dataclasses import dataclass

import torch

from coordinator.api.request import prompt_ids
from draft_service.drafters.llama_cpp import LlamaCppLM, requantized
from specdec.engine.batching import SequenceStep
from specdec.engine.model_files import resolve_model
from specdec.engine.models import load_causal_lm
from specdec_app.bench.questions import generate_request, load_questions
from specdec_app.bench_cli import SPEC_BENCH

THRESHOLDS = (0.05, 0.1, 0.2, 0.5, float("inf"))  # logit margins below which a round branches


@dataclass
class Output:
    """One prompt's greedy output ``tokens`` and the draft's top-2 ``choices`` and ``margins``
    (logits) at each of its positions."""

    tokens: list[int]
    choices: list[tuple[int, int]]
    margins: list[float]


def outputs(limit: int, max_new_tokens: int) -> list[Output]:
    """The target's greedy outputs on the first ``limit`` prompts of each category, with the
    draft's choices after the target's tokens."""
    questions = load_questions(SPEC_BENCH, limit=limit)
    target, tokenizer = load_causal_lm("smollm2", dtype="float32")
    draft = LlamaCppLM(requantized(resolve_model("smollm2").gguf_path, "q8_0"), n_ctx=4096, max_num_seqs=1)
    found = []
    for question in questions:
        ids = prompt_ids(generate_request(question), tokenizer)
        with torch.inference_mode():
            output = target.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        tokens = output[0, len(ids) :].tolist()
        seq = draft.allocate()
        # row i: the logits after the prompt and tokens[:i]
        logits = draft.forward([SequenceStep(seq, ids + tokens[:-1], num_logits=len(tokens))])[0]
        draft.free(seq)
        top = logits.topk(2, dim=-1)
        found.append(
            Output(
                tokens,
                [tuple(row) for row in top.indices.tolist()],
                (top.values[:, 0] - top.values[:, 1]).tolist(),
            )
        )
    return found


def first_choices_passing(output: Output, start: int, limit: int) -> int:
    """How many positions from ``start`` on (at most ``limit``) the draft's first choice is the
    target's token."""
    passed = 0
    while passed < limit and start + passed < len(output.tokens):
        if output.choices[start + passed][0] != output.tokens[start + passed]:
            break
        passed += 1
    return passed


def replay(output: Output, k: int, threshold: float) -> tuple[int, int, int, int, int]:
    """(rounds, tokens committed by chains, by chains with one branch, rounds that branched, the
    branches' tokens: the second choice and its continuation to the round's depth)."""
    tokens, choices, margins = output.tokens, output.choices, output.margins
    rounds = chain = tree = branched = extra = 0
    start = 0
    while start < len(tokens):
        passed = first_choices_passing(output, start, k)
        committed = with_branch = passed + 1
        known = range(start, min(start + passed + 1, start + k, len(tokens)))
        branch = next((i for i in known if margins[i] < threshold), None)
        if branch is not None:
            branched, extra = branched + 1, extra + k - (branch - start)
            rejected = start + passed
            if branch == rejected and passed < k and choices[branch][1] == tokens[branch]:
                more = first_choices_passing(output, branch + 1, k - passed - 1)
                with_branch = passed + 1 + more + 1
        rounds, chain, tree = rounds + 1, chain + committed, tree + with_branch
        start += committed
    return rounds, chain, tree, branched, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=10, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="draft tokens a round")
    args = parser.parse_args()
    found = outputs(args.limit, args.max_new_tokens)
    rejected = [
        (o.margins[i], o.choices[i][1] == t) for o in found for i, t in enumerate(o.tokens) if o.choices[i][0] != t
    ]
    accepted = [o.margins[i] for o in found for i, t in enumerate(o.tokens) if o.choices[i][0] == t]
    positions = len(rejected) + len(accepted)
    print(f"{positions} positions, the draft's first choice the target's token at {len(accepted) / positions:.3f}")
    print(f"of the {len(rejected)} others, the draft's second choice was the target's at {sum(s for _, s in rejected)}")
    for threshold in THRESHOLDS[:-1]:
        print(
            f"margin below {threshold}: {sum(m < threshold for m, _ in rejected) / len(rejected):.3f} of those, "
            f"{sum(m < threshold for m in accepted) / len(accepted):.3f} of the positions the target accepted"
        )
    print(
        f"K = {args.k}: branch where the margin is below | rounds branched | branch tokens a round | "
        "tokens a round, chain -> with the branch"
    )
    for threshold in THRESHOLDS:
        replays = [replay(o, args.k, threshold) for o in found]
        rounds, chain, tree, branched, extra = (sum(column) for column in zip(*replays, strict=True))
        print(
            f"{threshold} | {branched / rounds:.2f} | {extra / rounds:.2f} | "
            f"{chain / rounds:.2f} -> {tree / rounds:.2f} (+{tree / chain - 1:.1%})"
        )


if __name__ == "__main__":
    main()

"""The acceptance test of speculative decoding, for every sequence of a step at once.

Greedy: accept draft tokens while they equal the target's argmax. Sampling: the speculative
rejection-sampling rule of Leviathan, Kalman & Matias, "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023, Algorithm 1) and Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling" (2023): accept draft token x with probability
min(1, p(x) / q(x)); at the first rejection sample from normalise(max(0, p - q)); if all K pass,
sample the bonus token from p. The output is distributed exactly as sampling from p alone.

Terms and batch layout (as vLLM's rejection sampler, ``vllm/v1/sample/rejection_sampler.py``): of
a sequence's K draft tokens the first n are *accepted*; the *next token* is the *recovered* token
(drawn at the first rejection) or, when all K pass, the *bonus* token. A step's B sequences bring
K_b drafts each. Under sampling, their draft tokens, the probabilities p(x) and q(x) of each and
the per-token outcomes are laid out ``[B, max K]`` (padded), so one pass tests every draft token
of every sequence and counts the accepted prefixes (a cumulative product of the outcomes), with
one host synchronisation for the step. Greedy acceptance has no draws: the argmaxes of all the
step's rows come to the host (:func:`specdec.sampling.probs.argmax`) and the accepted prefixes are
counted there, comparing ints (the tensor form, with one synchronisation, is slower on CPU). The logits
and probabilities themselves stay one ``[K_b + 1, V]`` tensor per sequence
(the engine's views of the step's logits), each read by one argmax or one gather of its draft
entries: concatenating them into vLLM's flattened ``[total_K + B, V]`` copies more memory than the
test reads. Why, measured: docs/profiles.md#the-engine-loop-and-adaptive-k-under-load.

Under sampling, each sequence keeps its own generator (seeded per request and position by the
caller) and the draws are exactly those the one-token-at-a-time rule makes, in the same order:
one uniform per examined draft token, then the recovered or bonus token from ``torch.multinomial``
(:func:`specdec.sampling.probs.sample`). The uniforms of all K drafts are drawn up front; the generator
is then rewound and advanced by the uniforms the rule examined, so a seed gives the same tokens as
before this was batched. The test compares ``u * q(x) < p(x)`` in float64, where products of
float32 values are exact, as the per-token rule's Python floats did. The one draw per sequence
stays on its generator (a CPU ``torch.multinomial``): an exponential race over all rows at once
(vLLM's) would change the draws.
"""

from collections.abc import Sequence

import torch

from specdec.sampling.probs import argmax, sample


def _accepted_counts(passed: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the length of each row's leading run of True in ``passed`` ``[B, max K]``
    bool (padding is False)."""
    return passed.cumprod(1).sum(1)


def _at_drafts(rows: Sequence[torch.Tensor], draft_token_ids: Sequence[Sequence[int]], padding: float) -> torch.Tensor:
    """``[B, max K]`` float64: ``rows[b][i, draft_token_ids[b][i]]``, ``padding`` past a row's drafts."""
    width = max(len(drafts) for drafts in draft_token_ids)
    out = torch.full((len(rows), width), padding, dtype=torch.float64)
    for b, (probs, drafts) in enumerate(zip(rows, draft_token_ids, strict=True)):
        out[b, : len(drafts)] = probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)]
    return out


def greedy_accept(
    draft_token_ids: Sequence[Sequence[int]], target_logits: Sequence[torch.Tensor]
) -> list[tuple[int, int]]:
    """Greedy acceptance for a step's B sequences.

    Args:
        draft_token_ids: per sequence, its K_b proposed ids (K_b may be 0).
        target_logits: per sequence, ``[K_b + 1, V]``; row i scores the token after draft position
            i (row 0: the token after the committed prefix).
    Returns:
        per sequence ``(n, next_token)``: n accepted drafts and the target's argmax after them (the
        correction, or the bonus token when n == K_b).
    """
    target_tokens = argmax(target_logits)  # [total_K + B]
    outcomes, first_row = [], 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and drafts[n] == target_tokens[first_row + n]:
            n += 1
        outcomes.append((n, target_tokens[first_row + n]))
        first_row += len(drafts) + 1
    return outcomes


def rejection_sample(
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor],
    target_probs: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator],
) -> list[tuple[int, int]]:
    """Speculative rejection sampling (see the module docstring) for a step's B sequences.

    Args:
        draft_token_ids: per sequence, its K_b proposed ids (K_b may be 0).
        draft_probs: q, per sequence ``[K_b, V]`` float32; row i is the distribution draft token i
            was drawn from (a one-hot row for model-free drafters).
        target_probs: p, per sequence ``[K_b + 1, V]`` float32, after the same sampling transform
            as q.
        generators: per sequence, the source of its uniform draws and of its recovered or bonus
            token; each is left where the one-token-at-a-time rule leaves it.
    Returns:
        per sequence ``(n, next_token)`` as in :func:`greedy_accept`.
    """
    width = max(len(drafts) for drafts in draft_token_ids)
    states = [generator.get_state() for generator in generators]
    uniforms = torch.stack([torch.rand(width, generator=generator) for generator in generators]).double()
    p_drafts = _at_drafts(target_probs, draft_token_ids, padding=0.0)  # padding never passes
    passed = uniforms * _at_drafts(draft_probs, draft_token_ids, padding=1.0) < p_drafts
    outcomes = []
    for b, n in enumerate(_accepted_counts(passed).tolist()):
        p, q, k, generator = target_probs[b], draft_probs[b], len(draft_token_ids[b]), generators[b]
        generator.set_state(states[b])
        torch.rand(min(n + 1, k), generator=generator)  # the uniforms the rule examined
        if n == k:
            outcomes.append((n, sample(p[n], generator)))
            continue
        residual = (p[n] - q[n]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[n]
        outcomes.append((n, sample(residual / residual.sum(), generator)))
    return outcomes

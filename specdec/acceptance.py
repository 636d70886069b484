"""The acceptance test of speculative decoding.

Greedy: accept draft tokens while they equal the target's argmax. Sampling: the speculative
rejection-sampling rule of Leviathan, Kalman & Matias, "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023, Algorithm 1) and Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling" (2023): accept draft token x with probability
min(1, p(x) / q(x)); at the first rejection sample from normalise(max(0, p - q)); if all K pass,
sample the bonus token from p. The output is distributed exactly as sampling from p alone.
"""

from collections.abc import Sequence

import torch

from specdec.sampling import sample


def greedy_accept(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance.

    Args:
        draft_tokens: the K proposed ids.
        target_logits: ``[K + 1, V]``; row i scores the token after draft position i (row 0 the
            token after the committed prefix).
    Returns:
        ``(n, next_token)``: n accepted drafts and the target's argmax after them (the correction,
        or the bonus token when n == K).
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return n, target_tokens[n]


def rejection_sample(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative rejection sampling (see the module docstring).

    Args:
        draft_tokens: the K proposed ids.
        draft_probs: q, ``[K, V]`` float32; row i is the distribution draft token i was drawn from
            (a one-hot row for model-free drafters).
        target_probs: p, ``[K + 1, V]`` float32, after the same sampling transform as q.
        generator: source of the uniform draws and of the correction / bonus sample.
    Returns:
        ``(n, next_token)`` as in :func:`greedy_accept`.
    """
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p
        return i, sample(residual / residual.sum(), generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)

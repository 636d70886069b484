"""The logits -> probabilities transform shared by draft and target, and seeded draws.

Both sides must apply exactly the same transform (temperature, then top-k, then top-p, the order
transformers and vLLM use) so that the acceptance test compares like with like (invariant
*lossless, sampling*, docs/architecture.md#invariants). The parameters themselves (validation,
proto form) are :class:`specdec.sampling.sampling_params.SamplingParams`.
"""

import hashlib

import torch

from specdec.sampling.sampling_params import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature, top-k and top-p and returns probabilities.

    Args:
        logits: ``[..., V]``, any float dtype.
        params: must not be greedy (temperature > 0).
    Returns:
        ``[..., V]`` float32 probabilities, each row summing to 1; filtered tokens are exactly 0.
    """
    scores = logits.float()
    # shifted so that the largest score is 0: a tiny temperature cannot overflow it to inf - inf = NaN
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # never drops the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def round_generator(seed: int, position: int, stream: str) -> torch.Generator:
    """A CPU generator for the random draws made at one position of one request.

    Seeding from (request seed, committed length, stream) rather than carrying generator state
    makes every draw a function of where it happens, so a session rebuilt from its committed log
    draws the same numbers. ``stream`` separates the draft's draws ("draft") from the target's
    ("verify").
    """
    digest = hashlib.sha256(f"{seed}:{position}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draws one token id from ``probs`` (``[V]`` float32)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))

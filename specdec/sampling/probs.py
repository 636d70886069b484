"""The logits -> probabilities transform shared by draft and target, and seeded draws.

Both sides must apply exactly the same transform (temperature, then top-k, then top-p, the order
transformers and vLLM use) so that the acceptance test compares like with like (invariant
*lossless, sampling*, docs/architecture.md#invariants). The parameters themselves (validation,
proto form) are :class:`specdec.sampling.sampling_params.SamplingParams`.
"""

import hashlib
from collections.abc import Sequence

import numpy as np
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


# dtypes numpy's argmax reads in place (it has no bfloat16)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax(logits: Sequence[torch.Tensor]) -> list[int]:
    """The greedy token of every row of ``logits``, in order: each tensor ``[rows, V]`` or ``[V]``
    (any float dtype, any device); a row's token is the first index of its largest value, as
    ``torch.argmax``'s.

    CPU tensors of float32, float64 or float16 are read in place by numpy's ``argmax``, which is
    vectorized where torch's is not (over SmolLM2's 49,152 logits, about 10 us a row against
    torch's 77 on the 2-core Xeon of docs/profiles.md). Others go through one ``torch.argmax``
    each and one transfer to the host for all.
    """
    if all(x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and x.is_contiguous() for x in logits):
        return [token for x in logits for token in np.argmax(x.numpy(), axis=-1).reshape(-1).tolist()]
    return torch.cat([x.argmax(dim=-1).reshape(-1) for x in logits]).tolist()


def best_other(values: torch.Tensor, excluded: int) -> int:
    """The index of the largest of ``values`` ``[V]`` (V >= 2, any float dtype, any device) other than
    ``excluded``; the first of equals. Reads the two slices around ``excluded`` in place (no copy, no
    sort: ``topk(2)`` costs eight times one :func:`argmax` over a 49,152-token vocabulary on a CPU)."""
    candidates = []
    if excluded > 0:
        candidates.append(argmax([values[:excluded]])[0])
    if excluded + 1 < len(values):
        candidates.append(excluded + 1 + argmax([values[excluded + 1 :]])[0])
    return max(candidates, key=lambda i: (float(values[i]), -i))


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

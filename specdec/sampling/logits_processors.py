"""Logits processors: logit bias, min_tokens and the repetition, frequency and presence penalties.

Both services apply them to their raw logits before the sampling transform
(:func:`specdec.sampling.probs.logits_to_probs`) or the greedy argmax, each position's from the tokens
before it (the committed log, then the draft tokens before that position), so the draft and the
target see the same processed distributions and speculation stays lossless against the target
with the processors (invariant *lossless under constraints*, docs/architecture.md#invariants).

Definitions and order follow vLLM v1 (``vllm/v1/sample/sampler.py``, ``ops/penalties.py``):
first logit bias (added) and min_tokens (EOS ids at -inf while fewer than ``min_tokens`` tokens
are generated), then the penalties, where *generated* tokens are those after the prompt
(``SamplingParams.num_prompt_tokens``): repetition penalty r divides a positive logit by r and
multiplies a negative one by r for every token in the prompt or the generated tokens (CTRL,
Keskar et al. 2019); frequency penalty subtracts f times a token's count in the generated tokens;
presence penalty subtracts p from every token present in them (OpenAI's definitions).
"""

from collections.abc import Sequence

import torch

from specdec.sampling.sampling_params import SamplingParams


def process(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], drafts: Sequence[int] = ()
) -> torch.Tensor:
    """The processed logits of ``N`` positions: row i follows ``context`` + ``drafts[:i]``.

    Args:
        logits: ``[N, V]``, any float dtype, N <= len(drafts) + 1.
        params: the request's; returned unchanged (the same tensor) when no processor is on.
        context: the committed token ids, prompt included.
        drafts: the draft token ids after ``context`` (a verify's proposal; empty for one position).
    Returns:
        ``[N, V]`` float32 (or ``logits`` itself with no processor on); a token held back is -inf.
    """
    if not params.processes_logits:
        return logits
    num_rows, vocab_size = logits.shape
    out = logits.float().clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        out[:, list(ids)] += torch.tensor(biases)
    num_generated = len(context) - params.num_prompt_tokens
    if params.min_tokens and params.eos_token_ids:
        held = max(0, min(num_rows, params.min_tokens - num_generated))  # the first rows are short of it
        out[:held, list(params.eos_token_ids)] = float("-inf")
    counts = _generated_counts(context[params.num_prompt_tokens :], drafts[: num_rows - 1], num_rows, vocab_size)
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        in_prompt[list(context[: params.num_prompt_tokens])] = True
        r = params.repetition_penalty
        out = torch.where(in_prompt | (counts > 0), torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    return out


def _generated_counts(generated: Sequence[int], drafts: Sequence[int], num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` float32: row i counts each token in ``generated`` + ``drafts[:i]``."""
    counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab_size).float()
    counts = counts.expand(num_rows, vocab_size).clone()
    for i, token in enumerate(drafts):
        counts[i + 1 :, token] += 1
    return counts

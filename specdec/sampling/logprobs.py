"""Log-probabilities of committed tokens (``SamplingParams.logprobs``), as the verify service
returns them.

Raw log-probabilities, as vLLM's default ``logprobs_mode`` (``raw_logprobs``): the log_softmax of
the target's logits before the logits processors, the grammar mask and the sampling transform
(temperature, top-k, top-p). A committed token's come from the verify forward that committed it
(its row of the step's logits), so they do not depend on the drafter, on K or on what was
accepted: equal, up to floating-point rounding, to the target's log_softmax after the same
prefix in one plain forward.

:func:`committed_logprobs` serves a whole engine step in one pass (one log_softmax and one top-k
over every requesting sequence's committed rows, one host transfer); :func:`token_logprobs` is one
row's, for a token committed outside a verify step (a prefill's first token).
"""

from collections.abc import Sequence

import torch

from specdec.v1 import common_pb2


def committed_logprobs(
    rows: Sequence[torch.Tensor], token_ids: Sequence[Sequence[int]], num_top: Sequence[int]
) -> list[list[common_pb2.TokenLogprobs]]:
    """The log-probabilities of the tokens B sequences committed in one step.

    Args:
        rows: per sequence, its raw logits ``[N_b, V]`` (any float dtype): row i scores the
            position where ``token_ids[b][i]`` was committed.
        token_ids: per sequence, the N_b committed ids.
        num_top: per sequence, how many most likely tokens to list at each position (0: none);
            at most V.
    Returns:
        per sequence, one ``TokenLogprobs`` per committed token: its log-probability and the
        ``num_top[b]`` most likely ids with theirs, most likely first (float32 values).
    """
    logprobs = torch.cat(list(rows)).float().log_softmax(dim=-1)  # [sum N_b, V]
    flat_ids = torch.tensor([token for ids in token_ids for token in ids], dtype=torch.long)
    chosen = logprobs[torch.arange(len(flat_ids)), flat_ids].tolist()
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)  # [sum N_b, max top], most likely first
    top_value_rows, top_id_rows = top_values.tolist(), top_ids.tolist()
    out, first = [], 0
    for ids, top in zip(token_ids, num_top, strict=True):
        out.append(
            [
                common_pb2.TokenLogprobs(
                    logprob=chosen[r], top_token_ids=top_id_rows[r][:top], top_logprobs=top_value_rows[r][:top]
                )
                for r in range(first, first + len(ids))
            ]
        )
        first += len(ids)
    return out


def token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> common_pb2.TokenLogprobs:
    """The log-probabilities at one position: ``row`` the raw logits ``[V]`` there, ``token_id``
    the token committed, ``num_top`` (at most V) the most likely tokens to list."""
    return committed_logprobs([row[None]], [[token_id]], [num_top])[0][0]

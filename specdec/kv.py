"""One session's KV cache in a batched causal LM, with rollback.

The bookkeeping rule shared by the draft and the verify side: ``cached_tokens`` lists the tokens
whose keys and values are in the cache. Before each step the cache is cropped to the longest
common prefix of ``cached_tokens`` and the committed tokens, and never holds the last committed
token, whose logits the next step needs. Rejected draft positions therefore vanish at the next
reconcile, and the next logits equal those of a fresh prefill of the committed prefix (invariant
*KV consistency*, docs/architecture.md#invariants).

Names, the same on the draft and the verify side: ``lm`` is a :class:`specdec.batching.BatchedLM`,
a model together with the KV store its sequences share (``Target.lm``, a model drafter's ``lm``,
``Engine.lm``, ``SequenceKV.lm``); ``kv_cache`` is a :class:`SequenceKV`, one session's KV cache:
its sequence in an ``lm``'s KV store (``TargetSession.kv_cache``, ``ModelDraftSession.kv_cache``),
whose size a session reports as ``kv_cache_bytes()``. ``model`` stays what transformers or
llama.cpp load, or a model's name.

Traced (OpenTelemetry spans, no-ops with tracing off): ``prefill`` (:func:`prefill`) and every
``rollback`` that drops cached positions; the engine adds the ``forward`` spans.
"""

from collections.abc import Callable, Sequence

import torch
from opentelemetry import trace

from specdec.batching import BatchedLM, SequenceStep
from specdec.engine import Engine, Work
from specdec.token_ids import common_prefix_length

tracer = trace.get_tracer(__name__)


class SequenceKV:
    """One session's sequence in a :class:`specdec.batching.BatchedLM`, with the bookkeeping rule
    of the module docstring. A batched step feeds it through :meth:`step` and :meth:`appended`;
    :meth:`extend` runs a forward of this sequence alone.

    Raises ResourceExhausted (from the model's KV store) when no sequence can be allocated.
    """

    def __init__(self, lm: BatchedLM):
        self.lm = lm
        self.seq_id = lm.allocate()
        self.cached_tokens: list[int] = []
        self._agreed = 0  # leading cached tokens known to equal the committed log

    def rollback(self, length: int) -> None:
        """Drops the KV of every position at or after ``length`` (a length change in the store)."""
        if length < len(self.cached_tokens):
            self.lm.truncate(self.seq_id, length)
            del self.cached_tokens[length:]

    def step(self, tokens: Sequence[int], num_logits: int = 1) -> SequenceStep:
        """This sequence's share of a batched step over ``tokens``; call :meth:`appended` after it ran."""
        return SequenceStep(self.seq_id, list(tokens), num_logits)

    def appended(self, step: SequenceStep) -> None:
        """Records that ``step`` ran: its tokens are cached now."""
        self.cached_tokens.extend(step.token_ids)

    def extend(self, tokens: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Runs ``tokens`` through the model alone, outside any engine (checks and start-up
        measurements), appending their KV.

        Returns:
            ``[num_logits, V]`` float32 logits of the last ``num_logits`` positions (row i scores
            the token that follows position ``len(tokens) - num_logits + i``).
        """
        step = self.step(tokens, num_logits)
        (logits,) = self.lm.forward([step])
        self.appended(step)
        return logits

    def reconcile(self, committed: Sequence[int], num_committed: int | None = None) -> list[int]:
        """Rolls back to the committed prefix; returns the committed tokens not yet in the cache
        (never empty for a non-empty ``committed``). Drafting ahead, ``committed`` goes on past
        the committed log with predicted tokens: only its first ``num_committed`` (default: all)
        are committed.

        Within a session the committed log only grows by appending, so the comparison starts
        where the previous reconcile's committed part ended: O(K) per round, not O(context).
        """
        agreed = common_prefix_length(self.cached_tokens, committed, min(self._agreed, len(self.cached_tokens)))
        keep = min(agreed, len(committed) - 1)
        if keep < len(self.cached_tokens):
            attributes = {
                "specdec.cache_length": len(self.cached_tokens),
                "specdec.num_dropped": len(self.cached_tokens) - keep,
            }
            with tracer.start_as_current_span("rollback", attributes=attributes):
                self.rollback(keep)
        self._agreed = min(keep, len(committed) if num_committed is None else num_committed)
        return list(committed[keep:])

    def cache_bytes(self) -> int:
        """Bytes the sequence's cached positions take in the KV store."""
        return self.lm.cache_bytes(self.seq_id)

    def close(self) -> None:
        """Frees the sequence in the KV store."""
        self.lm.free(self.seq_id)


class PrefillWork(Work):
    """Engine work that caches every committed token of a sequence but the last, a chunk of at
    most the step's leftover token budget at a time (chunked prefill)."""

    is_prefill = True

    def __init__(self, kv_cache: SequenceKV, committed: Sequence[int]):
        self.kv_cache, self.seq_id, self.committed = kv_cache, kv_cache.seq_id, committed

    def next_step(self, budget: int) -> SequenceStep:
        pending = self.kv_cache.reconcile(self.committed)[:-1]
        return self.kv_cache.step(pending[:budget], num_logits=0)

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        self.kv_cache.appended(step)
        return len(self.kv_cache.cached_tokens) >= len(self.committed) - 1


def prefill(
    engine: Engine,
    kv_cache: SequenceKV,
    committed: Sequence[int],
    timeout_s: float | None = None,
    abandoned: Callable[[], bool] | None = None,
) -> None:
    """Caches ``committed`` but its last token through ``engine`` (``timeout_s`` and ``abandoned``
    as in :meth:`specdec.engine.Engine.run`), in a ``prefill`` span."""
    if len(committed) > 1:
        with tracer.start_as_current_span("prefill", attributes={"specdec.num_tokens": len(committed)}):
            engine.run(PrefillWork(kv_cache, committed), timeout_s, abandoned)

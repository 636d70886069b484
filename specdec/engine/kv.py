"""One session's KV cache in a batched causal LM, with rollback.

The bookkeeping rule shared by the draft and the verify side: ``cached_tokens`` lists the tokens
whose keys and values are in the cache. Before each step the cache is cropped to the longest
common prefix of ``cached_tokens`` and the committed tokens, and never holds the last committed
token, whose logits the next step needs. Rejected draft positions therefore vanish at the next
reconcile, and the next logits equal those of a fresh prefill of the committed prefix (invariant
*KV consistency*, docs/architecture.md#invariants).

Names, the same on the draft and the verify side: ``lm`` is a :class:`specdec.engine.batching.BatchedLM`,
a model together with the KV store its sequences share (``Target.lm``, a model drafter's ``lm``,
``Engine.lm``, ``SequenceKV.lm``); ``kv_cache`` is a :class:`SequenceKV`, one session's KV cache:
its sequence in an ``lm``'s KV store (``TargetSession.kv_cache``, ``ModelDraftSession.kv_cache``),
whose size a session reports as ``kv_cache_bytes()``. ``model`` stays what transformers or
llama.cpp load, or a model's name.

Prefix caching (docs/architecture.md#prefix-caching): a new sequence first takes from the
model's KV store the longest prefix of its context that the store holds already
(:meth:`SequenceKV.attach_prefix`, at most all committed tokens but the last, by the rule above), and
prefills only the rest; every reconcile tells the store which cached positions are committed for
good (all but the last committed token: never rolled back), which it may then share. Only with
sequences of the same *cache salt* (``SequenceKV.cache_salt``, the tenant's partition that the
coordinator sends with each Prefill: docs/security.md#tenants-and-the-caches).

Admission (docs/architecture.md#kv-memory-a-budget-in-bytes): then, before any of its work runs, the
store admits the sequence by the KV its whole committed context takes, or refuses it with
RESOURCE_EXHAUSTED (:meth:`SequenceKV.admit`); a sequence the store preempted later says why
(:meth:`SequenceKV.lost`).

Traced (OpenTelemetry spans, no-ops with tracing off): ``prefill`` (:func:`prefill`, with the
tokens found in the prefix cache) and every ``rollback`` that drops cached positions; the engine
adds the ``forward`` spans.
"""

from collections.abc import Callable, Sequence

import torch
from opentelemetry import trace

from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.engine import Engine, StepStats, Work
from specdec.token_ids import common_prefix_length

tracer = trace.get_tracer(__name__)


class SequenceKV:
    """One session's sequence in a :class:`specdec.engine.batching.BatchedLM`, with the bookkeeping rule
    of the module docstring. A batched step feeds it through :meth:`step` and :meth:`appended`;
    :meth:`extend` runs a forward of this sequence alone.

    ``cache_salt``: the partition of the store's prefix cache the sequence finds its prefix in
    and shares its own KV in ("": the unsalted one).

    Raises ResourceExhausted (from the model's KV store) when no sequence can be allocated.
    """

    def __init__(self, lm: BatchedLM, cache_salt: str = ""):
        self.lm = lm
        self.cache_salt = cache_salt
        self.seq_id = lm.allocate()
        self.cached_tokens: list[int] = []
        self._agreed = 0  # leading cached tokens known to equal the committed log
        self.num_cached_tokens = 0  # committed tokens found in the prefix cache (attach_prefix)

    def attach_prefix(self, committed: Sequence[int]) -> int:
        """For a new sequence: takes the KV of the longest prefix of ``committed`` but its last
        token that the model's store holds under the sequence's cache salt
        (:meth:`specdec.engine.batching.BatchedLM.attach_prefix`); returns its length in tokens,
        also kept as ``num_cached_tokens``."""
        found = self.lm.attach_prefix(self.seq_id, committed[:-1], self.cache_salt)
        self.cached_tokens = list(committed[:found])
        self._agreed = self.num_cached_tokens = found
        return found

    def admit(self, length: int) -> None:
        """Reserves the KV of ``length`` positions in the store (:meth:`specdec.engine.batching.BatchedLM.admit`).
        Raises ResourceExhausted when its budget cannot hold them."""
        self.lm.admit(self.seq_id, length)

    def lost(self) -> str | None:
        """Why the store preempted this sequence's KV, None while it holds it."""
        return self.lm.lost(self.seq_id)

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
        where the previous reconcile's committed part ended: O(K) per round, not O(context). For
        the same reason the cached committed tokens but the last committed one are never rolled
        back again, and the model's store is told so (:meth:`specdec.engine.batching.BatchedLM.commit`).
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
        num_committed = len(committed) if num_committed is None else num_committed
        self._agreed = min(keep, num_committed)
        self.lm.commit(self.seq_id, min(keep, num_committed - 1))
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
        if len(self.kv_cache.cached_tokens) < len(self.committed) - 1:
            return False
        self.kv_cache.reconcile(self.committed)  # commits the prefill: its blocks serve the next prefill at once
        return True


def prefill(
    engine: Engine,
    kv_cache: SequenceKV,
    committed: Sequence[int],
    timeout_s: float | None = None,
    abandoned: Callable[[], bool] | None = None,
    work: Work | None = None,
) -> StepStats | None:
    """Prefills the new sequence ``kv_cache`` with ``committed``, in a ``prefill`` span: what the
    model's prefix cache holds of it is attached, the KV of all of it admitted (raises
    ResourceExhausted when the store's budget cannot hold it), and ``work`` runs the rest through ``engine``
    (``timeout_s`` and ``abandoned`` as in :meth:`specdec.engine.engine.Engine.run`). By default
    ``work`` is a :class:`PrefillWork`, which caches every committed token but the last (by the
    rule of the module docstring) and runs only when the cache lacks some of them; the verify
    side passes its own work, which also decodes the token after ``committed``. Counts the tokens
    asked of the prefix cache and found there (``kv_cache.num_cached_tokens``) in the engine's
    metrics; returns the stats of the step that finished ``work``, None when nothing ran."""
    with tracer.start_as_current_span("prefill", attributes={"specdec.num_tokens": len(committed)}) as span:
        found = kv_cache.attach_prefix(committed)
        span.set_attribute("specdec.num_cached_tokens", found)
        if kv_cache.lm.prefix_caching:
            engine.metrics.observe_prefix_cache(len(committed), found)
        kv_cache.admit(len(committed))  # the last token's too: the first decode step caches it
        if work is None:
            if found >= len(committed) - 1:
                return None
            work = PrefillWork(kv_cache, committed)
        _, stats = engine.run(work, timeout_s, abandoned)
        return stats

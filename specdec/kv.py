"""KV-cached causal-LM state for one session, with rollback.

The bookkeeping rule shared by the draft and the verify side: ``cached_tokens`` lists the tokens
whose keys and values are in the cache. Before each step the cache is cropped to the longest
common prefix of ``cached_tokens`` and the committed tokens, and never holds the last committed
token, whose logits the next step needs. Rejected draft positions therefore vanish at the next
reconcile, and the next logits equal those of a fresh prefill of the committed prefix (design
brief, invariant 3).

Traced (OpenTelemetry spans, no-ops with tracing off): ``prefill``, every model ``forward`` and
every ``rollback`` that drops cached positions.
"""

import abc
import threading
from collections.abc import Sequence

import torch
from opentelemetry import trace
from transformers import DynamicCache

tracer = trace.get_tracer(__name__)


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` items agree."""
    n, end = start, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


class KVState(abc.ABC):
    """One session's KV cache over ``cached_tokens``, whatever engine holds it."""

    def __init__(self) -> None:
        self.cached_tokens: list[int] = []
        self._agreed = 0  # leading cached tokens known to equal the committed log

    @abc.abstractmethod
    def rollback(self, length: int) -> None:
        """Drops the KV of every position at or after ``length``."""

    @abc.abstractmethod
    def _forward(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        """The model's forward over ``tokens`` with the cache; see :meth:`extend`."""

    @abc.abstractmethod
    def cache_bytes(self) -> int:
        """Bytes the KV cache holds."""

    def extend(self, tokens: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Runs ``tokens`` through the model, appending their KV (and the tokens to ``cached_tokens``).

        Returns:
            ``[num_logits, V]`` float32 logits of the last ``num_logits`` positions (row i scores
            the token that follows position ``len(tokens) - num_logits + i``).
        """
        attributes = {"specdec.num_tokens": len(tokens), "specdec.cache_length": len(self.cached_tokens)}
        with tracer.start_as_current_span("forward", attributes=attributes):
            logits = self._forward(tokens, num_logits)
        self.cached_tokens.extend(tokens)
        return logits

    def reconcile(self, committed: Sequence[int]) -> list[int]:
        """Rolls back to the committed prefix; returns the committed tokens not yet in the cache
        (never empty for a non-empty ``committed``).

        Within a session the committed log only grows by appending, so the comparison starts
        where the previous reconcile ended: O(K) per round, not O(context).
        """
        agreed = common_prefix_length(self.cached_tokens, committed, min(self._agreed, len(self.cached_tokens)))
        keep = min(agreed, len(committed) - 1)
        if keep < len(self.cached_tokens):
            attributes = {"specdec.cache_length": len(self.cached_tokens), "specdec.num_dropped": len(self.cached_tokens) - keep}
            with tracer.start_as_current_span("rollback", attributes=attributes):
                self.rollback(keep)
        self._agreed = keep
        return list(committed[keep:])

    def prefill(self, committed: Sequence[int]) -> None:
        """Caches every committed token but the last (whose logits the next step computes)."""
        self._agreed = 0
        with tracer.start_as_current_span("prefill", attributes={"specdec.num_tokens": len(committed)}):
            pending = self.reconcile(committed)
            if len(pending) > 1:
                self.extend(pending[:-1])


class KVCachedLM(KVState):
    """A transformers causal LM plus one session's ``DynamicCache`` (rollback = ``crop``).

    ``lock`` serialises forwards of the shared model across sessions (batch size 1 per forward).
    """

    def __init__(self, model, lock: threading.Lock):
        super().__init__()
        self.model = model
        self.lock = lock
        self.cache = DynamicCache(config=model.config)
        # Sliding-window and linear-attention layers must keep past states to be croppable.
        self.cache.activate_past_recording()

    def rollback(self, length: int) -> None:
        if length < len(self.cached_tokens):
            self.cache.crop(length - len(self.cached_tokens))  # negative: tokens to remove
            del self.cached_tokens[length:]

    def _forward(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.model.device)
        with self.lock, torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=num_logits,
            )
        return out.logits[0, -num_logits:].float()

    def cache_bytes(self) -> int:
        """Bytes of the storage behind every layer's key and value tensors (a rolled-back cache
        keeps its storage until the next forward)."""
        tensors = [getattr(layer, name, None) for layer in self.cache.layers for name in ("keys", "values")]
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)

"""The batch layout and the contract of a model that runs many sequences in one forward.

Terms (as vLLM's): a *sequence* is one session's KV in the model's shared KV store, named by a
``seq_id``; a *step* is one forward of the model over the new tokens of every sequence in the
batch (ragged: each sequence brings its own number of tokens: K + 1 for a verify, 1 for a decode,
a chunk of a prefill); its *batched tokens* are their sum. A holder of a BatchedLM calls it ``lm``,
and of one session's sequence in it (:class:`specdec.engine.kv.SequenceKV`) ``kv_cache``.

A sequence's cached length only changes by appending in :meth:`BatchedLM.forward`, by
:meth:`BatchedLM.truncate` (rollback of rejected positions: a length change, never a copy) and, for
a new sequence, by :meth:`BatchedLM.attach_prefix` (prefix caching: the KV of a context's beginning
that the store already holds, see docs/architecture.md#prefix-caching).

A store with a memory budget (:class:`specdec.engine.ragged_lm.RaggedLM`) admits a new sequence by the
bytes its context needs (:meth:`BatchedLM.admit`) and may *preempt* a sequence to give a running
one room to grow (its KV dropped; :meth:`BatchedLM.lost` says why; vLLM's recompute preemption).
"""

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.engine.kv_budget import KVUsage


@dataclass
class SequenceStep:
    """One sequence's share of a step: ``token_ids`` are appended after its cached positions, and
    the logits of its last ``num_logits`` of them (0 <= num_logits <= len(token_ids)) come back."""

    seq_id: int
    token_ids: Sequence[int]
    num_logits: int = 1


class BatchedLM(abc.ABC):
    """A model plus one KV store shared by many sequences. ``vocab_size``: the logits' width.

    Not thread-safe by itself: one engine thread runs its steps (:mod:`specdec.engine.engine`) and
    commits; other threads may only :meth:`free` a sequence and :meth:`attach_prefix` to a new one,
    which implementations make safe against a running step.

    ``prefix_caching``: whether :meth:`attach_prefix` may find anything (False here: a store
    without a prefix cache, whose three prefix-cache methods do nothing).
    """

    vocab_size: int
    prefix_caching: bool = False

    @abc.abstractmethod
    def allocate(self) -> int:
        """A new, empty sequence's id. Raises :class:`specdec.rpc.errors.ResourceExhausted` when the
        store has no room for another."""

    @abc.abstractmethod
    def free(self, seq_id: int) -> None:
        """Drops a sequence and its KV (freeing an unknown id does nothing)."""

    @abc.abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Rollback: keeps the KV of the first ``length`` positions of the sequence, drops the rest."""

    @abc.abstractmethod
    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        """One forward over every step's tokens (each sequence at most once). A sequence freed
        after its step was scheduled (its caller gave up) must not fail the others: its step
        touches no live sequence and its logits are meaningless (NaN or scratch).

        Returns:
            per step, ``[num_logits, V]`` float32 logits on the CPU: row i scores the token that
            follows position ``len(token_ids) - num_logits + i`` of that step's tokens.
        """

    @abc.abstractmethod
    def cache_bytes(self, seq_id: int) -> int:
        """Bytes the KV of one sequence's cached positions takes (0 for an unknown id); positions
        shared through the prefix cache count in every sequence that holds them."""

    def attach_prefix(self, seq_id: int, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Prefix caching: gives the new, empty sequence ``seq_id`` the KV of the longest prefix of
        ``token_ids`` the store holds (computed for an earlier or another sequence of the same
        ``cache_salt``, the partition of a tenant: never another's; nothing is recomputed) and
        returns its length in tokens; the caller then appends only the rest. The sequence's own
        KV is shared under ``cache_salt`` too."""
        return 0

    def commit(self, seq_id: int, length: int) -> None:  # noqa: B027 (a no-op for a store that shares nothing)
        """The sequence's first ``length`` cached positions hold committed tokens that stay: no
        :meth:`truncate` goes below them, so the store may share them with later sequences."""

    def prefix_cache_tokens(self) -> int:
        """Tokens the prefix cache keeps for sequences that are gone (what its bound limits)."""
        return 0

    def admit(self, seq_id: int, length: int) -> None:  # noqa: B027 (a no-op for a store allocated up front)
        """Before a new sequence's prefill (after :meth:`attach_prefix`): reserves the KV of its first
        ``length`` positions, or raises :class:`specdec.rpc.errors.ResourceExhausted` saying what to
        change when the store's memory budget cannot hold them with room left for the running
        sequences to grow."""

    def lost(self, seq_id: int) -> str | None:
        """Why the sequence's KV was dropped (preempted to give another room), None while it holds
        it; a lost sequence runs no more steps and waits to be freed."""
        return None

    def kv_usage(self) -> KVUsage | None:
        """The KV blocks used and free within the store's budget, for the metrics (None: a store
        without a budget of blocks)."""
        return None

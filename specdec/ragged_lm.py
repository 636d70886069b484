"""A transformers causal LM as a :class:`specdec.batching.BatchedLM`: one forward over the new
tokens of many sequences, each reading and writing its own KV in place.

Layout (vLLM's flattened batch): the steps' tokens are concatenated into one row of T tokens,
``position_ids`` give each token its position in its own sequence, and every linear layer runs
once over all T (where batching pays). Attention is the one ragged part: a custom attention
function registered with transformers' ``AttentionInterface`` writes each sequence's new keys and
values into its slot of the KV store and attends its queries to that slot's cached positions
(causal within the step), one ``scaled_dot_product_attention`` per sequence and layer.

The KV store: one slot per sequence, a tensor ``[layers, 2 (key, value), kv_heads, capacity,
head_dim]`` of the model's dtype plus a length. Capacity grows by doubling (the only copy, amortised
over appends); rollback (:meth:`RaggedLM.truncate`) only lowers the length.

Why not transformers' own continuous batching (``transformers.generation.continuous_batching``:
``PagedAttentionCache`` with the ``sdpa_paged`` / ``paged|eager`` attention)? It is built around its
own generation loop: its manager schedules, samples and ends requests itself, and its cache
allocates blocks per request as tokens are generated. A speculative verifier needs to score K + 1
given tokens per sequence, read the logits of several positions, and give back rejected positions
every step, none of which that API exposes; driving its internals would tie us to private code
that changes between releases. The attention interface used here is public and stable.

Works for models whose attention layers call transformers' attention interface (Llama, Qwen2,
Mistral, Gemma 3 and most current decoder-only models); sliding-window layers (a ``sliding_window``
attribute on the attention module) get their window in the mask.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.batching import BatchedLM, SequenceStep

ATTENTION = "specdec_ragged"
MIN_CAPACITY = 64  # tokens a new slot holds before its first growth


@dataclass
class _Slot:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    length: int = 0


@dataclass
class _Layout:
    """The running step: per sequence, its slot, where its tokens start in the flattened row and
    how many there are. Passed to the attention function through the model's ``**kwargs``."""

    slots: list[_Slot]
    offsets: list[int]
    counts: list[int]


def _ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, ragged: _Layout, **_):
    """The attention function (transformers' interface): query ``[1, heads, T, head_dim]``, key and
    value ``[1, kv_heads, T, head_dim]`` of the flattened step; returns ``[1, T, heads, head_dim]``."""
    layer = module.layer_idx
    window = getattr(module, "sliding_window", None)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for slot, start, count in zip(ragged.slots, ragged.offsets, ragged.counts, strict=True):
        end, cached = start + count, slot.length
        slot.kv[layer, 0, :, cached : cached + count] = key[0, :, start:end]
        slot.kv[layer, 1, :, cached : cached + count] = value[0, :, start:end]
        keys = slot.kv[layer, 0, :, : cached + count]
        values = slot.kv[layer, 1, :, : cached + count]
        mask = None
        if count > 1 or (window and cached + count > window):
            q_pos = torch.arange(cached, cached + count).unsqueeze(1)
            k_pos = torch.arange(cached + count).unsqueeze(0)
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            mask = mask.to(query.device)
        attended = F.scaled_dot_product_attention(
            query[:, :, start:end],
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[0],
        )
        out[:, start:end] = attended.transpose(1, 2)
    return out, None


AttentionInterface.register(ATTENTION, _ragged_attention)


class RaggedLM(BatchedLM):
    """``model``: a loaded transformers causal LM, switched to the ragged attention here (its
    plain forward no longer works). The number of sequences is bounded by the service's session
    limit, their lengths by the context window."""

    def __init__(self, model):
        model.set_attn_implementation(ATTENTION)
        self.model = model
        config = model.config.get_text_config()
        self.vocab_size = config.vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._shape = (config.num_hidden_layers, 2, config.num_key_value_heads, head_dim)
        dtype = next(model.parameters()).dtype
        self._dtype, self._device = dtype, model.device
        self.bytes_per_token = (
            torch.tensor([], dtype=dtype).element_size()
            * config.num_hidden_layers
            * 2
            * config.num_key_value_heads
            * head_dim
        )
        self._slots: dict[int, _Slot] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # guards _slots against free() from other threads

    def allocate(self) -> int:
        with self._lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            self._slots[seq_id] = _Slot(self._new_kv(MIN_CAPACITY))
        return seq_id

    def free(self, seq_id: int) -> None:
        with self._lock:
            self._slots.pop(seq_id, None)

    def truncate(self, seq_id: int, length: int) -> None:
        slot = self._slots[seq_id]
        slot.length = min(slot.length, length)

    def cache_bytes(self, seq_id: int) -> int:
        slot = self._slots.get(seq_id)
        return slot.length * self.bytes_per_token if slot else 0

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        with self._lock:  # a sequence freed after its step was scheduled runs on a scratch slot
            slots = [self._slots.get(step.seq_id) or _Slot(self._new_kv(MIN_CAPACITY)) for step in steps]
        counts = [len(step.token_ids) for step in steps]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        for slot, count in zip(slots, counts, strict=True):
            self._reserve(slot, slot.length + count)
        tokens = [t for step in steps for t in step.token_ids]
        positions = [
            p for slot, count in zip(slots, counts, strict=True) for p in range(slot.length, slot.length + count)
        ]
        keep = [
            offset + count - step.num_logits + i
            for step, offset, count in zip(steps, offsets, counts, strict=True)
            for i in range(step.num_logits)
        ]
        device = self._device
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                ragged=_Layout(slots, offsets, counts),
            )
        for slot, count in zip(slots, counts, strict=True):
            slot.length += count
        logits = out.logits[0].float().cpu()
        return list(logits.split([step.num_logits for step in steps]))

    def _new_kv(self, capacity: int) -> torch.Tensor:
        layers, pair, heads, head_dim = self._shape
        return torch.empty(layers, pair, heads, capacity, head_dim, dtype=self._dtype, device=self._device)

    def _reserve(self, slot: _Slot, length: int) -> None:
        capacity = slot.kv.shape[3]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        grown = self._new_kv(capacity)
        grown[:, :, :, : slot.length] = slot.kv[:, :, :, : slot.length]
        slot.kv = grown

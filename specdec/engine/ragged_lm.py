"""A transformers causal LM as a :class:`specdec.engine.batching.BatchedLM`: one forward over the new
tokens of many sequences, each reading and writing its own KV in place.

Layout (vLLM's flattened batch): the step's tokens are concatenated into one row of T tokens,
``position_ids`` give each token its position in its own sequence, and every linear layer runs
once over all T (where batching pays). Attention is the one ragged part: a custom attention
function registered with transformers' ``AttentionInterface`` writes the step's new keys and
values into the KV store with one indexed write per layer, and attends every sequence's queries to
its own cached positions (causal within the step) in one padded ``scaled_dot_product_attention``
per layer and group of sequences of similar context. The indices and masks that do this are built
once per step (:class:`_StepLayout`), so no Python runs per sequence per layer.

The KV store (paged, as vLLM's PagedAttention, Kwon et al. 2023): one pool per model, a tensor
``[2 (key, value), rows, kv_heads, head_dim]`` of the model's dtype per layer, cut into blocks of
:data:`BLOCK_SIZE` rows. A sequence is a list of blocks (its block table) and a length; it grows by
taking free blocks, so nothing copies when a sequence grows, and rollback
(:meth:`RaggedLM.truncate`) only lowers the length.

Memory, by bytes (docs/architecture.md#kv-memory-a-budget-in-bytes; the budget and its automatic
default: :mod:`specdec.engine.kv_budget`):

- *Budget*: the pool holds at most ``kv_cache_max_bytes`` (whole blocks). It starts at
  ``num_blocks`` blocks and doubles when every block is taken, up to the budget and never past
  it; a layer at a time, so growing holds one layer's copy beyond the pool, not a second pool,
  and the old layers' memory is handed back at once (as after a shrink, below).
- *Admission* (:meth:`RaggedLM.admit`, before a prefill runs): a new sequence is promised the
  blocks its context needs when they can be had within the budget (free blocks, evictable
  prefix-cache blocks, room to grow, less the blocks promised to other sequences still
  prefilling) with a watermark (1% of the budget, at least one block, as vLLM's block manager)
  left for the running sequences to grow into; else RESOURCE_EXHAUSTED, before any work runs,
  saying whether the context could ever fit.
- *Preemption* (vLLM's recompute preemption, in :meth:`RaggedLM.forward`): when a step cannot
  have the blocks a sequence's new tokens need, a sequence of the owner whose sequences hold the
  most blocks (each sequence's owner given at :meth:`RaggedLM.allocate`: the coordinator's client,
  so that one key's long requests give first, not another key's short ones), its most recently
  admitted that holds any (it may be the one asking), is preempted: its KV is dropped, its step (if in this one) does
  not run, and :meth:`RaggedLM.lost` says why, so the engine fails its calls (NOT_FOUND; a
  prefill, RESOURCE_EXHAUSTED) and the service drops its session, which the coordinator rebuilds
  from its committed log. The other sequences of the step run.
- *Shrink*: after sequences are freed or preempted, the pool halves, down to its first size,
  while every block a live sequence holds, the blocks promised, and the prefix cache's blocks
  fit in its first quarter (so the halved pool is at most half used and does not grow back at
  the next block), and the freed memory is handed back (glibc's
  ``malloc_trim`` on a CPU, where the services keep freed memory otherwise, see
  :mod:`specdec.engine.host_memory`; the CUDA caching allocator's ``empty_cache`` on a GPU). The prefix
  cache keeps its blocks (up to ``prefix_cache_max_tokens``, the memory the operator gives it), so
  that a shared system prompt's next request does not prefill it again. No compaction: a block
  held high in the pool by a long sequence or the cache keeps the pool at its size until it is
  freed or evicted. Never during a
  forward (a free() then leaves it to the forward's end).

Prefix caching (:mod:`specdec.engine.prefix_cache`, on with ``prefix_cache_max_tokens``): a sequence's
blocks full of committed tokens are registered as they fill (:meth:`RaggedLM.commit`), and a new
sequence whose context begins with the same tokens takes those blocks into its block table
(:meth:`RaggedLM.attach_prefix`), shared, never written again, when both have the same cache salt
(a tenant's partition, set at that attach). A freed sequence's registered
blocks stay in the pool, evictable, up to ``prefix_cache_max_tokens`` tokens. A sequence that
needs a block takes a free one, else evicts the least recently released cached block, and only
when none is left does the pool double: the cache lives in blocks no sequence uses and never makes
the pool grow, nor refuses or preempts a sequence.

Attention: a sequence's queries are padded to
the group's longest, its keys gathered from its blocks and padded to the group's longest context,
and a boolean mask (causal within the step, padding, sliding window) built once per step; one
``scaled_dot_product_attention`` per layer then runs the whole group on the fused CPU kernel.
Sequences that bring more than :data:`MAX_PADDED_QUERIES` new tokens (prefill chunks) each attend
in a group of their own, so a long chunk does not pad every decode to its length; the others are
grouped by their number of new tokens, then by context, no group's longest more than
:data:`MAX_CONTEXT_RATIO` times its shortest (:func:`_padded_groups`), so a step mixing short chats
with long documents does not pad every chat to the longest document, and one sequence's verify of
K + 1 tokens does not pad every decode beside it to K + 1 queries. Not
``torch.nn.attention.varlen.varlen_attn`` (no padding, block tables): it runs on CUDA only; not
FlexAttention: it needs ``torch.compile`` on CPU (a recompile per new shape) and is slower than
SDPA in eager mode. A GPU port would take varlen or FlashAttention with the block table as is. The
gather copies each sequence's cached keys and values once per layer. Why, with the measurements:
docs/profiles.md#the-engine-loop-and-adaptive-k-under-load.

Why not transformers' own continuous batching (``transformers.generation.continuous_batching``:
``PagedAttentionCache`` with the ``sdpa_paged`` / ``paged|eager`` attention)? It is built around its
own generation loop: its manager schedules, samples and ends requests itself, and its cache
allocates blocks per request as tokens are generated. A speculative verifier needs to score K + 1
given tokens per sequence, read the logits of several positions, and give back rejected positions
every step, none of which that API exposes; driving its internals would tie us to private code
that changes between releases. The attention interface used here is public and stable.

Works for models whose attention layers call transformers' attention interface (Llama, Qwen2,
Mistral, Gemma 3 and most current decoder-only models), with grouped-query attention (fewer KV
heads than query heads); sliding-window layers (a ``sliding_window`` argument or attribute of the
attention module) get their window in the mask.
"""

import ctypes
import functools
import heapq
import logging
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.kv_budget import SETTING, KVUsage, automatic_budget, watermark_blocks
from specdec.engine.prefix_cache import ROOT, PrefixCache
from specdec.rpc.errors import ResourceExhausted

log = logging.getLogger(__name__)


class OverBudget(ResourceExhausted):
    """A context longer than the whole KV budget can ever hold (not only now): the verify service
    answers it FAILED_PRECONDITION, so that nobody waits for room that cannot come; to the draft
    service it is RESOURCE_EXHAUSTED, and the request goes on without the draft."""


ATTENTION = "specdec_ragged"
BLOCK_SIZE = 16  # KV rows (token positions) per block
NUM_BLOCKS = 64  # blocks in a new pool (1024 positions), doubled when all are taken (up to the budget)
MAX_PADDED_QUERIES = 16  # a sequence with more new tokens than this attends in a group of its own
MAX_CONTEXT_RATIO = 2.0  # longest / shortest context of the sequences one padded SDPA attends together


@dataclass(eq=False)  # compared by identity: kept in a set (RaggedLM._prefilling)
class _Sequence:
    """One sequence in the pool: its block table (block ids, in position order), cached length,
    the tokens at its cached positions, the prefix cache's nodes of its first blocks (those
    registered or found there: committed, shared, never written) and the cache salt they are
    registered under, the blocks it was promised at admission (its whole table, taken as its
    prefill's steps run) and, once preempted, why (it then holds nothing until it is freed)."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    cache_salt: str = ROOT
    promised: int = 0
    lost: str | None = None
    owner: str = ""

    @property
    def outstanding(self) -> int:
        """Blocks promised and not taken yet."""
        return max(0, self.promised - len(self.blocks))

    @property
    def holds_kv(self) -> bool:
        """Whether preempting it would give blocks (or promises) back."""
        return self.lost is None and bool(self.blocks or self.promised)


class _Group:
    """Sequences attended together by one padded SDPA per layer; B sequences, Q the most new tokens
    of one of them, C the longest context (cached + new). Built by :func:`_group`.

    Args:
        query_rows: ``[B * Q]`` int64, rows of the step's flattened queries; a sequence's padding
            repeats its last query (its output is never read). Or, when every sequence brings Q
            tokens and they are consecutive in the step, an int: the first of those B * Q rows (no
            gather).
        kv_rows: ``[B * C]`` int64, rows of the pool holding each sequence's positions 0..C-1
            (padding points into a block the sequence holds or block 0, masked out). Or, for one
            sequence whose blocks are consecutive in the pool, an int: its first row (no gather).
        context: C.
        query_positions: ``[B, Q]`` int64, each query's position in its sequence.
        needs_mask: False when every key of the padded batch is visible to every query (one new
            token each and equal contexts): SDPA then runs without a mask.
    """

    def __init__(self, query_rows, kv_rows, context: int, query_positions, needs_mask: bool):
        self.query_rows, self.kv_rows, self.context = query_rows, kv_rows, context
        self.query_positions, self.needs_mask = query_positions, needs_mask
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def mask(self, window: int | None) -> torch.Tensor | None:
        """``[B, 1, Q, C]`` bool, True where a query attends a key (causal, no padding, within
        ``window`` positions when set); built once per step and window."""
        if window not in self._masks:
            windowed = window is not None and self.context > window
            mask = None
            if self.needs_mask or windowed:
                key_positions = torch.arange(self.context, device=self.query_positions.device)
                query_positions = self.query_positions.unsqueeze(-1)
                mask = key_positions <= query_positions
                if windowed:
                    mask &= key_positions > query_positions - window
                mask = mask.unsqueeze(1)
            self._masks[window] = mask
        return self._masks[window]

    def attend(self, queries, pool, window: int | None, scale: float | None) -> torch.Tensor:
        """queries ``[T, heads, head_dim]`` of the step, pool ``[2, rows, kv_heads, head_dim]`` of
        one layer; returns ``[B * Q, heads, head_dim]``, row ``b * Q + i`` the output of sequence
        b's query i."""
        (batch, num_queries), context = self.query_positions.shape, self.context
        heads, head_dim, kv_heads = queries.shape[1], queries.shape[2], pool.shape[2]
        if isinstance(self.query_rows, int):
            queries = queries[self.query_rows : self.query_rows + batch * num_queries]
        else:
            queries = queries.index_select(0, self.query_rows)
        if isinstance(self.kv_rows, int):
            pool = pool[:, self.kv_rows : self.kv_rows + context]
        else:
            pool = pool.index_select(1, self.kv_rows)  # keys and values in one gather
        key, value = pool.view(2, batch, context, kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            queries.view(batch, num_queries, heads, head_dim).transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=self.mask(window),
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
        return out.transpose(1, 2).reshape(batch * num_queries, heads, head_dim)


@dataclass
class _StepLayout:
    """Everything the attention of one step needs, built once per step (:func:`_layout`) and passed
    to the attention function through the model's ``**kwargs``.

    ``pool``: the KV store, one tensor per layer (see the module docstring); ``write_rows``:
    ``[T]`` int64, the pool rows the step's new keys and values go to; ``groups``: the padded SDPAs;
    ``out_rows``: ``[T]`` int64, for each token of the step its row in the groups' outputs
    concatenated (None: the same rows).
    """

    pool: list[torch.Tensor]
    write_rows: torch.Tensor
    groups: list[_Group]
    out_rows: torch.Tensor | None


def _group(sequences: list[_Sequence], counts: list[int], offsets: list[int], device) -> _Group:
    """One padded SDPA over ``sequences`` (cached lengths before the step), bringing ``counts`` new
    tokens each from rows ``offsets`` of the step."""
    num_queries = max(counts)
    context = max(s.length + n for s, n in zip(sequences, counts, strict=True))
    steps = [[min(i, n - 1) for i in range(num_queries)] for n in counts]
    query_rows = [o + i for o, row in zip(offsets, steps, strict=True) for i in row]
    in_order = query_rows == list(range(offsets[0], offsets[0] + len(query_rows)))
    blocks = -(-context // BLOCK_SIZE)
    table = [(s.blocks + [0] * blocks)[:blocks] for s in sequences]
    kv_rows: torch.Tensor | int = table[0][0] * BLOCK_SIZE
    if len(table) > 1 or table[0] != list(range(table[0][0], table[0][0] + blocks)):
        block_rows = torch.tensor(table).unsqueeze(-1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE)
        kv_rows = block_rows.view(len(sequences), -1)[:, :context].flatten().to(device)
    return _Group(
        offsets[0] if in_order else torch.tensor(query_rows, device=device),
        kv_rows,
        context,
        torch.tensor([[s.length + i for i in row] for s, row in zip(sequences, steps, strict=True)], device=device),
        num_queries > 1 or any(s.length + n != context for s, n in zip(sequences, counts, strict=True)),
    )


def _padded_groups(sequences: list[_Sequence], counts: list[int]) -> list[list[int]]:
    """The sequences that bring at most MAX_PADDED_QUERIES new tokens, in groups of the same
    number of new tokens and similar context (cached + new): by increasing count, then context, a
    group closes where the count changes or the next context is more than MAX_CONTEXT_RATIO times
    the group's shortest, so a group pads no sequence's queries and no sequence to more than that
    ratio of its own context (one group when every sequence decodes and the contexts are alike)."""
    narrow = sorted(
        (i for i, n in enumerate(counts) if 0 < n <= MAX_PADDED_QUERIES),
        key=lambda i: (counts[i], sequences[i].length + counts[i]),
    )
    groups: list[list[int]] = []
    shortest, width = 0, 0
    for i in narrow:
        context = sequences[i].length + counts[i]
        if not groups or counts[i] != width or context > MAX_CONTEXT_RATIO * shortest:
            groups.append([])
            shortest, width = context, counts[i]
        groups[-1].append(i)
    return groups


def _layout(pool: list[torch.Tensor], sequences: list[_Sequence], counts: list[int]) -> _StepLayout:
    """The step's layout for ``sequences`` (cached lengths before the step) bringing ``counts``
    new tokens each, in that order in the flattened step."""
    device = pool[0].device
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    members = _padded_groups(sequences, counts)
    members += [[i] for i, n in enumerate(counts) if n > MAX_PADDED_QUERIES]
    groups, out_rows, base = [], [0] * sum(counts), 0
    for group in members:
        groups.append(
            _group([sequences[i] for i in group], [counts[i] for i in group], [offsets[i] for i in group], device)
        )
        width = max(counts[i] for i in group)
        for b, i in enumerate(group):
            for j in range(counts[i]):
                out_rows[offsets[i] + j] = base + b * width + j
        base += len(group) * width
    write_rows = [
        s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s, n in zip(sequences, counts, strict=True)
        for p in range(s.length, s.length + n)
    ]
    in_order = base == len(out_rows) and out_rows == list(range(base))  # no padding, nothing reordered
    return _StepLayout(
        pool,
        torch.tensor(write_rows, device=device),
        groups,
        None if in_order else torch.tensor(out_rows, device=device),
    )


def _ragged_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, *, ragged, **_
):
    """The attention function (transformers' interface): query ``[1, heads, T, head_dim]``, key and
    value ``[1, kv_heads, T, head_dim]`` of the flattened step, ``ragged`` the :class:`_StepLayout`;
    returns ``[1, T, heads, head_dim]``. A sliding window comes as an argument (Mistral) or as the
    module's ``sliding_window`` attribute (Qwen2, Gemma 3)."""
    pool = ragged.pool[module.layer_idx]
    pool[0].index_copy_(0, ragged.write_rows, key[0].transpose(0, 1))
    pool[1].index_copy_(0, ragged.write_rows, value[0].transpose(0, 1))
    queries = query[0].transpose(0, 1)
    window = sliding_window or getattr(module, "sliding_window", None)
    outs = [group.attend(queries, pool, window, scaling) for group in ragged.groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out if ragged.out_rows is None else out.index_select(0, ragged.out_rows)).unsqueeze(0), None


AttentionInterface.register(ATTENTION, _ragged_attention)


class RaggedLM(BatchedLM):
    """``model``: a loaded transformers causal LM, switched to the ragged attention here (its
    plain forward no longer works). ``num_blocks``: the pool's first size in blocks of
    :data:`BLOCK_SIZE` positions. ``prefix_cache_max_tokens``: None leaves prefix caching off;
    else the most tokens the prefix cache keeps for freed sequences (rounded down to whole
    blocks; 0 still shares blocks between live sequences). ``kv_cache_max_bytes``: the pool's
    budget in bytes (0: :func:`specdec.engine.kv_budget.automatic_budget`); ``name`` names the store in
    refusals ("verify service"). The number of sequences is bounded by the service's session
    limit, their lengths by the context window and the budget.

    Raises ValueError when the budget holds less than one block."""

    def __init__(
        self,
        model,
        num_blocks: int = NUM_BLOCKS,
        prefix_cache_max_tokens: int | None = None,
        kv_cache_max_bytes: int = 0,
        name: str = "KV store",
    ):
        model.set_attn_implementation(ATTENTION)
        self.model = model
        self.name = name
        config = model.config.get_text_config()
        self.vocab_size = config.vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype, device = next(model.parameters()).dtype, model.device
        self.bytes_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype.itemsize
        self.block_bytes = self.bytes_per_token * BLOCK_SIZE
        self.kv_cache_max_bytes = kv_cache_max_bytes or automatic_budget(_free_device_bytes(device))
        self.max_blocks = self.kv_cache_max_bytes // self.block_bytes
        if self.max_blocks < 1:
            raise ValueError(
                f"{SETTING} ({self.kv_cache_max_bytes} bytes) holds no KV block of the {name} ({BLOCK_SIZE} tokens, "
                f"{self.block_bytes} bytes): raise it"
            )
        self.watermark = watermark_blocks(self.max_blocks)
        self._first_blocks = min(num_blocks, self.max_blocks)
        rows = self._first_blocks * BLOCK_SIZE
        self._pool = [  # zeros: padding reads rows no step wrote, and 0 x NaN would be NaN
            torch.zeros(2, rows, config.num_key_value_heads, head_dim, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)
        ]
        self._free = list(range(self._first_blocks))  # a heap: the lowest free block first, so the pool stays compact
        self._sequences: dict[int, _Sequence] = {}  # in admission (allocation) order
        # the sequences with blocks promised and not taken yet (still prefilling): those the budget's
        # arithmetic sums over, so that it costs no sum over every sequence
        self._prefilling: set[_Sequence] = set()
        self._next_id = 0
        self._cache = None
        if prefix_cache_max_tokens is not None:
            self._cache = PrefixCache(BLOCK_SIZE, prefix_cache_max_tokens // BLOCK_SIZE)
        self.prefix_caching = self._cache is not None
        self.num_preemptions = 0
        self._stepping = False  # a forward is running: the pool must not shrink under it
        self._shrink_due = False  # blocks came back since the last look at shrinking
        # guards _sequences, _free, _cache and the pool against free(), admit() and attach_prefix()
        # from other threads
        self._lock = threading.Lock()

    def allocate(self, owner: str = "") -> int:
        with self._lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            self._sequences[seq_id] = _Sequence(owner=owner)
        return seq_id

    def free(self, seq_id: int) -> None:
        with self._lock:
            sequence = self._sequences.pop(seq_id, None)
            if sequence is not None:
                self._prefilling.discard(sequence)
                self._release(sequence)
                self._shrink()

    def truncate(self, seq_id: int, length: int) -> None:
        """Raises ValueError below the sequence's shared blocks (its committed positions)."""
        with self._lock:
            sequence = self._sequences[seq_id]
            if length < len(sequence.nodes) * BLOCK_SIZE:
                raise ValueError(
                    f"rollback to {length} tokens goes below the {len(sequence.nodes) * BLOCK_SIZE} committed "
                    "tokens the sequence shares through the prefix cache"
                )
            sequence.length = min(sequence.length, length)
            del sequence.tokens[length:]

    def cache_bytes(self, seq_id: int) -> int:
        sequence = self._sequences.get(seq_id)
        return sequence.length * self.bytes_per_token if sequence else 0

    def attach_prefix(self, seq_id: int, token_ids: Sequence[int], cache_salt: str = ROOT) -> int:
        """Whole blocks only: the longest chain of registered blocks of ``cache_salt`` that
        ``token_ids`` begins with; the sequence's own blocks are registered under that salt."""
        if self._cache is None:
            return 0
        with self._lock:
            sequence = self._sequences[seq_id]
            if sequence.length:
                raise ValueError(f"sequence {seq_id} holds {sequence.length} tokens: a prefix attaches to a new one")
            sequence.cache_salt = cache_salt
            sequence.blocks, sequence.nodes = self._cache.match(token_ids, cache_salt)
            sequence.length = len(sequence.blocks) * BLOCK_SIZE
            sequence.tokens = list(token_ids[: sequence.length])
        return sequence.length

    def admit(self, seq_id: int, length: int) -> None:
        """Promises the new sequence the blocks of ``length`` positions (see the module docstring).
        Raises ResourceExhausted, naming ``kv_cache_max_bytes``, when they cannot be had now with the
        watermark left free; OverBudget when they can never be."""
        with self._lock:
            sequence = self._sequences[seq_id]
            if sequence.lost is not None:  # preempted for the blocks its prefix holds, before it was admitted
                raise ResourceExhausted(sequence.lost)
            total = -(-length // BLOCK_SIZE)
            budget = f"the KV budget of the {self.name} ({SETTING} = {self.kv_cache_max_bytes} bytes)"
            if total + self.watermark > self.max_blocks:
                raise OverBudget(
                    f"a context of {length} tokens needs {total} KV blocks of {BLOCK_SIZE} tokens and {self.watermark} "
                    f"kept free beside them: more than {budget} can ever hold; raise --kv-cache-max-bytes to at least "
                    f"{(total + self.watermark) * self.block_bytes} bytes, or shorten the prompt"
                )
            needed, available = total - len(sequence.blocks), self._available()
            if needed + self.watermark > available:
                raise ResourceExhausted(
                    f"{budget} is full: a context of {length} tokens needs {needed} more blocks of {BLOCK_SIZE} "
                    f"tokens, {max(0, available - self.watermark)} are free beyond the {self.watermark} kept for the "
                    "running sessions to grow; retry later, or raise --kv-cache-max-bytes or lower --max-sessions"
                )
            sequence.promised = total
            if sequence.outstanding:
                self._prefilling.add(sequence)

    def lost(self, seq_id: int) -> str | None:
        """Why the sequence was preempted, None while it holds its KV (or is unknown)."""
        sequence = self._sequences.get(seq_id)
        return None if sequence is None else sequence.lost

    def kv_usage(self) -> KVUsage:
        """O(sequences still prefilling) under the store's lock: cheap enough for every message."""
        with self._lock:
            return KVUsage(
                self.block_bytes,
                self.max_blocks,
                self._pool_blocks(),
                self._used_blocks(),
                self._evictable(),
                self.num_preemptions,
                BLOCK_SIZE,
            )

    def commit(self, seq_id: int, length: int) -> None:
        """Registers the sequence's blocks that ``length`` committed tokens fill (see the module
        docstring); called by the engine thread, between steps."""
        sequence = self._sequences.get(seq_id)
        if self._cache is None or sequence is None or min(length, sequence.length) // BLOCK_SIZE <= len(sequence.nodes):
            return
        with self._lock:
            if self._sequences.get(seq_id) is not sequence:  # freed meanwhile
                return
            for index in range(len(sequence.nodes), min(length, sequence.length) // BLOCK_SIZE):
                parent = sequence.nodes[-1] if sequence.nodes else sequence.cache_salt
                tokens = sequence.tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                sequence.nodes.append(self._cache.register(parent, tokens, sequence.blocks[index]))

    def prefix_cache_tokens(self) -> int:
        return self._cache.num_evictable * BLOCK_SIZE if self._cache is not None else 0

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        """As :meth:`specdec.engine.batching.BatchedLM.forward`; a sequence freed or preempted (here, to
        give another room, see the module docstring) does not run, and its logits are zeros."""
        counts = [len(step.token_ids) for step in steps]
        with self._lock:
            self._stepping = True
            found = [self._sequences.get(step.seq_id) for step in steps]
            for sequence, count in zip(found, counts, strict=True):
                if sequence is not None and sequence.lost is None:
                    self._make_room(sequence, sequence.length + count)
            runs = [i for i, sequence in enumerate(found) if sequence is not None and sequence.lost is None]
            sequences = [s for s in found if s is not None and s.lost is None]
            layout = _layout(self._pool, sequences, [counts[i] for i in runs]) if runs else None
        try:
            logits = self._run([steps[i] for i in runs], sequences, layout) if layout else []
        finally:
            with self._lock:
                self._stepping = False
                self._shrink()
        ran = dict(zip(runs, logits, strict=True))
        return [ran[i] if i in ran else torch.zeros(step.num_logits, self.vocab_size) for i, step in enumerate(steps)]

    def _run(self, steps: list[SequenceStep], sequences: list[_Sequence], layout: _StepLayout) -> list[torch.Tensor]:
        """The model's forward over ``steps`` of ``sequences`` (their blocks reserved), appending their tokens."""
        counts = [len(step.token_ids) for step in steps]
        tokens = [t for step in steps for t in step.token_ids]
        positions = [p for s, count in zip(sequences, counts, strict=True) for p in range(s.length, s.length + count)]
        ends = [sum(counts[: i + 1]) for i in range(len(counts))]
        keep = [e - step.num_logits + i for step, e in zip(steps, ends, strict=True) for i in range(step.num_logits)]
        device = self._pool[0].device
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                ragged=layout,
            )
        with self._lock:  # a sequence freed during the step gave its blocks back already
            for step, sequence, count in zip(steps, sequences, counts, strict=True):
                sequence.length += count
                sequence.tokens += step.token_ids
        logits = out.logits[0].float().cpu()
        return list(logits.split([step.num_logits for step in steps]))

    # --- blocks (holding the lock) -------------------------------------------------------

    def _pool_blocks(self) -> int:
        return self._pool[0].shape[1] // BLOCK_SIZE

    def _evictable(self) -> int:
        return self._cache.num_evictable if self._cache is not None else 0

    def _used_blocks(self) -> int:
        """Blocks live sequences hold, or were promised and have not taken yet."""
        promised = sum(s.outstanding for s in self._prefilling)
        return self._pool_blocks() - len(self._free) - self._evictable() + promised

    def _available(self) -> int:
        """Blocks a sequence could still take within the budget: free ones, evictable cached ones
        and room to grow, less those promised to sequences still prefilling."""
        return self.max_blocks - self._used_blocks()

    def _make_room(self, sequence: _Sequence, length: int) -> None:
        """Gives ``sequence`` the blocks of ``length`` positions, preempting sequences
        (:meth:`_victim`) until they fit (``sequence`` itself, when it is its turn: it then takes
        nothing)."""
        needed = -(-length // BLOCK_SIZE) - len(sequence.blocks)
        if needed <= 0:  # most steps: the new tokens fit the last block (and no sum over the sequences)
            return
        while needed > self._available() + sequence.outstanding:
            victim = self._victim() or sequence
            self._preempt(victim)
            if victim is sequence:
                return
        self._reserve(sequence, length)

    def _victim(self) -> _Sequence | None:
        """The sequence to preempt: the most recently admitted one holding KV of the owner whose
        sequences hold the most blocks (taken or promised); of owners holding as many, the one
        admitted last. None when no sequence holds any."""
        held: dict[str, int] = {}
        newest: dict[str, tuple[int, _Sequence]] = {}
        for order, candidate in enumerate(self._sequences.values()):  # in admission order
            if candidate.holds_kv:
                held[candidate.owner] = held.get(candidate.owner, 0) + max(len(candidate.blocks), candidate.promised)
                newest[candidate.owner] = (order, candidate)
        if not held:
            return None
        owner = max(held, key=lambda o: (held[o], newest[o][0]))
        return newest[owner][1]

    def _preempt(self, sequence: _Sequence) -> None:
        """Drops the sequence's KV (vLLM's recompute preemption: it is computed again from the
        committed log when its session is rebuilt)."""
        sequence.lost = (
            f"preempted: the KV budget of the {self.name} ({SETTING} = {self.kv_cache_max_bytes} bytes) was full "
            "when a running session needed room to grow, and this session was the most recently admitted of the "
            "owner holding the most KV; prefill it again (the coordinator rebuilds it from its committed log), or "
            "raise --kv-cache-max-bytes or lower --max-sessions"
        )
        self._prefilling.discard(sequence)
        self._release(sequence)
        sequence.length, sequence.tokens, sequence.promised = 0, [], 0
        self.num_preemptions += 1
        log.warning("%s: a sequence preempted, the KV budget (%d bytes) being full", self.name, self.kv_cache_max_bytes)

    def _reserve(self, sequence: _Sequence, length: int) -> None:
        """Gives ``sequence`` blocks for ``length`` positions: free ones, else the prefix cache's
        least recently released, else the pool grows (the caller made sure one of them can)."""
        for _ in range(-(-length // BLOCK_SIZE) - len(sequence.blocks)):
            if not self._free and self._cache is not None and self._cache.num_evictable:
                heapq.heappush(self._free, self._cache.evict())
            if not self._free:
                self._grow()
            sequence.blocks.append(heapq.heappop(self._free))
        if not sequence.outstanding:
            self._prefilling.discard(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """Gives a sequence's blocks back: its own to the free blocks, its registered ones to the
        prefix cache (the last block first), which keeps them up to its bound."""
        for block in reversed(sequence.blocks):
            if self._cache is None or self._cache.release(block):
                heapq.heappush(self._free, block)
        if self._cache is not None:
            for block in self._cache.trim():
                heapq.heappush(self._free, block)
        sequence.blocks, sequence.nodes = [], []
        self._shrink_due = True

    def _grow(self) -> None:
        """Doubles the pool, up to the budget (one copy of the cached KV, a layer at a time), and
        hands the old layers' memory back, so that it does not stay resident beside the new pool."""
        blocks = self._pool_blocks()
        grown = min(2 * blocks, self.max_blocks)
        for i, layer in enumerate(self._pool):
            bigger = layer.new_zeros(2, grown * BLOCK_SIZE, *layer.shape[2:])
            bigger[:, : blocks * BLOCK_SIZE] = layer
            self._pool[i] = bigger
        del layer, bigger
        _give_back_memory(self._pool[0].device)
        for block in range(blocks, grown):
            heapq.heappush(self._free, block)

    def _shrink(self) -> None:
        """Halves the pool while the rule of the module docstring allows, and hands the memory back."""
        if self._stepping or not self._shrink_due:
            return
        self._shrink_due = False
        blocks = self._pool_blocks()
        top = max((b + 1 for s in self._sequences.values() for b in s.blocks), default=0)
        if self._cache is not None:
            top = max(top, self._cache.top_block())
        used, size = self._used_blocks(), blocks
        while size > self._first_blocks and 4 * max(top, used) <= size:
            size = max(size // 2, self._first_blocks)
        if size == blocks:
            return
        self._free = [block for block in self._free if block < size]
        heapq.heapify(self._free)
        for i, layer in enumerate(self._pool):
            self._pool[i] = layer[:, : size * BLOCK_SIZE].clone()
        _give_back_memory(self._pool[0].device)


def _free_device_bytes(device: torch.device) -> int | None:
    """A GPU's free memory in bytes (None on a CPU)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def _give_back_memory(device: torch.device) -> None:
    """Returns freed memory to the system: the CUDA caching allocator's, or glibc's heap."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif (libc := _libc()) is not None:
        libc.malloc_trim(0)

"""The prefix cache of a paged KV store: full blocks of committed tokens, found again by content.

Automatic prefix caching as vLLM's (Kwon et al. 2023, and vLLM v1's ``KVCacheManager``): a block
of :data:`specdec.engine.ragged_lm.BLOCK_SIZE` positions whose tokens are all committed is final, because
the keys and values at position p depend only on the tokens at positions <= p and rollback never
goes below the committed length. Such a block is *registered* under a key made of its parent's
(the block before it in its sequence) and its own token ids, so a later sequence whose context
begins with the same tokens finds the whole chain, block by block from the first, and attends to
those blocks instead of computing them again (SGLang's radix cache keeps the same tree, one token
per edge instead of one block).

Keys, the choice: vLLM chains hashes (the parent block's hash with the block's token ids), and a
hash collision would hand one context another's KV. Here the key holds the token ids themselves
and the parent's *node*, a number given to each registered block once and never reused, so a key
names exactly one chain of token ids and no collision can happen; the dictionary hashes the key
for its lookup and then compares it whole.

Partitions (vLLM's ``cache_salt``): a sequence's first block has no parent node; its key names
the sequence's *cache salt* instead, a string (:data:`ROOT`, empty, for a sequence without one).
Every later block's key names its parent's node, so two sequences of different salts never share
a block, whatever their tokens: the services salt each session with its tenant's
(docs/security.md#tenants-and-the-caches), so a tenant finds only the blocks its own sessions
computed.

Sharing: a registered block counts the live sequences that hold it (``refs``); none writes into
it (its positions are committed). When the last one lets go, the block stays cached, unreferenced
and *evictable*, until a new sequence finds it again or the store needs its memory: evictable
blocks leave least recently released first (LRU), and a released sequence's last block before its
first, as vLLM's free queue does, since a later context is likelier to share the beginning.
At most ``max_blocks`` are kept evictable; more are evicted at once.

A block computed twice (two sequences prefilled the same context at the same time) is registered
once; the second copy stays the sequence's own and is freed with it.

Not thread-safe: the KV store that owns it calls it under its own lock.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = ""  # the parent of a sequence's first block without a cache salt (with one: the salt)
DEFAULT_MAX_TOKENS = 16384  # tokens kept for freed sequences by default (the services' --prefix-cache-max-tokens)

Parent = int | str  # a block's parent: the node of the block before it, or for a first block its cache salt
Key = tuple[Parent, tuple[int, ...]]  # (parent, the block's token ids)


@dataclass
class _Cached:
    """A registered block: its id in the pool, its key, its node and the live sequences holding it."""

    block: int
    key: Key
    node: int
    refs: int = 1


class PrefixCache:
    """Registered blocks of ``block_size`` positions, at most ``max_blocks`` of them evictable
    (unreferenced); see the module docstring."""

    def __init__(self, block_size: int, max_blocks: int):
        if block_size < 1 or max_blocks < 0:
            raise ValueError("block_size must be at least 1 and max_blocks at least 0")
        self.block_size, self.max_blocks = block_size, max_blocks
        self._by_key: dict[Key, _Cached] = {}
        self._by_block: dict[int, _Cached] = {}
        self._evictable: OrderedDict[int, _Cached] = OrderedDict()  # by block, least recently released first
        self._next_node = 0

    def match(self, token_ids: Sequence[int], cache_salt: str = ROOT) -> tuple[list[int], list[int]]:
        """The longest chain of registered blocks that ``token_ids`` begins with, registered by
        sequences of ``cache_salt``, each now held once more (by the caller's sequence). Returns
        its block ids and their nodes, in position order (``len(blocks) * block_size`` tokens
        matched)."""
        blocks: list[int] = []
        nodes: list[int] = []
        parent: Parent = cache_salt
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            cached = self._by_key.get((parent, tuple(token_ids[start : start + self.block_size])))
            if cached is None:
                break
            if cached.refs == 0:
                del self._evictable[cached.block]
            cached.refs += 1
            blocks.append(cached.block)
            nodes.append(cached.node)
            parent = cached.node
        return blocks, nodes

    def register(self, parent: Parent, token_ids: Sequence[int], block: int) -> int:
        """Registers ``block``, full of the committed ``token_ids`` after the chain ending in node
        ``parent`` (for a sequence's first block: its cache salt, ROOT without one), as held by
        its sequence. Returns the node
        that the sequence's next block names as its parent: a new one, or, when the same chain is
        registered already (computed twice), that one's (``block`` then stays the sequence's own)."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a registered block holds {self.block_size} tokens, not {len(token_ids)}")
        key = (parent, tuple(token_ids))
        cached = self._by_key.get(key)
        if cached is None:
            cached = _Cached(block, key, self._next_node)
            self._next_node += 1
            self._by_key[key] = self._by_block[block] = cached
        return cached.node

    def release(self, block: int) -> bool:
        """The caller's sequence lets go of ``block``; True when it is not registered (the caller
        frees it), False when the cache keeps it (evictable once no sequence holds it). Release a
        sequence's blocks last first."""
        cached = self._by_block.get(block)
        if cached is None:
            return True
        cached.refs -= 1
        if cached.refs == 0:
            self._evictable[block] = cached
        return False

    def trim(self) -> list[int]:
        """Evicts the least recently released blocks beyond ``max_blocks``; returns them (free)."""
        return [self.evict() for _ in range(len(self._evictable) - self.max_blocks)]

    def evict(self) -> int:
        """Evicts the least recently released unreferenced block and returns it (now free).
        Raises KeyError when there is none (see :attr:`num_evictable`)."""
        block, cached = self._evictable.popitem(last=False)
        self._forget(cached)
        return block

    def top_block(self) -> int:
        """One past the highest block the cache keeps (0 when it keeps none): a pool that shrinks
        keeps it."""
        return max(self._by_block, default=-1) + 1

    def _forget(self, cached: _Cached) -> None:
        del self._by_key[cached.key], self._by_block[cached.block]

    @property
    def num_evictable(self) -> int:
        """Registered blocks no live sequence holds (kept for later contexts)."""
        return len(self._evictable)

"""SuffixDecoding: propose the most frequent continuation of the context's longest matching suffixes.

Follows Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(NeurIPS 2025), as vLLM's ``method: suffix`` runs it (Arctic Inference's ``SuffixDecodingCache``),
with our own code. Two kinds of suffix tree, both cut at ``max_depth`` tokens:

- one per request (:class:`SuffixIndex`), over its prompt and its output so far;
- one shared by the requests of one cache salt (:class:`SuffixCache`, a partition per salt: a
  tenant drafts only from its own outputs, docs/security.md#tenants-and-the-caches), over the
  outputs of its previous and running requests, bounded in requests and tokens over all
  partitions, evicting the oldest output of the largest partition first.

A proposal starts at every suffix of the context that a tree holds (n tokens, the match length)
and follows the most frequent next token. Each token's probability is estimated from counts, as
the share of the current string's continuations that continue with it; the running product of
these is the proposal's confidence at that position. A proposal stops when the confidence falls
below ``min_token_prob``, after ``max_spec_factor * n`` tokens (short matches propose little), at
``max_depth`` or at K. Its score is the sum of the confidences, the expected number of accepted
tokens were the counts the truth; the best score over both trees and every n is proposed.
Model-free like :mod:`specdec.lookups.ngram`, which proposes what followed the latest match instead.
"""

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

DRAFTER_NAME = "suffix"  # how requests and metrics name suffix decoding, wherever it runs


@dataclass(frozen=True)
class SuffixMatch:
    """``n``: length in tokens of the matched suffix; ``tokens``: up to K proposed ids;
    ``probs``: the confidence at each position of ``tokens`` (non-increasing, in (0, 1])."""

    n: int
    tokens: list[int]
    probs: list[float]

    @property
    def score(self) -> float:
        """Expected accepted tokens under the count estimates: the sum of ``probs``."""
        return sum(self.probs)


@dataclass(frozen=True)
class ProposalLimits:
    """How far a proposal goes. ``max_spec_factor`` (> 0): a match of n tokens proposes at most
    ``max_spec_factor * n`` tokens; ``min_token_prob`` (in [0, 1]): the lowest confidence a
    proposed token may have. Raises ValueError outside these ranges."""

    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    def __post_init__(self):
        if not self.max_spec_factor > 0:
            raise ValueError(f"suffix max_spec_factor is {self.max_spec_factor}: it must be positive")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"suffix min_token_prob is {self.min_token_prob}: it must lie in [0, 1]")


ROOT = 0  # the node of every tree's empty string
UNKNOWN = -1  # a node's most frequent child not known: none yet, or to be found again
# A tree whose removed nodes (kept for reuse) outnumber its live ones by more than this is built
# again without them (:meth:`SuffixCache._evict`), so that a partition that once held many tokens
# does not keep their memory: the cache's bound in tokens bounds its memory whatever the partitions.
MAX_SPARE_NODES = 4096


class SuffixTree:
    """The suffix trie of some token sequences, cut at ``max_depth`` tokens.

    Each sequence keeps its open suffixes (the nodes of its suffixes shorter than ``max_depth``),
    so appending a token costs O(max_depth), and n tokens hold at most n * max_depth nodes.
    ``sequences`` maps each key to its tokens, oldest key first. Raises ValueError unless
    max_depth >= 2.

    A node is an integer: its children (the child by the token that follows) and its count (the
    string's occurrences) are entries of two lists, and the ids of removed nodes are reused. Not
    an object each, because a dict that holds only ints is not tracked by Python's cyclic garbage
    collector, whose full collections over node objects stall the coordinator's event loop
    (docs/profiles.md#where-the-cpu-time-goes).

    Each node also keeps the sum of its children's counts and the token of its most frequent
    child, updated as counts change (a removal that lowers the most frequent child's count leaves
    it to be found again at the next proposal), so a proposal's step costs O(1), not a scan of the
    node's children: the shared cache's nodes of one-token strings have hundreds of them
    (docs/architecture.md#the-services). Among equally frequent children, either may be proposed.
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"suffix max_depth is {max_depth}: it must be at least 2")
        self.max_depth = max_depth
        self.sequences: dict[Hashable, list[int]] = {}
        self.num_tokens = 0
        self._children: list[dict[int, int]] = [{}]  # by node: its children by token
        self._counts: list[int] = [0]  # by node: its string's occurrences
        self._totals: list[int] = [0]  # by node: the sum of its children's counts
        self._best: list[int] = [UNKNOWN]  # by node: the token of its most frequent child
        self._free: list[int] = []  # removed nodes, reused
        self._open: dict[Hashable, list[int]] = {}

    @property
    def num_spare_nodes(self) -> int:
        """How many more removed nodes (kept for reuse: their memory is not given back) than live
        ones the tree holds."""
        return 2 * len(self._free) - len(self._counts)

    def rebuilt(self) -> "SuffixTree":
        """A tree of the same sequences and open suffixes without the removed nodes:
        O(tokens * max_depth)."""
        tree = SuffixTree(self.max_depth)
        for key, tokens in self.sequences.items():
            tree.extend(key, tokens)
        return tree

    def children(self, node: int) -> dict[int, int]:
        """The node's children, by the token that follows its string (not to be changed)."""
        return self._children[node]

    def count(self, node: int) -> int:
        """How often the node's string occurs in the sequences."""
        return self._counts[node]

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to sequence ``key`` (a new key starts an empty sequence)."""
        open_nodes = self._open.get(key, [ROOT])
        for token in tokens:
            open_nodes = self._append(open_nodes, token)
        self._open[key] = open_nodes
        self.sequences.setdefault(key, []).extend(tokens)
        self.num_tokens += len(tokens)

    def _append(self, open_nodes: list[int], token: int) -> list[int]:
        # open_nodes[i] is the node of the sequence's suffix of length i (0: the root); each
        # suffix grows by ``token``, and those that reach max_depth close.
        counts, best = self._counts, self._best
        grown = []
        for node in open_nodes:
            children = self._children[node]
            child = children.get(token)
            if child is None:
                child = children[token] = self._new_node()
            counts[child] += 1
            self._totals[node] += 1
            if len(children) == 1 or (best[node] != UNKNOWN and counts[child] > counts[children[best[node]]]):
                best[node] = token
            grown.append(child)
        return [ROOT, *grown[: self.max_depth - 1]]

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self._children.append({})
        self._counts.append(0)
        self._totals.append(0)
        self._best.append(UNKNOWN)
        return len(self._counts) - 1

    def remove(self, key: Hashable) -> None:
        """Forgets sequence ``key``: O(its length * max_depth)."""
        tokens = self.sequences.pop(key)
        del self._open[key]
        self.num_tokens -= len(tokens)
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start : start + self.max_depth]:
                child = self._children[node][token]
                self._counts[child] -= 1
                self._totals[node] -= 1
                if self._best[node] == token:  # another child may be the most frequent now
                    self._best[node] = UNKNOWN
                if self._counts[child] == 0:  # nothing else passes through it, nor below it
                    del self._children[node][token]
                    self._free_below(child)
                    break
                node = child

    def _free_below(self, node: int) -> None:
        """Frees ``node`` and every node below it."""
        below = [node]
        while below:
            node = below.pop()
            below.extend(self._children[node].values())
            self._children[node], self._counts[node], self._totals[node], self._best[node] = {}, 0, 0, UNKNOWN
            self._free.append(node)

    def matches(self, context: Sequence[int]) -> Iterator[tuple[int, int]]:
        """(n, node) for each suffix of ``context`` the tree holds, n = 1, 2, ... up to
        max_depth - 1 (a node at max_depth has no continuation). O(max_depth^2)."""
        for n in range(1, min(len(context), self.max_depth - 1) + 1):
            node = ROOT
            for token in context[len(context) - n :]:
                child = self._children[node].get(token)
                if child is None:  # a longer suffix contains this one: none of them is held
                    return
                node = child
            yield n, node

    def suffixes(self, key: Hashable) -> Iterator[tuple[int, int]]:
        """What :meth:`matches` finds for sequence ``key`` itself, in O(max_depth): its open suffixes."""
        yield from enumerate(self._open[key][1:], 1)

    def propose(
        self, context: Sequence[int], k: int, limits: ProposalLimits, to_beat: SuffixMatch | None = None
    ) -> SuffixMatch | None:
        """The best-scoring proposal of up to ``k`` tokens continuing ``context`` (see the module
        docstring), or ``to_beat`` unless one scores higher; None without either. O(max_depth *
        (max_depth + k))."""
        return self.best_proposal(self.matches(context), k, limits, to_beat)

    def best_proposal(
        self, matches: Iterable[tuple[int, int]], k: int, limits: ProposalLimits, to_beat: SuffixMatch | None = None
    ) -> SuffixMatch | None:
        """The best-scoring proposal from the (n, node) ``matches`` (see the module docstring; on a
        tie the longer match), or ``to_beat`` unless one scores higher. Longest match first, and
        none shorter once the tokens it may propose (each of confidence at most 1) cannot score
        above the best so far: in repetitive text every suffix matches and the longest is sure."""
        best = to_beat
        for n, node in sorted(matches, reverse=True):
            limit = min(k, int(limits.max_spec_factor * n + 1e-9))
            if best is not None and limit <= best.score:
                break  # the limit only falls with n
            tokens, probs = self._most_frequent_path(node, limit, limits.min_token_prob)
            if tokens and (best is None or sum(probs) > best.score):
                best = SuffixMatch(n, tokens, probs)
        return best

    def _most_frequent_path(self, node: int, limit: int, min_token_prob: float) -> tuple[list[int], list[float]]:
        """Up to ``limit`` tokens below ``node`` along the most frequent child, and the confidence
        at each; stops before the confidence falls below ``min_token_prob``."""
        counts = self._counts
        tokens: list[int] = []
        probs: list[float] = []
        confidence = 1.0
        children = self._children[node]
        while len(tokens) < limit and children:
            token = self._best[node]
            if token == UNKNOWN:
                token = self._best[node] = max(children, key=lambda t: counts[children[t]])
            child = children[token]
            confidence *= counts[child] / self._totals[node]
            if confidence < min_token_prob:
                break
            tokens.append(token)
            probs.append(confidence)
            node = child
            children = self._children[node]
        return tokens, probs


OutputKey = tuple[str, int]  # an output's cache salt and number in the cache


class SuffixCache:
    """The outputs of previous and running requests, one :class:`SuffixTree` per *partition* (a
    cache salt: a tenant's, docs/security.md#tenants-and-the-caches), shared by the
    :class:`SuffixIndex` of the requests of that salt, which draft from it alone (thread-safe).

    Bounded: at most ``max_requests`` outputs and ``max_tokens`` tokens over all partitions;
    beyond either bound the oldest output of the partition holding the most of it (outputs, or
    tokens) is evicted (a running request's too: it then adds no more), so one partition's growth
    evicts its own outputs before those of a smaller one. At most ``max_partitions`` partitions:
    a new one drops the least recently used (opened or proposed from) whole. A partition's tree
    is built again once its spare nodes pass :data:`MAX_SPARE_NODES`, so the memory follows the
    tokens held. ``max_requests`` = 0 disables it. Raises ValueError for a negative bound, fewer
    than 1 partition or max_depth < 2.
    """

    def __init__(self, max_depth: int = 24, max_requests: int = 256, max_tokens: int = 16384, max_partitions: int = 64):
        if max_requests < 0 or max_tokens < 0:
            raise ValueError(f"suffix cache bounds ({max_requests} requests, {max_tokens} tokens) must not be negative")
        if max_partitions < 1:
            raise ValueError(f"suffix cache partitions ({max_partitions}) must be at least 1")
        SuffixTree(max_depth)  # validates it
        self.max_depth, self.max_requests, self.max_tokens = max_depth, max_requests, max_tokens
        self.max_partitions = max_partitions
        self.partitions: OrderedDict[str, SuffixTree] = OrderedDict()  # by cache salt, least recently used first
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def open(self, cache_salt: str = "") -> OutputKey | None:
        """Starts a new request's output in partition ``cache_salt``; returns its key (None while
        the cache is disabled)."""
        if self.max_requests == 0:
            return None
        with self._lock:
            if cache_salt not in self.partitions and len(self.partitions) >= self.max_partitions:
                self.partitions.popitem(last=False)
            tree = self.partitions.setdefault(cache_salt, SuffixTree(self.max_depth))
            self.partitions.move_to_end(cache_salt)
            key = (cache_salt, next(self._keys))
            tree.extend(key, [])
            self._evict()
        return key

    def extend(self, key: OutputKey, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to the output ``key`` unless it was evicted."""
        with self._lock:
            tree = self.partitions.get(key[0])
            if tree is not None and key in tree.sequences:
                tree.extend(key, tokens)
                self._evict()

    def _evict(self) -> None:
        while True:
            trees = self.partitions.values()
            if sum(len(tree.sequences) for tree in trees) > self.max_requests:
                largest = max(self.partitions.items(), key=lambda item: len(item[1].sequences))
            elif sum(tree.num_tokens for tree in trees) > self.max_tokens:
                largest = max(self.partitions.items(), key=lambda item: item[1].num_tokens)
            else:
                return
            cache_salt, tree = largest
            tree.remove(next(iter(tree.sequences)))
            if tree.num_spare_nodes > MAX_SPARE_NODES:
                self.partitions[cache_salt] = tree.rebuilt()

    def propose(
        self,
        context: Sequence[int],
        k: int,
        limits: ProposalLimits,
        cache_salt: str = "",
        to_beat: SuffixMatch | None = None,
    ) -> SuffixMatch | None:
        """:meth:`SuffixTree.propose` over the cached outputs of partition ``cache_salt``."""
        with self._lock:
            tree = self.partitions.get(cache_salt)
            if tree is None:
                return to_beat
            self.partitions.move_to_end(cache_salt)
            return tree.propose(context, k, limits, to_beat)


class SuffixIndex:
    """One request's suffix tree over its prompt and output, proposing from it and from the
    partition ``cache_salt`` of ``cache``.

    The tokens after the first ``num_prompt_tokens`` are the request's output and enter that
    partition too (from the first of them on, it holds a place in the cache).
    """

    def __init__(
        self,
        cache: SuffixCache,
        num_prompt_tokens: int,
        limits: ProposalLimits = ProposalLimits(),
        cache_salt: str = "",
    ):
        self.cache, self.num_prompt_tokens, self.limits = cache, num_prompt_tokens, limits
        self.cache_salt = cache_salt
        self.tree = SuffixTree(cache.max_depth)
        self._output_key: OutputKey | None = None
        self._indexed = 0

    def _index(self, tokens: Sequence[int]) -> None:
        self.tree.extend(0, tokens[self._indexed :])
        output = tokens[max(self._indexed, self.num_prompt_tokens) :]
        if output:
            if self._output_key is None:
                self._output_key = self.cache.open(self.cache_salt)
            if self._output_key is not None:
                self.cache.extend(self._output_key, output)
        self._indexed = len(tokens)

    def lookup(self, tokens: Sequence[int], k: int) -> SuffixMatch | None:
        """The best proposal of up to ``k`` tokens continuing ``tokens``, from this request's
        tree or the cache (this request's tree on a tie); None without a match or when k < 1.
        ``tokens`` must extend the list of the previous call. O(new tokens * max_depth) to index,
        plus a proposal from each tree (:meth:`SuffixTree.propose`)."""
        self._index(tokens)
        if k < 1:
            return None
        own = self.tree.best_proposal(self.tree.suffixes(0), k, self.limits)  # the tree's sequence is ``tokens``
        return self.cache.propose(tokens, k, self.limits, self.cache_salt, to_beat=own)

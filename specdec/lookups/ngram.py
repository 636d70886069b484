"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the text's suffix.

Follows Saxena, "Prompt Lookup Decoding" (2023), as in transformers'
``PromptLookupCandidateGenerator``: try the longest suffix n-gram first (``max_n`` down to
``min_n``). An index from n-gram to its latest start is updated as tokens arrive, so a lookup
costs O(max_n) instead of a scan of the context. Shared by the draft service's ``ngram`` drafter
and the coordinator's hybrid drafting (which looks up without a network hop).
"""

from collections.abc import Sequence
from dataclasses import dataclass

DRAFTER_NAME = "ngram"  # how requests and metrics name n-gram lookup, wherever it runs


@dataclass(frozen=True)
class NgramMatch:
    """``n``: length in tokens of the matched suffix; ``tokens``: up to K ids that followed it."""

    n: int
    tokens: list[int]


class NgramIndex:
    """The n-grams of one growing token list. Raises ValueError unless 1 <= min_n <= max_n."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_min ({min_n}) <= ngram_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._latest_start: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def reset(self) -> None:
        """Forgets every n-gram (for a token list that was replaced, not appended to)."""
        self._latest_start.clear()
        self._indexed = 0

    def _index(self, tokens: Sequence[int]) -> None:
        # An n-gram enters the index once the token after it exists, so a lookup of the current
        # suffix finds an earlier occurrence that has a continuation.
        for follower in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, follower) + 1):
                self._latest_start[tuple(tokens[follower - n : follower])] = follower - n
        self._indexed = len(tokens)

    def lookup(self, tokens: Sequence[int], k: int) -> NgramMatch | None:
        """The longest suffix of ``tokens`` seen earlier and up to ``k`` of its followers; None
        without a match or when k < 1. ``tokens`` must extend the list of the previous call."""
        self._index(tokens)
        if k < 1:
            return None
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._latest_start.get(tuple(tokens[-n:]))
            if start is not None:
                return NgramMatch(n, list(tokens[start + n : start + n + k]))
        return None

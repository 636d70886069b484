"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the text's suffix.

Follows Saxena, "Prompt Lookup Decoding" (2023), as in transformers'
``PromptLookupCandidateGenerator``: try the longest suffix n-gram first (``max_n`` down to
``min_n``). No model: q is a point mass on each proposed token. An index from n-gram to its latest
start is updated as tokens arrive, so a lookup costs O(max_n) instead of a scan of the context.
"""

from collections.abc import Sequence

from draft_service.drafters.base import Drafter, DraftSession, Proposal
from specdec.sampling import SamplingParams


class NgramSession(DraftSession):
    def __init__(self, sampling: SamplingParams, min_n: int, max_n: int):
        super().__init__(sampling)
        self.min_n, self.max_n = min_n, max_n
        self._latest_start: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def prefill(self, committed: Sequence[int]) -> None:
        super().prefill(committed)
        self._latest_start.clear()
        self._indexed = 0

    def _index(self) -> None:
        # An n-gram enters the index once the token after it exists, so a lookup of the current
        # suffix finds an earlier occurrence that has a continuation.
        tokens = self.committed
        for follower in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, follower) + 1):
                self._latest_start[tuple(tokens[follower - n : follower])] = follower - n
        self._indexed = len(tokens)

    def propose(self, k: int) -> Proposal:
        self._index()
        tokens = self.committed
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._latest_start.get(tuple(tokens[-n:]))
            if start is not None:
                return Proposal(tokens[start + n : start + n + k])
        return Proposal([])


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_min ({min_n}) <= ngram_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def new_session(self, sampling: SamplingParams) -> NgramSession:
        return NgramSession(sampling, self.min_n, self.max_n)

"""The ``ngram`` drafter: prompt lookup (:mod:`specdec.lookups.ngram`) as a draft service drafter. No
model: q is a point mass on each proposed token."""

from collections.abc import Sequence

from draft_service.drafters.contract import Drafter, DraftSession, Proposal
from specdec.lookups.ngram import DRAFTER_NAME, NgramIndex
from specdec.sampling.sampling_params import SamplingParams


class NgramSession(DraftSession):
    def __init__(self, sampling: SamplingParams, min_n: int, max_n: int):
        super().__init__(sampling)
        self.index = NgramIndex(min_n, max_n)

    def prefill(self, committed: Sequence[int]) -> None:
        super().prefill(committed)
        self.index.reset()

    def propose(self, k: int) -> Proposal:
        match = self.index.lookup(self.committed, k)
        return Proposal(match.tokens if match else [])


class NgramDrafter(Drafter):
    name = DRAFTER_NAME

    def __init__(self, min_n: int = 1, max_n: int = 3):
        NgramIndex(min_n, max_n)  # validates the bounds at start-up
        self.min_n, self.max_n = min_n, max_n

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> NgramSession:
        return NgramSession(sampling, self.min_n, self.max_n)

"""The ``suffix`` drafter: SuffixDecoding (:mod:`specdec.lookups.suffix`) as a draft service drafter. No
model: q is a point mass on each proposed token. The drafter's sessions of one cache salt (a
tenant's) share one partition of a cache of their outputs, so a request can draft what an earlier
(or a concurrent) one of the same tenant generated, and never another tenant's."""

from collections.abc import Sequence

from draft_service.drafters.contract import Drafter, DraftSession, Proposal
from specdec.lookups.suffix import DRAFTER_NAME, ProposalLimits, SuffixCache, SuffixIndex
from specdec.sampling.sampling_params import SamplingParams


class SuffixSession(DraftSession):
    """The tokens of the prefill are the prompt; those appended later are the output."""

    def __init__(self, sampling: SamplingParams, cache: SuffixCache, limits: ProposalLimits, cache_salt: str = ""):
        super().__init__(sampling)
        self.cache, self.limits, self.cache_salt = cache, limits, cache_salt
        self.index: SuffixIndex  # made by prefill

    def prefill(self, committed: Sequence[int]) -> None:
        super().prefill(committed)
        self.index = SuffixIndex(self.cache, len(self.committed), self.limits, self.cache_salt)

    def propose(self, k: int) -> Proposal:
        match = self.index.lookup(self.committed, k)
        return Proposal(match.tokens if match else [])


class SuffixDrafter(Drafter):
    """``max_depth``: the suffix trees' depth in tokens (it bounds match length plus proposal
    length); ``max_cached_requests``, ``max_cached_tokens`` and ``max_cache_partitions``: the bounds of
    the output cache the sessions share (:class:`specdec.lookups.suffix.SuffixCache`); ``max_spec_factor`` and
    ``min_token_prob``: see :class:`specdec.lookups.suffix.ProposalLimits`. Raises ValueError for values
    out of range."""

    name = DRAFTER_NAME

    def __init__(
        self,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 256,
        max_cached_tokens: int = 16384,
        max_cache_partitions: int = 64,
    ):
        self.cache = SuffixCache(max_depth, max_cached_requests, max_cached_tokens, max_cache_partitions)
        self.limits = ProposalLimits(max_spec_factor, min_token_prob)

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> SuffixSession:
        return SuffixSession(sampling, self.cache, self.limits, cache_salt)

"""N-gram prompt lookup (:mod:`specdec.lookups.ngram`, :mod:`draft_service.drafters.ngram`) on hand-made
token sequences."""

from draft_service.drafters.ngram import NgramDrafter
from specdec.sampling.sampling_params import SamplingParams


def test_ngram_proposes_what_followed_the_latest_match():
    session = NgramDrafter(1, 3).new_session(SamplingParams())
    session.prefill([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    assert session.propose(3).tokens == [2, 3, 5]  # latest earlier "5 6 7" is followed by 2 3 5
    session.sync([2])
    assert session.propose(2).tokens == [3, 5]  # suffix "6 7 2" matched, continuation "3 5"
    session.sync([42])
    assert session.propose(4).tokens == []  # 42 never occurred before


def test_ngram_prefers_the_longest_suffix():
    session = NgramDrafter(1, 2).new_session(SamplingParams())
    session.prefill([1, 2, 9, 3, 2, 8, 1, 2])  # "1 2" -> 9 beats the later unigram "2" -> 8
    assert session.propose(1).tokens == [9]

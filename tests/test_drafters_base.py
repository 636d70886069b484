"""The model drafters' session (:mod:`draft_service.drafters.base`), on the tiny transformers
draft: its context window."""

from specdec.sampling.sampling_params import SamplingParams


def test_model_draft_proposes_nothing_beyond_its_window(tiny_drafters):
    session = tiny_drafters["transformers"].new_session(SamplingParams())  # window: 512 tokens
    session.prefill(list(range(100, 608)))
    assert len(session.propose(4).tokens) == 4  # 508 + 4 fits
    session.sync([7])
    assert session.propose(4).tokens == []  # 509 + 4 would not: the round becomes a plain decode

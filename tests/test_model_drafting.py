"""The model drafters' session (:mod:`draft_service.drafters.model_drafting`), on the tiny
transformers draft: its context window, the owner its KV store preempts by and a draft position's
alternative (its drafts ahead, branches and proactive drafts are test_draft_ahead.py's)."""

import pytest
import torch

from draft_service.drafters.model_drafting import Alternative
from specdec.sampling.sampling_params import SamplingParams


def test_model_draft_proposes_nothing_beyond_its_window(tiny_drafters):
    session = tiny_drafters["transformers"].new_session(SamplingParams())  # window: 512 tokens
    session.prefill(list(range(100, 608)))
    assert len(session.propose(4).tokens) == 4  # 508 + 4 fits
    session.sync([7])
    assert session.propose(4).tokens == []  # 509 + 4 would not: the round becomes a plain decode


def test_a_model_drafts_sessions_carry_their_owner_into_its_kv_store(tiny_drafters, monkeypatch):
    """A session's owner reaches the drafter's KV store, whose preemption takes from the owner
    holding the most (tests/test_ragged_lm.py shows the choice)."""
    drafter = tiny_drafters["transformers"]
    allocate, owners = drafter.lm.allocate, []
    monkeypatch.setattr(drafter.lm, "allocate", lambda owner="": owners.append(owner) or allocate(owner))
    drafter.new_session(SamplingParams(), cache_salt="salt", owner="a").close()
    drafter.new_session(SamplingParams()).close()
    assert owners == ["a", ""]


def test_a_greedy_alternative_is_the_softmaxs_runner_up_and_probabilities():
    scores = torch.randn(49_152, generator=torch.Generator().manual_seed(3)) * 4
    probs = torch.softmax(scores, -1)
    (chosen, runner_up), (chosen_prob, prob) = probs.topk(2).indices.tolist(), probs.topk(2).values.tolist()
    for alternative in (Alternative.of_greedy(scores, chosen), Alternative.of(probs, chosen)):
        assert alternative.token == runner_up
        assert alternative.chosen_prob == pytest.approx(chosen_prob, rel=1e-5)
        assert alternative.prob == pytest.approx(prob, rel=1e-5)

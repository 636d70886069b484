"""Small pieces with known answers: n-gram lookup, stop strings, metrics arithmetic, sampling filters."""

import pytest
import torch

from coordinator.metrics import MetricsRecorder, RoundRecord
from coordinator.text import IncrementalDetokenizer
from draft_service.drafters.ngram import NgramDrafter
from specdec.sampling import logits_to_probs
from specdec.sampling_params import SamplingParams
from specdec.sessions import SessionRegistry


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


def test_stop_string_cuts_text_and_holds_back_a_possible_prefix(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("Hello world. END of story", add_special_tokens=False).input_ids
    text = IncrementalDetokenizer(tok, [], ["END"])
    deltas, stopped_at = [], None
    for i, token in enumerate(ids):
        if text.add(token):
            stopped_at = i
            break
        deltas.append(text.take_delta())
    assert stopped_at is not None and tok.decode(ids[: stopped_at + 1]).endswith("END")
    assert "".join(deltas) + text.take_delta(final=True) == "Hello world. "


def test_detokenizer_reassembles_multibyte_text(smollm2_tokenizer):
    source = "naïve café – 東京 🚀"
    text = IncrementalDetokenizer(smollm2_tokenizer, [], [])
    pieces = []
    for token in smollm2_tokenizer(source, add_special_tokens=False).input_ids:
        text.add(token)
        pieces.append(text.take_delta())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + text.take_delta(final=True) == source


def test_metrics_arithmetic():
    recorder = MetricsRecorder(num_prompt_tokens=10)
    rounds = [("llama-cpp", 4, 4, 4), ("ngram", 4, 4, 1), ("llama-cpp", 4, 4, 0), ("ngram", 4, 0, 0), ("ngram", 2, 2, 2), ("", 0, 0, 0)]
    for drafter, k, drafted, accepted in rounds:
        recorder.rounds.append(RoundRecord(drafter, k, drafted, accepted, draft_ms=5.0, verify_ms=10.0, wall_ms=20.0, wire_bytes=30))
    m = recorder.to_proto(num_generated=12, seed=3, drafter="ngram", num_speculative_tokens=4)
    assert (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_draft_tokens) == (4, 14, 7)
    assert m.draft_acceptance_rate == pytest.approx(0.5)
    assert m.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    assert list(m.acceptance_histogram) == [1, 1, 1, 0, 1]
    assert m.num_target_forwards == 6
    assert m.coordination_time_ms == pytest.approx(6 * 20.0 - 6 * 5.0 - 6 * 10.0)
    assert m.round_wire_bytes == 6 * 30
    assert list(m.rounds_per_k) == [1, 0, 1, 0, 4]
    assert sorted(m.drafter_usage) == ["llama-cpp", "ngram"]
    ngram = m.drafter_usage["ngram"]
    assert (ngram.num_rounds, ngram.num_draft_tokens, ngram.num_accepted_draft_tokens) == (3, 6, 3)
    assert list(ngram.rounds_per_k) == [0, 0, 1, 0, 2]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [True, True, False, False, False]
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [True, True, True, False, False]  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.8))
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_model_draft_proposes_nothing_beyond_its_window(tiny_drafters):
    session = tiny_drafters["transformers"].new_session(SamplingParams())  # window: 512 tokens
    session.prefill(list(range(100, 608)))
    assert len(session.propose(4).tokens) == 4  # 508 + 4 fits
    session.sync([7])
    assert session.propose(4).tokens == []  # 509 + 4 would not: the round becomes a plain decode


class _Closable:
    closed = False

    def close(self) -> None:
        self.closed = True

    def kv_cache_bytes(self) -> int:
        return 0 if self.closed else 100


def test_a_session_whose_prefill_was_abandoned_is_released_at_once():
    """A Prefill the caller cancelled while it ran (its Release may have come first) leaves no session."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    kept, abandoned = _Closable(), _Closable()
    sessions.open("kept", lambda: kept)
    sessions.open("abandoned", lambda: abandoned, abandoned=lambda: True)
    assert len(sessions) == 1 and abandoned.closed and not kept.closed
    assert sessions.kv_cache_bytes() == 100

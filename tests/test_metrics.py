"""A request's metrics (:mod:`coordinator.observability.metrics`) from hand-made round records."""

import pytest

from coordinator.observability.metrics import PLAIN, MetricsRecorder, RoundRecord


def test_metrics_arithmetic():
    recorder = MetricsRecorder(num_prompt_tokens=10)
    rounds = [
        ("llama-cpp", 4, 4, 4),
        ("ngram", 4, 4, 1),
        ("llama-cpp", 4, 4, 0),
        ("ngram", 4, 0, 0),
        ("ngram", 2, 2, 2),
        (PLAIN, 0, 0, 0),
    ]
    for drafter, k, drafted, accepted in rounds:
        recorder.rounds.append(
            RoundRecord(
                drafter=drafter,
                k=k,
                num_drafted=drafted,
                num_accepted=accepted,
                draft_ms=5.0,
                verify_ms=10.0,
                wall_ms=20.0,
                wire_bytes=30,
            )
        )
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


def test_a_round_decoded_ahead_adds_no_negative_coordination():
    """A plain round whose Decode went out with the round before began its step before the round
    did: its wall time (30 ms) is below the service's compute (40 ms), and it adds 0 to the
    coordination time, not -10; a round that waited beyond its calls adds what it waited. The
    rounds decoded ahead are counted."""
    recorder = MetricsRecorder()
    plain = dict(drafter=PLAIN, k=0, num_drafted=0, num_accepted=0, draft_ms=0.0, verify_ms=40.0, wire_bytes=0)
    ahead = RoundRecord(**plain, wall_ms=30.0, decoded_ahead=True)
    turned_around = RoundRecord(**plain, wall_ms=45.0)
    recorder.rounds.extend([ahead, turned_around])
    metrics = recorder.to_proto(num_generated=2)
    assert metrics.coordination_time_ms == pytest.approx(5.0) and metrics.num_rounds_decoded_ahead == 1

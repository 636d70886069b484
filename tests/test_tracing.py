"""coordinator/observability/tracing.py: a request span's attributes, one per RequestMetrics field,
maps flattened by key whether their values are messages (``drafter_usage``) or numbers
(``draft_ahead_hits_per_branch``)."""

from coordinator.observability.tracing import request_attributes
from specdec.v1 import coordinator_pb2


def test_every_field_and_every_map_entry_is_an_attribute():
    metrics = coordinator_pb2.RequestMetrics(num_generated_tokens=12, acceptance_histogram=[1, 0, 3])
    metrics.drafter_usage["llama-cpp"].num_rounds = 4
    metrics.drafter_usage["llama-cpp"].rounds_per_k.extend([0, 1, 3])
    metrics.draft_ahead_hits_per_branch["main"] = 3
    metrics.draft_ahead_hits_per_branch["recovered"] = 1
    attributes = request_attributes(metrics)
    assert attributes["specdec.request.num_generated_tokens"] == 12
    assert attributes["specdec.request.acceptance_histogram"] == [1, 0, 3]
    assert attributes["specdec.request.drafter_usage.llama-cpp.num_rounds"] == 4
    assert attributes["specdec.request.drafter_usage.llama-cpp.rounds_per_k"] == [0, 1, 3]
    assert attributes["specdec.request.draft_ahead_hits_per_branch.main"] == 3
    assert attributes["specdec.request.draft_ahead_hits_per_branch.recovered"] == 1

"""The Propose deadline the coordinator derives from the draft's measured round trips."""

import asyncio

import pytest

from coordinator.speculation.upstream import ProposeDeadline, ServiceClients
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.errors import Unavailable
from specdec.v1 import draft_pb2


def test_the_deadline_starts_at_ten_floors_and_is_capped():
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=30).seconds(9) == pytest.approx(2.5)
    assert ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=1).seconds(9) == 1


def test_the_deadline_follows_the_slowest_recent_call_scaled_to_the_forwards():
    deadline = ProposeDeadline(floor_s=0.05, factor=3, ceiling_s=30, window=3)
    deadline.observe(0.100, 9)  # a K = 8 round: 2 tokens appended (one forward), 8 drafted
    deadline.observe(0.150, 14)  # a catch-up: 92 tokens appended after rounds without the draft, 8 drafted
    assert deadline.seconds(9) == pytest.approx(0.3)  # the catch-up does not stretch a short call
    assert deadline.seconds(18) == pytest.approx(0.6)  # nor does a longer catch-up miss its deadline
    deadline.observe(0.010, 9)
    assert deadline.seconds(9) == pytest.approx(0.3)  # the slowest recent call counts
    deadline.observe(0.010, 9)
    deadline.observe(0.010, 9)  # the slow calls have left the window of 3
    assert deadline.seconds(9) == pytest.approx(0.05)  # the floor


@pytest.mark.parametrize(
    ("appended", "predicted", "k", "forwards"),
    [(0, 0, 8, 8), (2, 0, 8, 9), (9, 8, 8, 10), (92, 0, 8, 14), (1, 0, 0, 1)],
)
def test_a_propose_costs_its_drafted_tokens_and_its_catch_up_chunks(appended, predicted, k, forwards):
    request = draft_pb2.ProposeRequest(
        appended_token_ids=range(appended), predicted_token_ids=range(predicted), num_speculative_tokens=k
    )
    assert ProposeDeadline.forwards(request) == forwards


def test_a_propose_answered_late_teaches_the_deadline(tiny_pipeline):
    """A draft slowed by load (its Propose held 600 ms, past a 250 ms deadline) answers late: the
    deadline grows to cover it, and the next Propose of that size passes."""
    settings = DraftSettings(port=0, max_sessions=4, default_drafter="ngram", debug_rpc_delay_ms=["Propose=600"])
    draft = build_draft(settings, drafters={"ngram": NgramDrafter(1, 3)})

    async def run():
        deadline = ProposeDeadline(floor_s=0.25, factor=1.5, ceiling_s=30)
        deadline.observe(0.05, 3)  # learnt while the draft was fast
        address = f"127.0.0.1:{draft.port}"
        clients = ServiceClients([address], [tiny_pipeline.verify_address], 30, 30, propose_deadline=deadline)
        try:
            prefill = draft_pb2.DraftServicePrefillRequest(session_id="s", token_ids=[1, 2, 1, 2])
            await clients.prefill_draft(address, prefill)
            request = draft_pb2.ProposeRequest(session_id="s", num_speculative_tokens=3)
            with pytest.raises(Unavailable):
                await clients.propose(address, request)
            await asyncio.sleep(0.8)  # its answer arrives meanwhile
            assert deadline.seconds(3) >= 1.5 * 0.6
            assert (await clients.propose(address, request)).token_ids
        finally:
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)

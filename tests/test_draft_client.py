"""The coordinator's client of the draft service (coordinator/speculation/draft_client.py) against
the real draft service of the tiny pipeline, and an address nothing listens on: when a request may
ask the draft, what a failure costs, and what a lost session does."""

import asyncio
import dataclasses
import time

import pytest

from coordinator.speculation.draft_client import DraftClient, DraftSession
from coordinator.speculation.plan import DraftPlan, ResolvedRequest
from coordinator.speculation.policy.fixed import FixedK
from coordinator.speculation.upstream import ProposeDeadline, ServiceClients
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.errors import Unavailable
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import draft_pb2
from specdec_app.launcher import free_port

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def request(k: int = 3, drafter: str = "transformers", adaptive: bool = False, temperature: float = 0.0):
    return ResolvedRequest(list(PROMPT), 8, SamplingParams(temperature=temperature, seed=1), [], k, drafter, adaptive)


def clients_of(pipeline, draft_address: str | None = None) -> ServiceClients:
    deadline = ProposeDeadline(floor_s=0.25, factor=3, ceiling_s=30)
    address = draft_address or pipeline.draft_address
    return ServiceClients([address], [pipeline.verify_address], 30, 30, propose_deadline=deadline)


def session_of(
    service: DraftClient, resolved: ResolvedRequest, released: list, name: str = "ds", draft_ahead: bool = False
) -> DraftSession:
    ids = iter(f"{name}.d{i}" for i in range(1, 100))

    def in_background(release):
        released.append(asyncio.ensure_future(release()))

    resolved = dataclasses.replace(resolved, draft=DraftPlan(drafts_ahead=draft_ahead))
    return DraftSession(service, resolved, list(resolved.prompt_ids), lambda: next(ids), in_background, retry_s=0.5)


def test_a_session_proposes_once_open_and_its_release_frees_it(tiny_pipeline):
    async def run():
        clients = clients_of(tiny_pipeline)
        released: list = []
        session = session_of(DraftClient(clients), request(), released, "open")
        try:
            assert not session.available()  # nothing opened yet: a round is a plain one
            session.open()
            await session.wait_for_prefill()
            await asyncio.sleep(0.5)  # greedy rounds do not wait: the prefill finishes meanwhile
            session.check_prefill()
            assert session.available() and session.session_id == "open.d1"
            proposal = await session.proposal(3, round_number=1, start=0.0)
            assert len(proposal.response.token_ids) == 3 and proposal.wire_bytes > 0
            await session.release()
            await asyncio.gather(*released)
            assert session.session_id is None
        finally:
            await clients.close()

    asyncio.run(run())


@pytest.mark.parametrize(("max_k", "drafts_ahead"), [(None, True), (4, True), (3, False)])
def test_no_draft_ahead_after_a_proposal_that_would_end_the_request(tiny_pipeline, max_k, drafts_ahead):
    """A proposal of 3 tokens when the request's budget leaves room for 3 draft tokens: accepted
    whole it ends the request, so the next round's Propose is not sent ahead."""

    async def run():
        clients = clients_of(tiny_pipeline)
        released: list = []
        service = DraftClient(clients)
        session = session_of(service, request(), released, f"ahead{max_k}", draft_ahead=True)
        try:
            await opened(session)
            proposal = await session.proposal(3, round_number=1, start=0.0, max_k=max_k)
            assert len(proposal.response.token_ids) == 3
            assert (session._ahead is not None) == drafts_ahead
            await session.release()
            await asyncio.gather(*released)
        finally:
            await clients.close()

    asyncio.run(run())


def test_a_lost_session_is_prefilled_again_under_a_new_id(tiny_pipeline):
    async def run():
        clients = clients_of(tiny_pipeline)
        released: list = []
        service = DraftClient(clients)
        session = session_of(service, request(), released, "lost")
        try:
            session.open()
            await asyncio.sleep(0.5)
            session.check_prefill()
            await service.release(session.replica, session.session_id)  # the service lost it (restart, idle eviction)
            proposal = await session.proposal(3, round_number=1, start=0.0)
            assert len(proposal.response.token_ids) == 3 and session.session_id == "lost.d2"
            assert session.failures == 0
            await session.release()
            await asyncio.gather(*released)
        finally:
            await clients.close()

    asyncio.run(run())


def test_an_unreachable_draft_marks_the_service_down_for_every_request(tiny_pipeline):
    async def run():
        clients = clients_of(tiny_pipeline, f"127.0.0.1:{free_port()}")
        released: list = []
        service = DraftClient(clients, down_s=5.0)
        first, second = (session_of(service, request(), released, name) for name in ("a", "b"))
        try:
            assert await service.info() is None  # never reached: requests run without a draft
            assert service.down()
            first.open()
            second.open()  # skipped: the service is down
            await asyncio.sleep(0.1)
            assert not first.available() and not second.available()
            proposal = await first.proposal(3, round_number=1, start=0.0)
            assert proposal.response is None  # a plain decode round
        finally:
            await first.release()
            await second.release()
            for task in released:
                task.cancel()
            await clients.close()

    asyncio.run(run())


def test_the_last_draft_info_stands_in_while_the_service_is_down(tiny_pipeline):
    async def run():
        clients = clients_of(tiny_pipeline)
        service = DraftClient(clients, down_s=5.0)
        try:
            info = await service.info()
            assert {d.name: d.model for d in info.drafters}["transformers"]
            service.mark_down(tiny_pipeline.draft_address)  # a call just found it unreachable
            assert await service.info() is info
        finally:
            await clients.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("resolved", "opens"),
    [
        (request(), True),  # a fixed K: the first round uses the draft
        (request(k=0), False),  # plain decode: no draft at all
        (request(adaptive=True, drafter="ngram"), False),  # the coordinator's own lookup
    ],
)
def test_which_requests_open_a_draft_session(tiny_pipeline, resolved, opens):
    async def run():
        clients = clients_of(tiny_pipeline)
        released: list = []
        session = session_of(DraftClient(clients), resolved, released, f"which-{resolved.drafter}-{opens}")
        try:
            if session.opens_at_once(FixedK(resolved.drafter, resolved.num_speculative_tokens)):
                session.open()
            await asyncio.sleep(0.3)
            session.check_prefill()
            assert (session.session_id is not None) == opens
        finally:
            await session.release()
            await asyncio.gather(*released)
            await clients.close()

    asyncio.run(run())


def test_a_late_answer_clears_the_down_mark(tiny_pipeline):
    """A draft slowed by load (its Propose held 600 ms, past a 250 ms deadline) is marked down at
    the miss, and up again when its late answer arrives: it is alive, and the deadline has learnt."""
    settings = DraftSettings(port=0, max_sessions=4, default_drafter="ngram", debug_rpc_delay_ms=["Propose=600"])
    draft = build_draft(settings, drafters={"ngram": NgramDrafter(1, 3)})

    async def run():
        clients = clients_of(tiny_pipeline, f"127.0.0.1:{draft.port}")
        clients.propose_deadline.observe(0.05, 3)  # learnt while the draft was fast
        service, replica = DraftClient(clients, down_s=30.0), f"127.0.0.1:{draft.port}"
        try:
            await service.prefill(replica, draft_pb2.DraftServicePrefillRequest(session_id="late", token_ids=PROMPT))
            with pytest.raises(Unavailable, match="deadline"):
                await service.propose(replica, draft_pb2.ProposeRequest(session_id="late", num_speculative_tokens=3))
            assert service.down()
            await asyncio.sleep(0.8)  # the late answer arrives
            assert not service.down()
            await service.release(replica, "late")
        finally:
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)


def late_draft(delay_ms: int, rpc: str = "Propose"):
    """A draft service whose ``rpc`` calls are held ``delay_ms`` (the test hook): a draft slowed by load."""
    settings = DraftSettings(port=0, max_sessions=4, default_drafter="ngram", debug_rpc_delay_ms=[f"{rpc}={delay_ms}"])
    return build_draft(settings, drafters={"ngram": NgramDrafter(1, 3)})


async def opened(session: DraftSession) -> None:
    session.open()
    while session.session_id is None:  # greedy rounds do not wait for the prefill: the test does
        await asyncio.sleep(0.02)
    session.check_prefill()


def test_a_propose_answered_late_keeps_its_session(tiny_pipeline):
    """A Propose held past its deadline (600 ms against 250) does not lose the session: when its
    late answer arrives the session drafts again at once, the tokens that call carried counted as
    seen, without being released or prefilled again."""
    draft = late_draft(600)

    async def run():
        clients = clients_of(tiny_pipeline, f"127.0.0.1:{draft.port}")
        clients.propose_deadline.observe(0.05, 3)  # learnt while the draft was fast
        released: list = []
        session = session_of(DraftClient(clients, down_s=0.1), request(drafter="ngram"), released, "late")
        try:
            await opened(session)
            session.committed.extend([7, 5])  # tokens the draft has not seen: the Propose carries them
            assert (await session.proposal(3, round_number=1, start=0.0)).response is None  # the deadline passed
            assert not session.available()
            await asyncio.sleep(0.6)  # its late answer arrives
            assert session.available() and session.session_id == "late.d1" and session.seen == len(PROMPT) + 2
            draft.servicer.rpc_delays_s.clear()
            proposal = await session.proposal(3, round_number=2, start=0.0)
            in_process = NgramDrafter(1, 3).new_session(SamplingParams())
            in_process.prefill(session.committed)
            assert list(proposal.response.token_ids) == in_process.propose(3).tokens
            assert not released and session.failures == 1
        finally:
            await session.release()
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)


def test_a_propose_never_answered_in_time_is_prefilled_again(tiny_pipeline):
    """No late answer within retry_s (the Propose held 3 s, retry_s 0.5): the session is released
    and the draft prefilled again under a new id, as after any other failure."""
    draft = late_draft(3000)

    async def run():
        clients = clients_of(tiny_pipeline, f"127.0.0.1:{draft.port}")
        clients.propose_deadline.observe(0.05, 3)
        released: list = []
        session = session_of(DraftClient(clients, down_s=0.1), request(drafter="ngram"), released, "gone")
        try:
            await opened(session)
            assert (await session.proposal(3, round_number=1, start=0.0)).response is None
            await asyncio.sleep(0.6)  # retry_s passed, no answer
            assert not session.available()
            await opened(session)
            assert session.session_id == "gone.d2" and len(released) == 1
        finally:
            await session.release()
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)


def test_a_sampling_request_that_starts_while_the_draft_is_down_counts_a_failure(tiny_pipeline):
    """A sampling request that opened while another request had the draft marked down: its first
    round opens the session then and waits for it; while the draft is still down, its plain rounds
    count one draft failure (their tokens are another exact sample than the seed gives with the
    draft), once for the stretch, and a proposal answered ends the stretch."""

    async def run():
        clients = clients_of(tiny_pipeline)
        service, released = DraftClient(clients, down_s=0.3), []
        session = session_of(service, request(drafter="ngram", temperature=0.8), released, "down-at-start")
        try:
            service.mark_down(tiny_pipeline.draft_address)
            session.open()  # skipped: the draft is down
            await session.wait_for_prefill()  # still down: nothing to wait for
            for round_number in (1, 2):
                assert (await session.proposal(3, round_number, 0.0)).response is None
            assert session.failures == 1
            await asyncio.sleep(0.35)  # the down mark expires
            await session.wait_for_prefill()  # as a first round: opens the session and waits for it
            session.check_prefill()
            assert session.available() and (await session.proposal(3, 3, 0.0)).response is not None
            assert session.failures == 1
        finally:
            await session.release()
            await asyncio.gather(*released)
            await clients.close()

    asyncio.run(run())


def test_a_sampling_request_waits_one_deadline_for_its_draft_prefill(tiny_pipeline):
    """A sampling request's first round waits for its draft session's prefill (held 600 ms) at
    most a Propose deadline (250 ms): then its rounds go on without the draft, which counts as a
    draft failure (their tokens are another exact sample than the seed gives with the draft), and
    the draft is used once its prefill is done."""
    draft = late_draft(600, "Prefill")

    async def run():
        clients = clients_of(tiny_pipeline, f"127.0.0.1:{draft.port}")
        clients.propose_deadline.observe(0.05, 3)
        released: list = []
        sampled = request(drafter="ngram", temperature=0.8)
        session = session_of(DraftClient(clients), sampled, released, "slow-prefill")
        try:
            session.open()
            start = time.monotonic()
            await session.wait_for_prefill()
            assert 0.2 < time.monotonic() - start < 0.55
            assert session.failures == 1 and not session.available()
            await asyncio.sleep(0.5)  # the prefill is done
            session.check_prefill()
            assert session.available() and session.failures == 1
        finally:
            await session.release()
            await asyncio.gather(*released)
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)

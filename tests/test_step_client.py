"""The coordinator's end of a Step stream (specdec/rpc/step_client.py) against a real verify
service (the tiny target, on a free port): concurrent calls share messages, results and errors
reach their callers, deadlines hold, and a stream the service dropped is opened again; and against
a real draft service, a late answer's round trip."""

import asyncio
import socket

import grpc
import pytest

from coordinator.speculation.upstream import DRAFT_SERVICE, VERIFY_SERVICE
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.errors import NotFound, Unavailable
from specdec.rpc.server import GRPC_OPTIONS
from specdec.rpc.step_client import StepStream
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from verify_service.service import build
from verify_service.settings import VerifySettings


def prefill(port: int, session_ids: list[str]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        for session_id in session_ids:
            stub.Prefill(
                verify_pb2.VerifyServicePrefillRequest(
                    session_id=session_id, token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams()
                )
            )


def verify_stream(port: int) -> tuple[grpc.aio.Channel, StepStream]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    stub = verify_pb2_grpc.VerifyServiceStub(channel)
    stream = StepStream(stub.Step, verify_pb2.VerifyStepRequest, verify_pb2.VerifyCall, VERIFY_SERVICE, "verify")
    return channel, stream


@pytest.fixture
def verify_service(tiny_target):
    service = build(VerifySettings(port=0, max_sessions=16), target=tiny_target)
    yield service
    service.stop(0)


def test_concurrent_calls_travel_together_and_each_gets_its_own_result(verify_service):
    sessions = [f"s{i}" for i in range(8)]
    prefill(verify_service.port, [*sessions, "twin"])
    messages = []
    serve = verify_service.servicer.step_calls.serve

    def counting(requests, context):
        yield from serve((messages.append(len(m.calls)) or m for m in requests), context)

    verify_service.servicer.step_calls.serve = counting

    async def run():
        channel, stream = verify_stream(verify_service.port)
        calls = [stream.call("decode", verify_pb2.DecodeRequest(session_id=s), 30) for s in sessions]
        decoded = await asyncio.gather(*calls)
        await stream.close()
        await channel.close()
        return decoded

    decoded = asyncio.run(run())
    with grpc.insecure_channel(f"127.0.0.1:{verify_service.port}") as channel:
        twin = verify_pb2_grpc.VerifyServiceStub(channel).Decode(verify_pb2.DecodeRequest(session_id="twin"))
    assert [d.token_id for d in decoded] == [twin.token_id] * 8  # the same context: the same token
    assert messages == [8]  # the eight calls made in one turn of the event loop: one message


def test_a_call_raises_the_error_the_service_answered(verify_service):
    async def run():
        channel, stream = verify_stream(verify_service.port)
        try:
            with pytest.raises(NotFound, match="not found"):
                await stream.call("verify", verify_pb2.VerifyRequest(session_id="nobody", draft_token_ids=[1]), 30)
        finally:
            await stream.close()
            await channel.close()

    asyncio.run(run())


def test_a_service_that_never_answers_costs_the_call_its_deadline():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never speaks HTTP/2

    async def run():
        channel, stream = verify_stream(silent.getsockname()[1])
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(Unavailable, match="did not answer within its deadline"):
            await stream.call("decode", verify_pb2.DecodeRequest(session_id="s"), 0.3)
        assert loop.time() - start < 2
        await stream.close()
        await channel.close()

    try:
        asyncio.run(run())
    finally:
        silent.close()


def test_calls_in_flight_fail_when_the_service_goes_away_and_the_next_call_opens_a_new_stream(tiny_target):
    service = build(VerifySettings(port=0, max_sessions=4), target=tiny_target)
    port = service.port
    prefill(port, ["a"])

    async def run():
        channel, stream = verify_stream(port)
        assert (await stream.call("decode", verify_pb2.DecodeRequest(session_id="a"), 30)).token_id >= 0
        service.stop(0)
        with pytest.raises(Unavailable):
            await stream.call("decode", verify_pb2.DecodeRequest(session_id="a"), 5)
        restarted = build(VerifySettings(port=port, max_sessions=4), target=tiny_target)
        try:
            await asyncio.to_thread(prefill, port, ["b"])
            for _ in range(50):  # the channel reconnects within its backoff
                try:
                    response = await stream.call("decode", verify_pb2.DecodeRequest(session_id="b"), 5)
                    break
                except Unavailable:
                    await asyncio.sleep(0.1)
            assert response.token_id >= 0
        finally:
            await stream.close()
            await channel.close()
            restarted.stop(0)

    asyncio.run(run())


def test_a_call_answered_after_its_deadline_reports_its_round_trip():
    """A draft's Propose held past its deadline (the test hook; a Propose runs to its end) is
    answered late: the caller, which gave up, learns the real round trip (as the Propose deadline
    does)."""
    draft = build_draft(
        DraftSettings(port=0, default_drafter="ngram", debug_rpc_delay_ms=["Propose=400"]),
        drafters={"ngram": NgramDrafter()},
    )
    with grpc.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
        draft_pb2_grpc.DraftServiceStub(channel).Prefill(
            draft_pb2.DraftServicePrefillRequest(session_id="slow", drafter="ngram", token_ids=[5, 6, 7, 5, 6])
        )
    late: list[float] = []

    async def run():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}", options=GRPC_OPTIONS)
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        stream = StepStream(stub.Step, draft_pb2.DraftStepRequest, draft_pb2.DraftCall, DRAFT_SERVICE, "draft")
        request = draft_pb2.ProposeRequest(session_id="slow", num_speculative_tokens=2)
        try:
            with pytest.raises(Unavailable, match="did not answer within its deadline"):
                await stream.call("propose", request, 0.1, on_late=late.append)
            for _ in range(50):
                if late:
                    break
                await asyncio.sleep(0.05)
        finally:
            await stream.close()
            await channel.close()

    try:
        asyncio.run(run())
    finally:
        draft.stop(0)
    assert len(late) == 1 and late[0] >= 0.4


def test_a_call_of_a_kind_or_type_the_proto_lacks_is_refused_before_it_is_sent():
    """The kinds come from VerifyCall's ``oneof call``: a Propose to the verify service, or a
    Verify that carries a DecodeRequest, is a TypeError here, and no stream is opened for it."""
    opened = []
    stream = StepStream(
        lambda: opened.append(1), verify_pb2.VerifyStepRequest, verify_pb2.VerifyCall, VERIFY_SERVICE, "verify"
    )
    assert set(stream.kinds) == {"verify", "decode"}

    async def run():
        with pytest.raises(TypeError, match="takes one of"):
            await stream.call("propose", draft_pb2.ProposeRequest(), 1.0)
        with pytest.raises(TypeError, match="takes one of"):
            await stream.call("verify", verify_pb2.DecodeRequest(), 1.0)

    asyncio.run(run())
    assert opened == []

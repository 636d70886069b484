"""Request ids and resuming (GenerateRequest.request_id, resume_from) on the in-process pipeline
(its coordinator keeps requests in its in-process store): a finished request replays from any
position; bad resumes get their status and a message that says what to change."""

import grpc
import pytest

from coordinator.api.client import Completion, generate, stream
from specdec.v1 import coordinator_pb2


def request(**fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text="Tell me about tides.", max_new_tokens=24, **fields)


def test_first_message_carries_the_request_id(tiny_pipeline):
    responses = list(stream(tiny_pipeline.address, request(), timeout_s=60))
    assert len(responses[0].request_id) == 32 and not any(r.request_id for r in responses[1:])
    named = list(stream(tiny_pipeline.address, request(request_id="named.1:a-b_c"), timeout_s=60))
    assert named[0].request_id == "named.1:a-b_c"


def test_a_finished_request_resumes_from_any_position(tiny_pipeline):
    whole = generate(tiny_pipeline.address, request(request_id="finished", stop=["."]), timeout_s=60)
    for position in (0, 1, len(whole.token_ids) // 2, len(whole.token_ids)):
        rest = Completion()
        for response in stream(
            tiny_pipeline.address,
            coordinator_pb2.GenerateRequest(request_id="finished", resume_from=position),
            timeout_s=60,
        ):
            rest.add(response)
        assert rest.token_ids == whole.token_ids[position:]
        assert rest.finish_reason == whole.finish_reason and rest.metrics == whole.metrics
        # resending the original fields is allowed, and gives the same
        again = generate(
            tiny_pipeline.address, request(request_id="finished", stop=["."], resume_from=position), timeout_s=60
        )
        assert again.token_ids == rest.token_ids and again.text == rest.text
    replayed = generate(
        tiny_pipeline.address, coordinator_pb2.GenerateRequest(request_id="finished", resume_from=0), timeout_s=60
    )
    assert replayed.text == whole.text


@pytest.fixture(scope="module")
def taken(tiny_pipeline) -> str:
    """The id of a finished request (24 tokens)."""
    generate(tiny_pipeline.address, request(request_id="taken"), timeout_s=60)
    return "taken"


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        (
            dict(text="hi", request_id="bad id!"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id must be 1 to 128 characters",
        ),
        (dict(resume_from=3), grpc.StatusCode.INVALID_ARGUMENT, "resume_from needs the request_id"),
        (dict(request_id="taken", resume_from=-1), grpc.StatusCode.INVALID_ARGUMENT, "resume_from is -1"),
        (
            dict(request_id="never-started", resume_from=0),
            grpc.StatusCode.NOT_FOUND,
            "send it again without resume_from",
        ),
        (dict(text="hi", request_id="taken"), grpc.StatusCode.ALREADY_EXISTS, "choose another, or set resume_from"),
        (
            dict(text="Tell me about tides.", max_new_tokens=5, request_id="taken", resume_from=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "resend them unchanged",
        ),
        (
            dict(request_id="taken", resume_from=999),
            grpc.StatusCode.INVALID_ARGUMENT,
            "resume_from is 999, but request 'taken' generated 24",
        ),
    ],
)
def test_bad_resumes(tiny_pipeline, taken, fields, code, message):
    with pytest.raises(grpc.RpcError) as caught:
        generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(**fields), timeout_s=60)
    assert caught.value.code() == code
    assert message in caught.value.details()

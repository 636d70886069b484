"""Bad input gets its specific gRPC status with a message that says what to change, and the
services keep serving afterwards."""

import time

import grpc
import pytest

from coordinator.api.client import generate, generate_choices, stream
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
BAD_REQUESTS = [
    ("empty prompt", dict(text="   "), INVALID, "prompt is empty: set `text` to a prompt that is not blank"),
    ("no prompt", dict(), INVALID, "prompt is empty: set `text`"),
    (
        "empty chat",
        dict(chat=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content=" ")])),
        INVALID,
        "prompt is empty: give `chat` a message that is not blank",
    ),
    ("prompt beyond the window", dict(text="word " * 600), INVALID, "context window is 512"),
    ("max_new_tokens 0", dict(text="hi", max_new_tokens=0), INVALID, "max_new_tokens is 0"),
    (
        "max_new_tokens beyond the limit",
        dict(text="hi", max_new_tokens=100000),
        INVALID,
        "max_new_tokens is 100000: it must lie in [1, 256] (the coordinator's --max-new-tokens-limit)",
    ),
    (
        "prompt + max_new_tokens beyond the window",
        dict(text="word " * 300, max_new_tokens=250),
        INVALID,
        "the target's context window of 512 holds",
    ),
    ("negative temperature", dict(text="hi", temperature=-0.5), INVALID, "temperature is -0.5"),
    ("top_p 0", dict(text="hi", top_p=0.0), INVALID, "top_p is 0.0"),
    ("top_p above 1", dict(text="hi", top_p=1.5), INVALID, "(0, 1]"),
    ("negative top_k", dict(text="hi", top_k=-1), INVALID, "top_k is -1"),
    (
        "K beyond the limit",
        dict(text="hi", num_speculative_tokens=99),
        INVALID,
        "num_speculative_tokens is 99: it must lie in [0, 16] (0 = plain decode; the verify service's "
        "--max-num-speculative-tokens)",
    ),
    ("unknown drafter", dict(text="hi", drafter="eagle"), INVALID, "unknown drafter 'eagle'"),
    ("different vocabularies", dict(text="hi", drafter="other-vocab"), PRECONDITION, "different vocabulary"),
    ("n 0", dict(text="hi", n=0), INVALID, "n is 0: it must lie in [1, 8]"),
    ("n above the limit", dict(text="hi", n=9), INVALID, "n is 9: it must lie in [1, 8] (the coordinator's --max-n)"),
    ("top_logprobs above the limit", dict(text="hi", logprobs=True, top_logprobs=21), INVALID, "[0, 20]"),
    ("top_logprobs without logprobs", dict(text="hi", top_logprobs=3), INVALID, "set logprobs to true"),
    (
        "min_tokens with a grammar",
        dict(text="hi", min_tokens=1, structured_output=common_pb2.StructuredOutput(json_object=True)),
        INVALID,
        "min_tokens cannot be combined with structured_output (the grammar decides where the output ends): remove "
        "min_tokens",
    ),
]


def expect_error(address: str, fields: dict) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        generate_choices(address, coordinator_pb2.GenerateRequest(**fields), timeout_s=60)
    return caught.value


def still_serving(address: str) -> None:
    completion = generate(address, coordinator_pb2.GenerateRequest(text="hello", max_new_tokens=4), timeout_s=60)
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"


@pytest.mark.parametrize("case,fields,code,message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_its_status(tiny_pipeline, case, fields, code, message):
    err = expect_error(tiny_pipeline.address, fields)
    assert err.code() == code, err.details()
    assert message in err.details()
    still_serving(tiny_pipeline.address)


def test_unknown_session_is_not_found_on_both_services(tiny_pipeline):
    with (
        grpc.insecure_channel(tiny_pipeline.verify_address, options=GRPC_OPTIONS) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        verify_pb2_grpc.VerifyServiceStub(channel).Verify(
            verify_pb2.VerifyRequest(session_id="nope", draft_token_ids=[1]), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "prefill it again" in caught.value.details()
    with (
        grpc.insecure_channel(tiny_pipeline.draft_address, options=GRPC_OPTIONS) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        draft_pb2_grpc.DraftServiceStub(channel).Propose(
            draft_pb2.ProposeRequest(session_id="nope", num_speculative_tokens=2), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    still_serving(tiny_pipeline.address)


def test_a_decode_that_overtook_the_one_before_it_is_a_failed_precondition(tiny_pipeline):
    """A Decode saying which committed length it follows (a Decode sent ahead) fails with
    FAILED_PRECONDITION when the session holds another, and commits nothing; the right one runs."""
    with grpc.insecure_channel(tiny_pipeline.verify_address, options=GRPC_OPTIONS) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id="ahead", token_ids=[1, 2, 3]), timeout=10)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Decode(verify_pb2.DecodeRequest(session_id="ahead", num_committed_tokens=4), timeout=10)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "holds 3 committed tokens, the Decode follows 4" in caught.value.details()
            stub.Decode(verify_pb2.DecodeRequest(session_id="ahead", num_committed_tokens=3), timeout=10)
            stub.Decode(verify_pb2.DecodeRequest(session_id="ahead", num_committed_tokens=4), timeout=10)
        finally:
            stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id="ahead"), timeout=10)


def test_session_limit_is_resource_exhausted(tiny_pipeline):
    limit = tiny_pipeline.verify.servicer.sessions.max_sessions
    with grpc.insecure_channel(tiny_pipeline.verify_address, options=GRPC_OPTIONS) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        ids = [f"limit-{i}" for i in range(limit)]
        try:
            for sid in ids:
                stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id=sid, token_ids=[1, 2, 3]), timeout=10)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Prefill(
                    verify_pb2.VerifyServicePrefillRequest(session_id="one-too-many", token_ids=[1, 2]), timeout=10
                )
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry later, or raise the service's --max-sessions" in caught.value.details()
        finally:
            for sid in ids:
                stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=sid), timeout=10)
    still_serving(tiny_pipeline.address)


def test_client_cancel_releases_both_sessions(tiny_pipeline):
    request = coordinator_pb2.GenerateRequest(
        text="Tell me a long story.", max_new_tokens=200, num_speculative_tokens=2
    )
    responses = stream(tiny_pipeline.address, request)
    assert next(responses).token_ids
    responses.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while len(tiny_pipeline.verify.servicer.sessions) or len(tiny_pipeline.draft.servicer.sessions):
        assert time.monotonic() < deadline, "sessions were not released after the client cancelled"
        time.sleep(0.05)
    still_serving(tiny_pipeline.address)

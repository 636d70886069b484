"""Each stated limit is enforced, with an error that names its setting, and the next request within
the limit succeeds: gRPC message size (a service's --max-message-bytes), the size of a request to
the coordinator's public APIs, gRPC and HTTP (--max-request-bytes), and the requests one client may
run at once (--max-streams-per-client, per IP address, or per API key when keys are set). A stopped
coordinator gives back the calls it held on the services (their bound on calls in progress)."""

import http.client
import json
import threading
import time

import grpc
import pytest

from coordinator.api.auth import peer_host
from coordinator.api.client import generate, generate_choices, stream
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import coordinator_pb2, draft_pb2, draft_pb2_grpc
from specdec_app.launcher import free_port
from tests.conftest import CoordinatorThread

SMALL_MESSAGE = 4096
SMALL_REQUEST = 2048
KEYS = ["key-one", "key-two"]
LONG = coordinator_pb2.GenerateRequest(text="Tell me a long story.", max_new_tokens=400, num_speculative_tokens=0)
SHORT = coordinator_pb2.GenerateRequest(text="hello", max_new_tokens=2)


def coordinator(tiny_pipeline, tiny_models, **fields) -> CoordinatorThread:
    return CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=tiny_pipeline.draft_address,
            verify_addresses=[tiny_pipeline.verify_address],
            tokenizer=str(tiny_models.target_dir),
            **fields,
        )
    )


@pytest.fixture(scope="module")
def limited(tiny_pipeline, tiny_models):
    """A coordinator with small limits: 4 KiB messages to and from the services, 2 KiB requests from its
    clients, one request per client."""
    thread = coordinator(
        tiny_pipeline,
        tiny_models,
        http_port=free_port(),
        max_message_bytes=SMALL_MESSAGE,
        max_request_bytes=SMALL_REQUEST,
        max_streams_per_client=1,
    )
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def keyed(tiny_pipeline, tiny_models):
    """A coordinator with two API keys and one request per key."""
    thread = coordinator(tiny_pipeline, tiny_models, api_keys=KEYS, max_streams_per_client=1)
    yield thread
    thread.stop()


def post(port: int, body: bytes, headers: dict | None = None, chunked: bool = False) -> tuple[int, dict]:
    """POST /v1/completions; its status and JSON body (the first event of a stream)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        content = iter([body]) if chunked else body
        connection.request(
            "POST",
            "/v1/completions",
            content,
            {"Content-Type": "application/json", **(headers or {})},
            encode_chunked=chunked,
        )
        response = connection.getresponse()
        streamed = response.getheader("content-type", "").startswith("text/event-stream")
        raw = response.fp.readline() if streamed else response.read()
        return response.status, json.loads(raw.removeprefix(b"data: "))
    finally:
        connection.close()


def completion(model: str, prompt: str = "hello", **fields) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, **fields}).encode()


def eventually(check, timeout_s: float = 10.0):
    """``check()``'s result once it stops raising (a cancelled request is released asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except (AssertionError, grpc.RpcError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def grpc_error(address: str, request, api_key: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        generate_choices(address, request, timeout_s=60, api_key=api_key)
    return caught.value


# --- gRPC message size ---------------------------------------------------------------------------


def test_service_refuses_a_message_over_its_limit(tiny_pipeline):
    draft = build_draft(
        DraftSettings(port=0, default_drafter="ngram", max_message_bytes=SMALL_MESSAGE),
        drafters={"ngram": NgramDrafter()},
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{draft.port}", options=GRPC_OPTIONS) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            big = draft_pb2.DraftServicePrefillRequest(session_id="big", token_ids=[40000] * SMALL_MESSAGE)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Prefill(big, timeout=10)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
            small = draft_pb2.DraftServicePrefillRequest(session_id="small", token_ids=[1, 2, 3])
            stub.Prefill(small, timeout=10)
    finally:
        draft.stop(0)


def test_coordinator_refuses_a_grpc_request_over_its_limit(limited):
    address = f"127.0.0.1:{limited.port}"
    # over --max-request-bytes, under --max-message-bytes: the request limit answers
    err = grpc_error(address, coordinator_pb2.GenerateRequest(text="x" * (SMALL_REQUEST + 1), max_new_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert len(generate(address, SHORT, timeout_s=60).token_ids) == 2


# --- HTTP request size ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_http_body_over_the_limit_is_413(limited, tiny_models, chunked):
    model = str(tiny_models.target_dir)
    status, body = post(limited.http_port, completion(model, "word " * SMALL_REQUEST), chunked=chunked)
    assert status == 413, body
    assert "max_request_bytes" in body["error"]["message"] and str(SMALL_REQUEST) in body["error"]["message"]
    status, body = post(limited.http_port, completion(model), chunked=chunked)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# --- requests per client -------------------------------------------------------------------------


def test_one_request_over_the_client_limit_is_refused(limited, tiny_models):
    address, model = f"127.0.0.1:{limited.port}", str(tiny_models.target_dir)
    running = stream(address, LONG, timeout_s=60)
    assert next(running).token_ids  # the client's one request is running
    err = grpc_error(address, SHORT)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_client" in err.details()
    for streamed in (False, True):  # the same client over HTTP
        status, body = post(limited.http_port, completion(model, stream=streamed))
        assert status == 429 and "max_streams_per_client" in body["error"]["message"], body
    running.close()  # the client cancels its request: the next one is within the limit
    assert len(eventually(lambda: generate(address, SHORT, timeout_s=60)).token_ids) == 2
    status, body = post(limited.http_port, completion(model))
    assert status == 200, body


def test_each_choice_counts_against_the_client_limit(limited):
    two = coordinator_pb2.GenerateRequest(text="hello", max_new_tokens=2, n=2)
    err = grpc_error(f"127.0.0.1:{limited.port}", two)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "asks for 2 more" in err.details()


def test_client_limit_counts_per_api_key(keyed):
    address = f"127.0.0.1:{keyed.port}"
    running = stream(address, LONG, timeout_s=60, api_key=KEYS[0])
    assert next(running).token_ids
    err = grpc_error(address, SHORT, api_key=KEYS[0])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_client" in err.details()
    assert len(generate(address, SHORT, timeout_s=60, api_key=KEYS[1]).token_ids) == 2  # another client
    running.close()
    assert len(eventually(lambda: generate(address, SHORT, timeout_s=60, api_key=KEYS[0])).token_ids) == 2


@pytest.mark.parametrize(
    "peer,host",
    [
        ("ipv4:127.0.0.1:50000", "127.0.0.1"),
        ("ipv6:[::1]:50000", "::1"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
    ],
)
def test_peer_host(peer, host):
    assert peer_host(peer) == host


def test_calls_past_the_coordinators_concurrent_rpcs_are_refused_at_once(tiny_pipeline, tiny_models):
    thread = coordinator(tiny_pipeline, tiny_models, max_concurrent_rpcs=1)
    address = f"127.0.0.1:{thread.port}"
    try:
        running = stream(address, LONG, timeout_s=60)
        assert next(running).token_ids
        started = time.monotonic()
        err = grpc_error(address, SHORT)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 5
        running.close()
        assert len(eventually(lambda: generate(address, SHORT, timeout_s=60)).token_ids) == 2
    finally:
        thread.stop()


def step_streams() -> int:
    """The Step streams this process's draft and verify services serve: one reader thread each."""
    return sum(thread.name == "step-stream-reader" for thread in threading.enumerate())


def settled_step_streams() -> int:
    """:func:`step_streams` once it holds still for 0.5 s (an earlier test's coordinator may still
    be closing its streams)."""
    count = step_streams()
    for _ in range(20):
        time.sleep(0.5)
        count, previous = step_streams(), count
        if count == previous:
            break
    return count


def test_a_stopped_coordinator_ends_its_step_streams(tiny_pipeline, tiny_models):
    """Each stream holds one of a service's calls in progress (max_workers + 16): streams left
    open by stopped coordinators would fill it, and the next Verify would be RESOURCE_EXHAUSTED."""
    before = settled_step_streams()
    thread = coordinator(tiny_pipeline, tiny_models)
    generate(f"127.0.0.1:{thread.port}", SHORT, timeout_s=60)
    assert step_streams() > before
    thread.stop()

    def ended():
        assert step_streams() == before

    eventually(ended)

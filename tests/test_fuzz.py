"""Every RPC of every service, fuzzed with generated requests against the real servers (tiny models).

The property, for each call: it ends within its deadline, OK or with a status that names the
client's mistake (never INTERNAL, UNKNOWN, or a missed deadline), with a message; and a valid
request succeeds afterwards. The strategies build each request message field by field: values
in range and at the extremes (negative, 0, int32 / uint64 limits), NaN and infinite floats,
token ids out of the vocabulary, malformed draft distributions, unknown, empty and reused session
ids, calls in any order (Verify before Prefill, Propose after Release). Undecodable bytes (garbage,
strings that are not UTF-8) and messages over the size limit go through raw-bytes calls.

The runs are derandomized (the same examples every run); ``SPECDEC_FUZZ_EXAMPLES`` raises the
number of examples per test for a longer local run.
"""

import functools
import os
import uuid
from datetime import timedelta

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.client import generate, generate_choices
from specdec.rpc.errors import status_code
from specdec.rpc.server import GRPC_OPTIONS, MAX_MESSAGE_BYTES
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    draft_pb2,
    draft_pb2_grpc,
    verify_pb2,
    verify_pb2_grpc,
)
from tests.conftest import TINY_VOCAB

FUZZ = settings(
    max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "100")),
    deadline=timedelta(seconds=30),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TIMEOUT_S = 20  # every call's deadline: a call that hangs fails the test with DEADLINE_EXCEEDED
# the statuses that tell a client what to change; INTERNAL, UNKNOWN and DEADLINE_EXCEEDED are bugs
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# --- field strategies ----------------------------------------------------------------------------

int32s = st.one_of(st.integers(-3, 20), st.sampled_from([INT32_MIN, -1, INT32_MAX]), st.integers(INT32_MIN, INT32_MAX))
uint64s = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
floats = st.one_of(
    st.floats(0, 2, width=32),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e-45, 3.4e38]),
    st.floats(width=32),
)
valid_ids = st.integers(0, TINY_VOCAB - 1)
token_ids = st.one_of(valid_ids, st.sampled_from([-1, TINY_VOCAB, TINY_VOCAB + 1, INT32_MIN, INT32_MAX]))
# half the lists are in the vocabulary throughout, so that sessions open and calls get past the checks
token_lists = st.one_of(
    st.lists(valid_ids, min_size=1, max_size=24),
    st.lists(token_ids, max_size=24),
    st.integers(1, 2048).map(lambda n: [5] * n),  # up to 4 times the tiny models' window of 512
)
drafter_names = st.one_of(
    st.sampled_from(["", "transformers", "ngram", "self", "other-vocab", "eagle"]), st.text(max_size=8)
)
sampling = st.one_of(
    st.builds(common_pb2.SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.0, 1e-30]), seed=uint64s),
    st.builds(common_pb2.SamplingParams, temperature=floats, top_k=int32s, top_p=floats, seed=uint64s),
    st.builds(  # log-probabilities: top_logprobs up to beyond the vocabulary, with or without logprobs
        common_pb2.SamplingParams,
        logprobs=st.booleans(),
        top_logprobs=st.one_of(st.integers(0, 5), st.sampled_from([TINY_VOCAB, TINY_VOCAB + 1]), int32s),
    ),
)
# q over the tiny vocabulary: ids and probabilities in pairs (any values), or lists of any lengths
paired = st.lists(st.tuples(token_ids, floats), max_size=4).map(
    lambda pairs: common_pb2.TokenDistribution(token_ids=[t for t, _ in pairs], probs=[p for _, p in pairs])
)
distributions = st.one_of(
    paired,
    st.builds(
        common_pb2.TokenDistribution, token_ids=st.lists(token_ids, max_size=4), probs=st.lists(floats, max_size=4)
    ),
)


def _point_mass(token: int) -> common_pb2.TokenDistribution:
    return common_pb2.TokenDistribution(token_ids=[token], probs=[1.0])


def _proposals(session_id):
    """Verify requests: K draft tokens, each with a point mass on it (well-formed) or any q; or
    tokens and distributions in any numbers."""
    drafts = st.lists(st.tuples(valid_ids, st.one_of(st.none(), distributions)), max_size=5)
    matched = drafts.map(
        lambda pairs: verify_pb2.VerifyRequest(
            session_id=session_id,
            draft_token_ids=[t for t, _ in pairs],
            draft_distributions=[_point_mass(t) if q is None else q for t, q in pairs],
        )
    )
    wild = st.builds(
        verify_pb2.VerifyRequest,
        session_id=st.just(session_id),
        draft_token_ids=st.lists(token_ids, max_size=20),
        draft_distributions=st.lists(distributions, max_size=5),
    )
    return st.one_of(matched, wild)


# a small pool, so that calls reuse, reorder and release the same sessions; "" is never valid; most
# calls go to "a", the session the first call opens
session_names = st.sampled_from(["a", "a", "a", "b", ""])


def _ops(*messages):
    """Calls ``(method name, request)``: one strategy per RPC, each a ``st.builds`` of its message.
    The first call prefills session "a" (with any fields), so that later calls find it most times."""
    calls = st.one_of(*(st.tuples(st.just(name), strategy) for name, strategy in messages))
    prefill = dict(messages)["Prefill"].map(lambda request: ("Prefill", _renamed(request, "a")))
    return st.tuples(prefill, st.lists(calls, max_size=7)).map(lambda first_rest: [first_rest[0], *first_rest[1]])


def _renamed(request, session_id: str):
    request.session_id = session_id
    return request


draft_calls = _ops(
    ("GetInfo", st.builds(draft_pb2.DraftServiceGetInfoRequest)),
    (
        "Prefill",
        st.builds(
            draft_pb2.DraftServicePrefillRequest,
            session_id=session_names,
            drafter=drafter_names,
            token_ids=token_lists,
            sampling=sampling,
        ),
    ),
    (
        "Propose",
        st.builds(
            draft_pb2.ProposeRequest,
            session_id=session_names,
            appended_token_ids=token_lists,
            num_speculative_tokens=int32s,
            predicted_token_ids=st.lists(token_ids, max_size=4),
            num_branches=int32s,
            branch_budget_ms=floats,
        ),
    ),
    ("Release", st.builds(draft_pb2.DraftServiceReleaseRequest, session_id=session_names)),
)
verify_calls = _ops(
    ("GetInfo", st.builds(verify_pb2.VerifyServiceGetInfoRequest)),
    (
        "Prefill",
        st.builds(
            verify_pb2.VerifyServicePrefillRequest, session_id=session_names, token_ids=token_lists, sampling=sampling
        ),
    ),
    ("Verify", session_names.flatmap(_proposals)),
    ("Decode", st.builds(verify_pb2.DecodeRequest, session_id=session_names)),
    ("Release", st.builds(verify_pb2.VerifyServiceReleaseRequest, session_id=session_names)),
)


headers = st.builds(
    common_pb2.CallHeader,
    call_id=uint64s,
    timeout_ms=st.one_of(st.sampled_from([0.0, 1e9]), floats),
    trace_context=st.dictionaries(st.sampled_from(["traceparent", "tracestate", "x"]), st.text(max_size=60)),
)
# Step streams: messages of calls, each a Verify, a Decode or neither, with any header
verify_streams = st.lists(
    st.lists(
        st.one_of(
            st.builds(verify_pb2.VerifyCall, header=headers, verify=session_names.flatmap(_proposals)),
            st.builds(
                verify_pb2.VerifyCall,
                header=headers,
                decode=st.builds(verify_pb2.DecodeRequest, session_id=session_names),
            ),
            st.builds(verify_pb2.VerifyCall, header=headers),
        ),
        max_size=4,
    ).map(lambda calls: verify_pb2.VerifyStepRequest(calls=calls)),
    max_size=3,
)
draft_streams = st.lists(
    st.lists(
        st.one_of(
            st.builds(
                draft_pb2.DraftCall,
                header=headers,
                propose=st.builds(
                    draft_pb2.ProposeRequest,
                    session_id=session_names,
                    appended_token_ids=token_lists,
                    num_speculative_tokens=int32s,
                    predicted_token_ids=st.lists(token_ids, max_size=4),
                    num_branches=int32s,
                    branch_budget_ms=floats,
                ),
            ),
            st.builds(draft_pb2.DraftCall, header=headers),
        ),
        max_size=4,
    ).map(lambda calls: draft_pb2.DraftStepRequest(calls=calls)),
    max_size=3,
)


def _optional(strategy):
    return st.one_of(st.none(), strategy)


# structured output: valid and broken schemas, regexes, choices and grammars, and none
structured_outputs = st.one_of(
    st.builds(
        common_pb2.StructuredOutput,
        json_schema=st.one_of(
            st.sampled_from(['{"type": "object", "properties": {"a": {"type": "integer"}}}', '{"type": "nope"}', "{"]),
            st.text(max_size=20),
        ),
    ),
    st.builds(common_pb2.StructuredOutput, json_object=st.just(True)),
    st.builds(
        common_pb2.StructuredOutput, regex=st.one_of(st.sampled_from(["[a-z]{1,4}", "(", "a*b+"]), st.text(max_size=8))
    ),
    st.builds(
        common_pb2.StructuredOutput,
        choice=st.builds(common_pb2.Choices, choices=st.lists(st.text(max_size=6), max_size=3)),
    ),
    st.builds(
        common_pb2.StructuredOutput,
        grammar=st.one_of(
            st.sampled_from(['start: "yes" | "no"', 'root ::= "a" | "b"', "start:"]), st.text(max_size=12)
        ),
    ),
)


generate_requests = st.builds(
    lambda prompt, fields: coordinator_pb2.GenerateRequest(
        **prompt, **{name: value for name, value in fields.items() if value is not None}
    ),
    st.one_of(
        st.builds(lambda text: {"text": text}, st.text(max_size=40)),
        st.integers(1, 1000).map(lambda n: {"text": "word " * n}),  # up to about 2 windows
        st.builds(
            lambda messages: {"chat": coordinator_pb2.ChatMessages(messages=messages)},
            st.lists(
                st.builds(
                    coordinator_pb2.ChatMessage,
                    role=st.sampled_from(["system", "user", "assistant", "tool", ""]),
                    content=st.text(max_size=20),
                ),
                max_size=3,
            ),
        ),
        st.just({}),
    ),
    st.fixed_dictionaries(
        {
            "raw_prompt": st.booleans(),
            # mostly short completions: a valid request runs to its end
            "max_new_tokens": _optional(st.one_of(st.integers(1, 3), int32s)),
            "temperature": _optional(floats),
            "top_k": _optional(int32s),
            "top_p": _optional(floats),
            "seed": _optional(uint64s),
            "stop": st.lists(st.text(max_size=4), max_size=2),
            "num_speculative_tokens": _optional(int32s),
            "drafter": _optional(drafter_names),
            "request_id": _optional(
                st.one_of(st.sampled_from(["fuzz-reused", "x" * 129, "bad id!"]), st.text(max_size=8))
            ),
            "resume_from": _optional(int32s),
            "logprobs": st.booleans(),
            "top_logprobs": st.one_of(st.integers(0, 3), int32s),
            "n": _optional(st.one_of(st.integers(0, 2), int32s)),
            "frequency_penalty": _optional(floats),
            "presence_penalty": _optional(floats),
            "repetition_penalty": _optional(floats),
            "logit_bias": st.dictionaries(token_ids, floats, max_size=2),
            "min_tokens": _optional(int32s),
            "ignore_eos": st.booleans(),
            "structured_output": _optional(structured_outputs),
        }
    ),
)

# --- calls ---------------------------------------------------------------------------------------


def expect_answered(call) -> object:
    """Runs ``call()``; returns its response, or None when it failed with a client error. Fails
    the test for any other status, or an error without a message."""
    try:
        return call()
    except grpc.RpcError as err:
        assert err.code() in CLIENT_ERRORS, f"{err.code()}: {err.details()}"
        assert err.details(), f"{err.code()} without a message"
        return None


def namespaced(request, prefix: str):
    """``request`` with its session id prefixed (an example's sessions are its own); "" stays empty."""
    if getattr(request, "session_id", ""):
        request.session_id = prefix + request.session_id
    return request


@pytest.fixture(scope="module")
def channels(tiny_pipeline):
    addresses = (tiny_pipeline.draft_address, tiny_pipeline.verify_address)
    opened = [grpc.insecure_channel(address, options=GRPC_OPTIONS) for address in addresses]
    yield draft_pb2_grpc.DraftServiceStub(opened[0]), verify_pb2_grpc.VerifyServiceStub(opened[1])
    for channel in opened:
        channel.close()


def run_calls(stub, calls, release) -> None:
    prefix = uuid.uuid4().hex[:8] + "-"
    try:
        for method, request in calls:
            expect_answered(functools.partial(getattr(stub, method), namespaced(request, prefix), timeout=TIMEOUT_S))
    finally:
        for name in ("a", "b"):
            stub.Release(release(session_id=prefix + name), timeout=TIMEOUT_S)


def draft_still_works(stub) -> None:
    sid = uuid.uuid4().hex
    stub.Prefill(draft_pb2.DraftServicePrefillRequest(session_id=sid, token_ids=[1, 2, 3]), timeout=TIMEOUT_S)
    proposal = stub.Propose(draft_pb2.ProposeRequest(session_id=sid, num_speculative_tokens=3), timeout=TIMEOUT_S)
    stub.Release(draft_pb2.DraftServiceReleaseRequest(session_id=sid), timeout=TIMEOUT_S)
    assert len(proposal.token_ids) == 3


def verify_still_works(stub, target) -> None:
    """A fresh session's Decode gives the target's greedy token (the service is correct, not just up)."""
    sid, context = uuid.uuid4().hex, [1, 2, 3]
    stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id=sid, token_ids=context), timeout=TIMEOUT_S)
    token = stub.Decode(verify_pb2.DecodeRequest(session_id=sid), timeout=TIMEOUT_S).token_id
    stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=sid), timeout=TIMEOUT_S)
    reference = target.new_session(context, SamplingParams())
    try:
        assert token == int(reference.next_logits()[0].argmax())
    finally:
        reference.close()


# --- the properties ------------------------------------------------------------------------------


@FUZZ
@given(calls=draft_calls)
def test_draft_service_answers_every_call(channels, calls):
    draft, _ = channels
    run_calls(draft, calls, draft_pb2.DraftServiceReleaseRequest)
    draft_still_works(draft)


@FUZZ
@given(calls=verify_calls)
def test_verify_service_answers_every_call(channels, tiny_pipeline, calls):
    _, verify = channels
    run_calls(verify, calls, verify_pb2.VerifyServiceReleaseRequest)
    verify_still_works(verify, tiny_pipeline.target)


def expect_every_call_answered(stub, messages, prefill_cls, release_cls) -> None:
    """Prefills a session ``a`` (``prefill_cls``), sends ``messages`` over a Step stream (each
    call's session prefixed like it) and releases it (``release_cls``): every call gets exactly
    one result, OK or an error that names the client's mistake, with a message; or UNAVAILABLE
    for a call whose own deadline was under a second (it may pass before the call's step)."""
    prefix = uuid.uuid4().hex[:8] + "-"
    for message in messages:
        for call in message.calls:
            kind = call.WhichOneof("call")
            if kind:
                namespaced(getattr(call, kind), prefix)
    calls = [call for message in messages for call in message.calls]
    short = {call.header.call_id for call in calls if 0 < call.header.timeout_ms < 1000}
    stub.Prefill(prefill_cls(session_id=prefix + "a", token_ids=[1, 2, 3]), timeout=TIMEOUT_S)
    try:
        results = [r for response in stub.Step(iter(messages), timeout=TIMEOUT_S) for r in response.results]
    finally:
        stub.Release(release_cls(session_id=prefix + "a"), timeout=TIMEOUT_S)
    assert sorted(r.call_id for r in results) == sorted(call.header.call_id for call in calls)
    for result in results:
        if result.WhichOneof("result") == "error":
            code = status_code(result.error.code)
            assert code in CLIENT_ERRORS or (code == grpc.StatusCode.UNAVAILABLE and result.call_id in short), result
            assert result.error.message


@FUZZ
@given(messages=verify_streams)
def test_verify_step_stream_answers_every_call(channels, tiny_pipeline, messages):
    _, verify = channels
    expect_every_call_answered(
        verify, messages, verify_pb2.VerifyServicePrefillRequest, verify_pb2.VerifyServiceReleaseRequest
    )
    verify_still_works(verify, tiny_pipeline.target)


@FUZZ
@given(messages=draft_streams)
def test_draft_step_stream_answers_every_call(channels, messages):
    draft, _ = channels
    expect_every_call_answered(
        draft, messages, draft_pb2.DraftServicePrefillRequest, draft_pb2.DraftServiceReleaseRequest
    )
    draft_still_works(draft)


@pytest.fixture(scope="module")
def stored_request(tiny_pipeline):
    """A finished request, "fuzz-reused", that generated requests resume or reuse the id of."""
    request = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=3, request_id="fuzz-reused")
    generate(tiny_pipeline.address, request, timeout_s=TIMEOUT_S)


@FUZZ
@given(request=generate_requests)
def test_coordinator_answers_every_generate(tiny_pipeline, stored_request, request):
    expect_answered(lambda: generate_choices(tiny_pipeline.address, request, timeout_s=TIMEOUT_S))
    valid = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=2)
    completion = generate(tiny_pipeline.address, valid, timeout_s=TIMEOUT_S)
    assert len(completion.token_ids) == 2


# --- undecodable and oversized requests (raw bytes) ----------------------------------------------

# every unary method, with the numbers of its string fields
METHODS = [
    ("draft", "/specdec.v1.DraftService/Prefill", (1, 2)),
    ("draft", "/specdec.v1.DraftService/Propose", (1,)),
    ("draft", "/specdec.v1.DraftService/Release", (1,)),
    ("draft", "/specdec.v1.DraftService/GetInfo", ()),
    ("verify", "/specdec.v1.VerifyService/Prefill", (1,)),
    ("verify", "/specdec.v1.VerifyService/Verify", (1,)),
    ("verify", "/specdec.v1.VerifyService/Decode", (1,)),
    ("verify", "/specdec.v1.VerifyService/Release", (1,)),
    ("verify", "/specdec.v1.VerifyService/GetInfo", ()),
    ("coordinator", "/specdec.v1.CoordinatorService/Generate", (1, 9, 11, 12)),
]


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def raw_call(tiny_pipeline, service: str, method: str, payload: bytes, options=GRPC_OPTIONS):
    """Sends ``payload`` as the request bytes; returns the status code (OK when it succeeded)."""
    address = {
        "draft": tiny_pipeline.draft_address,
        "verify": tiny_pipeline.verify_address,
        "coordinator": tiny_pipeline.address,
    }[service]
    with grpc.insecure_channel(address, options=options) as channel:
        streaming = service == "coordinator"
        call = (channel.unary_stream if streaming else channel.unary_unary)(method)
        try:
            result = call(payload, timeout=TIMEOUT_S)
            if streaming:
                list(result)
        except grpc.RpcError as err:
            assert err.details(), f"{err.code()} without a message"
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


undecodable = st.one_of(
    # a string field that is not UTF-8
    st.tuples(st.sampled_from(METHODS), st.binary(min_size=1, max_size=8).filter(_not_utf8)).flatmap(
        lambda pair: st.sampled_from(pair[0][2] or (1,)).map(
            lambda field: (pair[0], length_delimited(field, pair[1])) if pair[0][2] else (pair[0], b"\xff")
        )
    ),
    # garbage: a truncated tag, a length running past the end
    st.tuples(st.sampled_from(METHODS), st.sampled_from([b"\xff", b"\x0a\x10ab", b"\x80\x80\x80"])),
)


@FUZZ
@given(case=undecodable)
def test_undecodable_request_is_invalid_argument(tiny_pipeline, channels, case):
    (service, method, _), payload = case
    code, details = raw_call(tiny_pipeline, service, method, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {code} {details}"
    assert "not a valid protobuf message" in details
    draft_still_works(channels[0])


@pytest.mark.parametrize("service,method", [(s, m) for s, m, _ in METHODS if "GetInfo" not in m])
def test_oversized_request_is_resource_exhausted(tiny_pipeline, channels, service, method):
    payload = length_delimited(1, b"x" * (MAX_MESSAGE_BYTES + 1))
    unlimited = [("grpc.max_send_message_length", -1)]  # the server's limit answers, not the client's
    code, details = raw_call(tiny_pipeline, service, method, payload, unlimited)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    draft_still_works(channels[0])


@pytest.mark.parametrize("service", ["draft", "verify"])
@pytest.mark.parametrize("payload", [b"\xff", b"\x0a\x10ab", length_delimited(1, length_delimited(1, b"\x80"))])
def test_undecodable_step_message_ends_the_stream_with_invalid_argument(tiny_pipeline, channels, service, payload):
    address = tiny_pipeline.draft_address if service == "draft" else tiny_pipeline.verify_address
    name = "DraftService" if service == "draft" else "VerifyService"
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        step = channel.stream_stream(f"/specdec.v1.{name}/Step")
        with pytest.raises(grpc.RpcError) as failed:
            list(step(iter([payload]), timeout=TIMEOUT_S))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    assert "not a valid protobuf message" in failed.value.details()
    draft_still_works(channels[0])

"""The service end of a Step stream (specdec/rpc/step_server.py), driven directly: calls run as their
starters (on the reading thread, replying at once or later from another thread), results that
are ready travel in one message, one step's results always do, errors come back as CallErrors."""

import queue
import threading
import time

import grpc
import pytest

from specdec.handoff import together
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.delay_hook import delayed_starters
from specdec.rpc.errors import NotFound
from specdec.rpc.step_server import StepCalls
from specdec.v1 import common_pb2, verify_pb2


class Context:
    """What StepCalls asks of the servicer context: whether the caller is still there."""

    def __init__(self):
        self.active = True

    def is_active(self) -> bool:
        return self.active


def decode_call(call_id: int, session_id: str = "s", timeout_ms: float = 1000.0) -> verify_pb2.VerifyCall:
    header = common_pb2.CallHeader(call_id=call_id, timeout_ms=timeout_ms)
    return verify_pb2.VerifyCall(header=header, decode=verify_pb2.DecodeRequest(session_id=session_id))


@pytest.fixture
def metrics():
    metrics = ServiceMetrics()
    yield metrics
    metrics.close()


def not_called(request, timeout_s, abandoned, reply) -> None:
    """The Verify starter of the tests that send Decode calls only."""
    reply(AssertionError("no Verify call was expected"))


def step_calls(metrics, decode) -> StepCalls:
    """A Step stream's service end whose Decode calls are started by ``decode``."""
    starters = {"decode": decode, "verify": not_called}
    return StepCalls("specdec.v1.VerifyService", starters, verify_pb2.VerifyCallResult, metrics)


def test_results_ready_together_travel_in_one_message(metrics):
    done = threading.Semaphore(0)

    def decode(request, timeout_s, abandoned, reply):
        done.release()
        reply(verify_pb2.DecodeResponse(token_id=int(request.session_id)))

    calls = [decode_call(i, str(100 + i)) for i in range(1, 9)]
    stream = step_calls(metrics, decode).serve(iter([verify_pb2.VerifyStepRequest(calls=calls)]), Context())
    for _ in calls:
        assert done.acquire(timeout=10)
    time.sleep(0.05)  # every handler has put its result
    (results,) = list(stream)  # one message, then the stream ends: the caller closed and all are answered
    assert sorted((r.call_id, r.decode.token_id) for r in results) == [(i, 100 + i) for i in range(1, 9)]


def test_the_results_one_step_hands_together_travel_in_one_message(metrics):
    """Replies handed within one together() block (as the engine hands a step's outcomes) go out
    as one message, however slowly they are handed and however eagerly the stream reads."""
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def decode(request, timeout_s, abandoned, reply):
        pending.put((int(request.session_id), reply))

    calls = [decode_call(i, str(i)) for i in range(1, 7)]
    stream = step_calls(metrics, decode).serve(iter([verify_pb2.VerifyStepRequest(calls=calls)]), Context())
    replies = [pending.get(timeout=10) for _ in calls]

    def engine() -> None:  # two steps of three calls each, a pause between hand-offs
        for step in (replies[:3], replies[3:]):
            with together():
                for token_id, reply in step:
                    reply(verify_pb2.DecodeResponse(token_id=token_id))
                    time.sleep(0.05)

    threading.Thread(target=engine).start()
    messages = [sorted(r.decode.token_id for r in results) for results in stream]
    assert messages == [[1, 2, 3], [4, 5, 6]]


def test_each_call_gets_its_deadline_and_fails_as_its_unary_rpc_would(metrics):
    seen = {}

    def decode(request, timeout_s, abandoned, reply):
        seen[request.session_id] = timeout_s
        if request.session_id == "gone":
            raise NotFound("session 'gone' not found: prefill it again")
        if request.session_id == "bug":
            raise RuntimeError("a bug")
        reply(verify_pb2.DecodeResponse(token_id=7))

    header = common_pb2.CallHeader(call_id=4)
    calls = [
        decode_call(1, "ok", timeout_ms=250),
        decode_call(2, "gone"),
        decode_call(3, "bug"),
        verify_pb2.VerifyCall(header=header),  # no kind of call set
    ]
    stream = step_calls(metrics, decode).serve(iter([verify_pb2.VerifyStepRequest(calls=calls)]), Context())
    results = {r.call_id: r for message in stream for r in message}
    assert results[1].decode.token_id == 7 and 0.2 < seen["ok"] <= 0.25  # its deadline, counted from its arrival
    assert results[2].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "prefill it again" in results[2].error.message
    assert results[3].error.code == grpc.StatusCode.INTERNAL.value[0] and "a bug" in results[3].error.message
    assert results[4].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "must set one of decode, verify; it set none" in results[4].error.message
    errors = {
        (s.labels["method"], s.labels["code"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "specdec_rpc_errors_total"
    }
    assert errors[("Decode", "NOT_FOUND")] == 1 and errors[("Decode", "INTERNAL")] == 1


def test_the_stream_waits_for_calls_in_flight_after_the_caller_closes_its_side(metrics):
    release = threading.Event()

    def decode(request, timeout_s, abandoned, reply):
        threading.Thread(target=lambda: release.wait(10) and reply(verify_pb2.DecodeResponse(token_id=1))).start()

    stream = step_calls(metrics, decode).serve(iter([verify_pb2.VerifyStepRequest(calls=[decode_call(1)])]), Context())
    answered: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: answered.put(list(stream)), daemon=True).start()
    time.sleep(0.2)
    assert answered.empty()  # the caller closed its side, but its call is still running
    release.set()
    assert [[r.call_id for r in message] for message in answered.get(timeout=10)] == [[1]]


def test_the_stream_ends_when_the_caller_goes_away(metrics):
    def requests():
        yield verify_pb2.VerifyStepRequest(calls=[decode_call(1)])
        time.sleep(60)  # the caller keeps its side open

    context = Context()
    stream = step_calls(metrics, lambda r, t, a, reply: reply(verify_pb2.DecodeResponse())).serve(requests(), context)
    assert [r.call_id for r in next(stream)] == [1]
    context.active = False
    start = time.monotonic()
    assert list(stream) == []
    assert time.monotonic() - start < 3


def test_starters_take_no_thread_and_their_replies_from_another_thread_travel_together(metrics):
    """A starter runs on the reading thread and replies later (as the verify service's engine
    does, from its own thread): calls are all started before any is answered, no pool thread runs
    them, and replies given together leave in one message."""
    started: list = []
    threads = set()

    def decode(request, timeout_s, abandoned, reply):
        threads.add(threading.current_thread().name)
        if request.session_id == "gone":
            raise NotFound("session 'gone' not found: prefill it again")
        started.append((int(request.session_id), reply))

    calls = [decode_call(i, str(100 + i)) for i in range(1, 9)] + [decode_call(9, "gone")]
    stream = step_calls(metrics, decode).serve(iter([verify_pb2.VerifyStepRequest(calls=calls)]), Context())
    first = next(stream)  # the error, answered at once
    assert [(r.call_id, r.error.code) for r in first] == [(9, grpc.StatusCode.NOT_FOUND.value[0])]
    assert len(started) == 8 and threads == {"step-stream-reader"}

    def engine_step():
        for token, reply in started:
            reply(verify_pb2.DecodeResponse(token_id=token))

    threading.Thread(target=engine_step).start()
    (results,) = list(stream)
    assert sorted((r.call_id, r.decode.token_id) for r in results) == [(i, 100 + i) for i in range(1, 9)]


def test_the_delay_hook_holds_a_starters_call_in_the_pool(metrics):
    def decode(request, timeout_s, abandoned, reply):
        reply(verify_pb2.DecodeResponse(token_id=3))

    starters = delayed_starters({"decode": decode, "verify": not_called}, {"Decode": 0.2}, max_workers=1)
    calls = StepCalls("specdec.v1.VerifyService", starters, verify_pb2.VerifyCallResult, metrics)
    start = time.monotonic()
    (results,) = list(calls.serve(iter([verify_pb2.VerifyStepRequest(calls=[decode_call(1)])]), Context()))
    assert results[0].decode.token_id == 3 and time.monotonic() - start >= 0.2


def test_starters_must_match_the_protos_calls(metrics):
    """A service whose starters miss a kind of call its result message has (or add one it lacks)
    fails at construction, not at the first such call."""
    decode = lambda request, timeout_s, abandoned, reply: None  # noqa: E731
    with pytest.raises(ValueError, match=r"\['decode'\] differ from its calls \['decode', 'verify'\]"):
        StepCalls("specdec.v1.VerifyService", {"decode": decode}, verify_pb2.VerifyCallResult, metrics)
    with pytest.raises(ValueError, match="differ from its calls"):
        StepCalls(
            "specdec.v1.VerifyService",
            {"decode": decode, "verify": decode, "propose": decode},
            verify_pb2.VerifyCallResult,
            metrics,
        )

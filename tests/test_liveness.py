"""A service whose engine loop or idle-session janitor dies, or whose engine step hangs, says so, in
process: the failure is injected from outside production code (the engine's scheduling, the
registry's eviction replaced on the instance by one that raises, the model's forward by one that
never returns), the service's health turns NOT_SERVING, its calls fail with UNAVAILABLE, and its
liveness records what died (the process exits from RunningService.serve_until_signal:
tests/test_supervision.py restarts one under ``specdec up``)."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.drafters.ngram import NgramDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.models import load_causal_lm
from specdec.rpc.server import GRPC_OPTIONS, RunningService
from specdec.v1 import verify_pb2, verify_pb2_grpc
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings
from verify_service.target import Target


def health(service: RunningService) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{service.port}", options=GRPC_OPTIONS) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


STEP_TIMEOUT_S = 1.0


@pytest.fixture
def verify(tiny_models):
    """A verify service on its own copy of the tiny target (its engine is killed), its steps bound
    to STEP_TIMEOUT_S."""
    model, tokenizer = load_causal_lm(str(tiny_models.target_dir), dtype="float32")
    target = Target(model, tokenizer, "tiny-dying", max_num_speculative_tokens=4)
    target.measure_costs()
    settings = VerifySettings(port=0, max_num_speculative_tokens=4, engine_step_timeout_s=STEP_TIMEOUT_S)
    service = build_verify(settings, target=target)
    yield service
    service.stop(0)


def test_a_dead_engine_loop_turns_the_service_not_serving(verify, monkeypatch):
    target = verify.servicer.target
    assert health(verify) == health_pb2.HealthCheckResponse.SERVING

    def broken_schedule(alone: bool):
        raise RuntimeError("injected: the scheduler failed")

    monkeypatch.setattr(target.engine, "_schedule", broken_schedule)
    with grpc.insecure_channel(f"127.0.0.1:{verify.port}", options=GRPC_OPTIONS) as channel:
        request = verify_pb2.VerifyServicePrefillRequest(session_id="s", token_ids=[5, 6, 7], decode=True)
        with pytest.raises(grpc.RpcError) as failed:
            verify_pb2_grpc.VerifyServiceStub(channel).Prefill(request, timeout=30)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the verify engine loop died" in failed.value.details()
    assert verify.liveness.failed.is_set()
    assert verify.liveness.failure == "the verify engine loop died: RuntimeError('injected: the scheduler failed')"
    assert health(verify) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_dead_janitor_turns_the_service_not_serving():
    draft = build_draft(
        DraftSettings(port=0, drafters=["ngram"], default_drafter="ngram", session_idle_timeout_s=1),
        drafters={"ngram": NgramDrafter(1, 3)},
    )
    try:

        def broken_evict_idle() -> list[str]:
            raise RuntimeError("injected: eviction failed")

        draft.servicer.sessions.evict_idle = broken_evict_idle  # its janitor's next pass, within a second
        assert draft.liveness.failed.wait(10)
        assert "the idle-session janitor died" in draft.liveness.failure
        deadline = time.monotonic() + 10
        while health(draft) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        draft.stop(0)


def test_a_hung_step_turns_the_service_not_serving_within_its_bound(verify, monkeypatch):
    lm, release = verify.servicer.target.lm, threading.Event()
    forward = lm.forward

    def hung_forward(steps):
        release.wait(60)  # a forward that does not return (until the test ends)
        return forward(steps)

    monkeypatch.setattr(lm, "forward", hung_forward)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{verify.port}", options=GRPC_OPTIONS) as channel:
            request = verify_pb2.VerifyServicePrefillRequest(session_id="s", token_ids=[5, 6, 7], decode=True)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                verify_pb2_grpc.VerifyServiceStub(channel).Prefill(request, timeout=30)
            took_s = time.monotonic() - started
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine_step_timeout_s" in failed.value.details()
        assert STEP_TIMEOUT_S < took_s < STEP_TIMEOUT_S + 2.0  # the watchdog looks every 0.25 s here
        assert verify.liveness.failed.is_set() and "the verify engine died" in verify.liveness.failure
        assert health(verify) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        release.set()


def test_a_step_within_its_bound_is_left_alone(verify, monkeypatch):
    lm = verify.servicer.target.lm
    forward = lm.forward

    def slow_forward(steps):
        time.sleep(STEP_TIMEOUT_S / 2)
        return forward(steps)

    monkeypatch.setattr(lm, "forward", slow_forward)
    with grpc.insecure_channel(f"127.0.0.1:{verify.port}", options=GRPC_OPTIONS) as channel:
        request = verify_pb2.VerifyServicePrefillRequest(session_id="s", token_ids=[5, 6, 7], decode=True)
        assert verify_pb2_grpc.VerifyServiceStub(channel).Prefill(request, timeout=30).HasField("next_token_id")
    time.sleep(STEP_TIMEOUT_S)
    assert not verify.liveness.failed.is_set()
    assert health(verify) == health_pb2.HealthCheckResponse.SERVING

"""The draft and verify services report their load (specdec/rpc/service_load.py), as real gRPC services
over the tiny models: every GetInfo answer and every Step stream message carries the sessions open
of max_sessions, the calls waiting for their first step (counted while the engine is held busy),
the running sequences and the KV budget's blocks, total and free (0 for a draft service without
a paged KV pool); the engines' waiting calls are the gauge specdec_num_calls_waiting on /metrics."""

import threading
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.batching import SequenceStep
from specdec.engine.engine import Work
from specdec.engine.ragged_lm import BLOCK_SIZE
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from specdec_app.launcher import free_port
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings

# ids no other test's context starts with, so that no block comes from the prefix cache: each
# prompt takes ceil(40 / 16) = 3 blocks of its own
PROMPTS = {name: [3000 + 97 * i + j for j in range(40)] for i, name in enumerate(("a", "b", "c"))}
PROMPT_BLOCKS = -(-40 // BLOCK_SIZE)


@pytest.fixture(scope="module")
def verify(tiny_target):
    """A verify service of at most 4 sessions serving /metrics, and its stub."""
    metrics_port = free_port()
    service = build_verify(VerifySettings(port=0, max_sessions=4, metrics_port=metrics_port), target=tiny_target)
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel), metrics_port
    service.stop(0)


@pytest.fixture(scope="module")
def draft(tiny_drafters):
    """A draft service of at most 3 sessions with a transformers drafter (a paged KV pool under a
    budget) and n-gram lookup (no model), serving /metrics, and its stub. Without proactive drafting:
    a proactive draft is a queued call too, started after the Propose is answered, and would race
    the counts of the tests' own calls."""
    drafters = {name: tiny_drafters[name] for name in ("transformers", "ngram")}
    metrics_port = free_port()
    settings = DraftSettings(
        port=0,
        drafters=list(drafters),
        default_drafter="transformers",
        max_sessions=3,
        metrics_port=metrics_port,
        proactive_drafting=False,
    )
    service = build_draft(settings, drafters=drafters)
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        yield draft_pb2_grpc.DraftServiceStub(channel), metrics_port
    service.stop(0)


def verify_load(stub) -> common_pb2.ServiceLoad:
    return stub.GetInfo(verify_pb2.VerifyServiceGetInfoRequest(), timeout=10).load


def draft_load(stub) -> common_pb2.ServiceLoad:
    return stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=10).load


def test_verify_get_info_reports_its_sessions_and_kv_blocks(verify, tiny_target):
    stub, _ = verify
    before = verify_load(stub)
    assert (before.num_sessions, before.max_sessions, before.num_waiting_calls) == (0, 4, 0)
    assert before.kv_block_size == BLOCK_SIZE and before.kv_blocks_total == tiny_target.lm.max_blocks
    assert 0 < before.kv_blocks_free <= before.kv_blocks_total
    for session_id in ("a", "b"):
        stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id=session_id, token_ids=PROMPTS[session_id]))
    opened = verify_load(stub)
    assert opened.num_sessions == 2 and opened.num_running_seqs >= 2
    assert before.kv_blocks_free - opened.kv_blocks_free == 2 * PROMPT_BLOCKS
    for session_id in ("a", "b"):
        stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=session_id))
    released = verify_load(stub)
    assert released.num_sessions == 0 and released.kv_blocks_free == before.kv_blocks_free  # cached blocks are free


def test_draft_get_info_reports_its_sessions_and_its_transformers_drafters_kv_blocks(draft, tiny_drafters):
    stub, _ = draft
    before = draft_load(stub)
    assert (before.num_sessions, before.max_sessions, before.num_waiting_calls) == (0, 3, 0)
    assert before.kv_block_size == BLOCK_SIZE and before.kv_blocks_total == tiny_drafters["transformers"].lm.max_blocks
    for session_id, drafter in (("a", "transformers"), ("b", "ngram")):
        request = draft_pb2.DraftServicePrefillRequest(session_id=session_id, drafter=drafter, token_ids=PROMPTS["a"])
        stub.Prefill(request)
    opened = draft_load(stub)
    assert opened.num_sessions == 2
    assert before.kv_blocks_free - opened.kv_blocks_free == PROMPT_BLOCKS  # the n-gram session holds no KV
    for session_id in ("a", "b"):
        stub.Release(draft_pb2.DraftServiceReleaseRequest(session_id=session_id))
    assert draft_load(stub).num_sessions == 0


def test_a_draft_service_without_a_paged_kv_pool_reports_no_kv_blocks(tiny_drafters):
    service = build_draft(
        DraftSettings(port=0, default_drafter="ngram", max_sessions=2), {"ngram": tiny_drafters["ngram"]}
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            stub.Prefill(draft_pb2.DraftServicePrefillRequest(session_id="n", token_ids=PROMPTS["a"]))
            load = draft_load(stub)
    finally:
        service.stop(0)
    assert (load.num_sessions, load.max_sessions) == (1, 2)
    assert (load.kv_blocks_total, load.kv_blocks_free, load.kv_block_size) == (0, 0, 0)


def test_every_step_stream_message_carries_the_load(verify, draft):
    verify_stub, _ = verify
    draft_stub, _ = draft
    verify_stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id="s", token_ids=PROMPTS["c"]))
    draft_stub.Prefill(draft_pb2.DraftServicePrefillRequest(session_id="s", token_ids=PROMPTS["c"]))
    try:
        header = common_pb2.CallHeader(call_id=1, timeout_ms=10_000)
        decode = verify_pb2.VerifyCall(header=header, decode=verify_pb2.DecodeRequest(session_id="s"))
        propose = draft_pb2.DraftCall(
            header=header, propose=draft_pb2.ProposeRequest(session_id="s", num_speculative_tokens=2)
        )
        verified = list(verify_stub.Step(iter([verify_pb2.VerifyStepRequest(calls=[decode])]), timeout=30))
        drafted = list(draft_stub.Step(iter([draft_pb2.DraftStepRequest(calls=[propose])]), timeout=30))
    finally:
        verify_stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id="s"))
        draft_stub.Release(draft_pb2.DraftServiceReleaseRequest(session_id="s"))
    for messages, max_sessions in ((verified, 4), (drafted, 3)):
        assert [len(message.results) for message in messages] == [1]
        load = messages[0].load
        assert (load.num_sessions, load.max_sessions, load.num_waiting_calls) == (1, max_sessions, 0)
        assert load.num_running_seqs >= 1 and load.kv_block_size == BLOCK_SIZE
        assert 0 < load.kv_blocks_free <= load.kv_blocks_total - PROMPT_BLOCKS
        assert load.step_intercept_ms > 0 or load.step_ms_per_token > 0  # the step line, as GetInfo's


def test_the_verify_service_publishes_its_engines_step_line(verify, tiny_target):
    """GetInfo carries the line the target's engine keeps (specdec/engine/step_line.py), seeded by
    the start-up profile: the line every coordinator prices rounds by from its first request."""
    stub, _ = verify
    load = verify_load(stub)
    line = tiny_target.engine.step_line.line()
    assert line is not None and line[1] >= 0
    assert (load.step_intercept_ms, load.step_ms_per_token) == pytest.approx(line)


class Hold(Work):
    """A call that holds the engine's thread in its step until released: a sequence the model's
    store does not know, so its forward computes nothing."""

    seq_id = -1

    def __init__(self):
        self.holding, self.release = threading.Event(), threading.Event()

    def next_step(self, budget: int) -> SequenceStep:
        return SequenceStep(self.seq_id, [0], 1)

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        self.holding.set()
        return self.release.wait(30)


def calls_waiting_gauge(metrics_port: int) -> dict[str, float]:
    """{engine: value} of specdec_num_calls_waiting on a service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["engine"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "specdec_num_calls_waiting"
    }


def test_calls_queued_behind_a_busy_engine_are_reported_and_exported(verify, draft, tiny_target):
    """Two sessions' Decodes queued while the engine's thread is held in a step: GetInfo and the
    gauge both count 2 waiting; once the step ends they run, and both count 0 again."""
    stub, metrics_port = verify
    for session_id in ("a", "b"):
        stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id=session_id, token_ids=PROMPTS[session_id]))
    engine, hold = tiny_target.engine, Hold()
    engine.submit(hold, lambda *outcome: None)
    try:
        assert hold.holding.wait(10)
        decodes = [stub.Decode.future(verify_pb2.DecodeRequest(session_id=s), timeout=30) for s in ("a", "b")]
        deadline = time.monotonic() + 10
        while verify_load(stub).num_waiting_calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert verify_load(stub).num_waiting_calls == 2
        assert calls_waiting_gauge(metrics_port) == {"verify": 2.0}
    finally:
        hold.release.set()
    for decode in decodes:
        decode.result()
    assert verify_load(stub).num_waiting_calls == 0 and calls_waiting_gauge(metrics_port) == {"verify": 0.0}
    for session_id in ("a", "b"):
        stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=session_id))
    engine.forget(hold.seq_id)
    assert calls_waiting_gauge(draft[1]) == {"transformers": 0.0}  # the draft service exports its engines'

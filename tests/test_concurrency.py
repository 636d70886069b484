"""Serving under load: many sessions share each batched forward (continuous batching) and every
request still gets exactly its own output (invariants *lossless, greedy*, *KV consistency* and
*batch independence*), with the engine's limits."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from coordinator.api.client import generate
from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.engine import Engine, Work
from specdec.observability.prometheus import EngineMetrics
from specdec.rpc.errors import Unavailable
from specdec.rpc.server import GRPC_OPTIONS
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.conftest import StepRecorder, chat_ids, plain_greedy

PROMPTS = [
    "Tell me a story about a cat.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "Explain photosynthesis briefly.",
    "What is 17 times 3?",
    "Name a large river.",
    "Describe a cup of tea.",
]
# (drafter, K, max_new_tokens): fixed K 1..8, adaptive (None), plain decode (0); requests of
# different lengths leave the batch while others go on.
MIXES = [
    ("transformers", 1, 24),
    ("self", 8, 40),
    ("ngram", 3, 16),
    ("wrong", 2, 32),
    ("transformers", None, 40),
    ("ngram", None, 20),
    ("transformers", 0, 28),
    ("self", 4, 12),
]


def test_concurrent_requests_each_equal_their_own_plain_greedy(tiny_pipeline, smollm2_tokenizer):
    recorder = StepRecorder()
    tiny_pipeline.target.engine.metrics = recorder

    def run(i: int):
        drafter, k, max_new = MIXES[i]
        time.sleep(0.05 * (i % 3))  # sessions join at different steps
        request = coordinator_pb2.GenerateRequest(text=PROMPTS[i], max_new_tokens=max_new, drafter=drafter)
        if k is not None:
            request.num_speculative_tokens = k
        return generate(tiny_pipeline.address, request, timeout_s=120)

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            completions = list(pool.map(run, range(len(PROMPTS))))
    finally:
        tiny_pipeline.target.engine.metrics = EngineMetrics()
    for i, completion in enumerate(completions):
        expected = plain_greedy(tiny_pipeline.plain_model, chat_ids(smollm2_tokenizer, PROMPTS[i]), MIXES[i][2])
        assert completion.token_ids == expected, f"request {i} {MIXES[i]} diverged"
    assert max(recorder.batch_sizes) > 1, "no step batched two sessions"
    assert max(c.metrics.mean_batch_size for c in completions) > 1


def test_a_cancelled_stream_leaves_no_trace_in_the_others(tiny_pipeline, smollm2_tokenizer):
    def cancelled():
        request = coordinator_pb2.GenerateRequest(
            text=PROMPTS[0], max_new_tokens=200, num_speculative_tokens=4, drafter="transformers"
        )
        with grpc.insecure_channel(tiny_pipeline.address, options=GRPC_OPTIONS) as channel:
            responses = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=120)
            for i, _ in enumerate(responses):
                if i == 3:
                    responses.cancel()
                    break

    def kept(i: int):
        request = coordinator_pb2.GenerateRequest(
            text=PROMPTS[i], max_new_tokens=30, num_speculative_tokens=3, drafter="self"
        )
        return generate(tiny_pipeline.address, request, timeout_s=120)

    with ThreadPoolExecutor(4) as pool:
        cancel = pool.submit(cancelled)
        others = [pool.submit(kept, i) for i in (1, 2, 3)]
        cancel.result()
        for i, future in zip((1, 2, 3), others, strict=True):
            assert future.result().token_ids == plain_greedy(
                tiny_pipeline.plain_model, chat_ids(smollm2_tokenizer, PROMPTS[i]), 30
            )
    deadline = time.monotonic() + 10
    while len(tiny_pipeline.verify.servicer.sessions) or len(tiny_pipeline.draft.servicer.sessions):
        assert time.monotonic() < deadline, "sessions left on the services"
        time.sleep(0.05)


def test_batched_rollback_matches_fresh_prefill(tiny_target, plain_target_model):
    """Sessions verify together with partial rejections; each one's next logits then equal a fresh
    prefill of its own committed prefix."""
    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 4, 5], [1, 700, 800, 900, 1000, 1100, 1200, 1300]]
    sessions = [tiny_target.new_session(p, SamplingParams()) for p in prompts]
    barrier = threading.Barrier(len(sessions))

    def rounds(session):
        for wrong_tail in ([7, 7], [11], [5, 6, 7, 8]):
            own = int(session.next_logits()[0].argmax())
            session.rollback()
            barrier.wait()
            session.verify([own, *wrong_tail], None)

    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(rounds, sessions))
    for session in sessions:
        with torch.inference_mode():
            fresh = plain_target_model(torch.tensor([session.committed])).logits[0, -1]
        assert torch.allclose(session.next_logits()[0], fresh, atol=1e-4)
        session.close()


class SlowLM(BatchedLM):
    """A stand-in model for the engine's scheduling: each step takes ``step_s`` and returns zeros."""

    vocab_size = 4

    def __init__(self, step_s: float):
        self.step_s, self.steps = step_s, []

    def allocate(self, owner: str = "") -> int:
        return 0

    def free(self, seq_id): ...

    def truncate(self, seq_id, length): ...

    def cache_bytes(self, seq_id) -> int:
        return 0

    def forward(self, steps):
        self.steps.append([(s.seq_id, len(s.token_ids)) for s in steps])
        time.sleep(self.step_s)
        return [torch.zeros(s.num_logits, self.vocab_size) for s in steps]


class Tokens(Work):
    def __init__(self, seq_id: int, num_tokens: int, prefill: bool = False):
        self.seq_id, self.remaining, self.is_prefill = seq_id, num_tokens, prefill

    def next_step(self, budget: int) -> SequenceStep:
        n = min(self.remaining, budget) if self.is_prefill else self.remaining
        return SequenceStep(self.seq_id, [0] * n, 1)

    def finish_step(self, step, logits) -> bool:
        self.remaining -= len(step.token_ids)
        return self.remaining == 0


def test_engine_limits_queue_and_chunked_prefill():
    lm = SlowLM(0.05)
    engine = Engine(lm, max_num_seqs=2, max_num_batched_tokens=8)
    with ThreadPoolExecutor(6) as pool:
        prefill = pool.submit(engine.run, Tokens(100, 20, prefill=True))
        time.sleep(0.01)
        decodes = [pool.submit(engine.run, Tokens(i, 1)) for i in range(5)]
        waits = [future.result(10)[1].queue_ms for future in decodes]
        prefill.result(10)
    assert all(len(step) <= 2 and sum(n for _, n in step) <= 8 for step in lm.steps)
    assert max(waits) > 50  # calls beyond max_num_seqs waited for a later step
    chunks = [n for step in lm.steps for seq, n in step if seq == 100]
    assert sum(chunks) == 20 and len(chunks) >= 3  # the prompt went in chunks beside the decodes
    engine.stop()


def test_a_call_past_its_deadline_fails_with_unavailable():
    engine = Engine(SlowLM(0.3), max_num_seqs=1, max_num_batched_tokens=8)
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(engine.run, Tokens(1, 1))
        time.sleep(0.05)
        with pytest.raises(Unavailable, match="deadline"):
            engine.run(Tokens(2, 1), timeout_s=0.1)
        busy.result(5)
    engine.stop()


def test_prefill_beyond_the_session_limit_is_resource_exhausted(tiny_pipeline):
    channel = grpc.insecure_channel(tiny_pipeline.verify_address, options=GRPC_OPTIONS)
    stub = verify_pb2_grpc.VerifyServiceStub(channel)
    limit = tiny_pipeline.verify.servicer.sessions.max_sessions
    ids = [f"limit-{i}" for i in range(limit)]
    try:
        for sid in ids:
            stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id=sid, token_ids=[1, 2, 3]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(verify_pb2.VerifyServicePrefillRequest(session_id="one-more", token_ids=[1, 2, 3]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in err.value.details()
    finally:
        for sid in ids:
            stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id=sid))
        channel.close()

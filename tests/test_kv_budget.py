"""KV memory admitted by bytes, through real gRPC services on the tiny models: a verify service
whose KV budget is a few blocks refuses a Prefill it cannot hold with RESOURCE_EXHAUSTED before
any work runs (saying whether it could ever fit) and goes on serving the others; and requests
that together outgrow the verify and draft services' budgets preempt each other's sessions, which
the coordinator rebuilds, with every output identical to plain greedy decoding, and the
preemptions counted in the services' Prometheus metrics. The KV store itself (budget cap,
admission, preemption, shrink): tests/test_ragged_lm.py."""

import threading
import time

import grpc
import pytest

from coordinator.api.client import generate
from coordinator.settings import CoordinatorSettings
from draft_service.drafters.transformers_lm import TransformersDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.engine.models import load_causal_lm
from specdec.engine.ragged_lm import BLOCK_SIZE
from specdec.rpc.server import GRPC_OPTIONS, RunningService
from specdec.v1 import coordinator_pb2, verify_pb2, verify_pb2_grpc
from tests.conftest import CoordinatorThread, StepRecorder, chat_ids, plain_greedy
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings
from verify_service.target import Target

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE  # the tiny Llama's: layers x (key, value) x KV heads x head_dim x float32
K = 4
PROMPTS = [
    "Describe a lighthouse at night.",
    "Write about a train crossing the mountains.",
    "Tell me about the sea in winter.",
]
MAX_NEW = 64


def budget_target(tiny_models, blocks: int) -> Target:
    """The tiny target (its own copy) with a KV budget of ``blocks`` blocks."""
    model, tokenizer = load_causal_lm(str(tiny_models.target_dir), dtype="float32")
    target = Target(
        model, tokenizer, "tiny-budget", max_num_speculative_tokens=K, kv_cache_max_bytes=blocks * BLOCK_BYTES
    )
    assert target.lm.block_bytes == BLOCK_BYTES
    target.measure_costs()
    return target


def start_verify(target: Target) -> RunningService:
    return build_verify(VerifySettings(port=0, max_sessions=8, max_num_speculative_tokens=K), target=target)


def prefill(stub, session_id: str, num_tokens: int) -> verify_pb2.VerifyServicePrefillResponse:
    """A context of its own (no prefix another session's shares) of ``num_tokens``, and its first token."""
    first = 100 + 1000 * len(session_id)
    ids = [first + i for i in range(num_tokens)]
    request = verify_pb2.VerifyServicePrefillRequest(session_id=session_id, token_ids=ids, decode=True)
    return stub.Prefill(request, timeout=30)


def test_a_prefill_the_budget_cannot_hold_is_refused_and_the_others_are_served(tiny_models):
    """Budget 12 blocks, the watermark 1: a 192-token context (12 blocks) can never fit; with 7 and
    4 blocks held, a third context of one block is refused for now, before any step runs, the open
    sessions decode on, and once one is released the third is admitted."""
    target = budget_target(tiny_models, 12)
    verify = start_verify(target)
    target.engine.metrics = steps = StepRecorder()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{verify.port}", options=GRPC_OPTIONS) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            with pytest.raises(grpc.RpcError) as never:
                prefill(stub, "too long", 12 * BLOCK_SIZE)
            assert never.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # waiting would not help
            assert "can ever hold; raise --kv-cache-max-bytes to at least 106496 bytes" in never.value.details()
            prefill(stub, "long", 7 * BLOCK_SIZE - 2)  # its decodes fit its blocks: nothing grows
            prefill(stub, "short one", 4 * BLOCK_SIZE - 2)
            num_steps = len(steps.batch_sizes)
            with pytest.raises(grpc.RpcError) as full:
                prefill(stub, "third", 5)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "kv_cache_max_bytes = 98304 bytes) is full" in full.value.details()
            assert len(steps.batch_sizes) == num_steps and len(verify.servicer.sessions) == 2
            for session in ("long", "short one"):  # the open sessions are served on
                stub.Decode(verify_pb2.DecodeRequest(session_id=session), timeout=30)
            stub.Release(verify_pb2.VerifyServiceReleaseRequest(session_id="long"), timeout=30)
            assert prefill(stub, "third", 5).HasField("next_token_id")
    finally:
        verify.stop(0)


@pytest.fixture
def small_budget_pipeline(tiny_models, smollm2_tokenizer):
    """Coordinator, draft (the transformers drafter on the tiny draft model) and verify services
    whose KV budgets (12 and 10 blocks of 16 tokens) hold the three prompts at once but not the
    three requests' outputs."""
    target = budget_target(tiny_models, 12)
    verify = start_verify(target)
    drafter = TransformersDrafter.load(str(tiny_models.draft_dir), "float32", kv_cache_max_bytes=10 * BLOCK_BYTES)
    drafter.measure_step_ms()
    draft = build_draft(
        DraftSettings(port=0, drafters=["transformers"], default_drafter="transformers", max_sessions=8),
        drafters={"transformers": drafter},
    )
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address=f"127.0.0.1:{draft.port}",
            verify_addresses=[f"127.0.0.1:{verify.port}"],
            tokenizer=str(tiny_models.target_dir),
            draft_retry_s=0.5,
        )
    )
    yield f"127.0.0.1:{coordinator.port}", verify, draft
    coordinator.stop()
    draft.stop(0)
    verify.stop(0)


def test_preempted_sessions_are_rebuilt_and_outputs_stay_plain(
    small_budget_pipeline, plain_target_model, smollm2_tokenizer
):
    address, verify, draft = small_budget_pipeline
    completions: dict[int, object] = {}

    def run(i: int) -> None:
        request = coordinator_pb2.GenerateRequest(
            text=PROMPTS[i], max_new_tokens=MAX_NEW, num_speculative_tokens=K, drafter="transformers"
        )
        completions[i] = generate(address, request, timeout_s=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert sorted(completions) == list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        assert completions[i].token_ids == plain_greedy(
            plain_target_model, chat_ids(smollm2_tokenizer, prompt), MAX_NEW
        )
    assert sum(c.metrics.num_verify_rebuilds for c in completions.values()) >= 1
    for service, engine in ((verify, "verify"), (draft, "transformers")):
        registry = service.servicer.metrics.registry
        assert registry.get_sample_value("specdec_num_preemptions_total", {"engine": engine}) >= 1, engine
        total = registry.get_sample_value("specdec_kv_cache_blocks", {"engine": engine, "state": "total"})
        assert total == (12 if engine == "verify" else 10)


def test_a_prompt_no_budget_can_hold_fails_at_once_rather_than_queueing(small_budget_pipeline):
    """The verify service answers a context its whole budget can never hold FAILED_PRECONDITION:
    the coordinator's fair queue waits only for room that can come."""
    address, verify, _ = small_budget_pipeline
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        generate(address, coordinator_pb2.GenerateRequest(text="word " * 400, max_new_tokens=4), timeout_s=60)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "raise --kv-cache-max-bytes" in caught.value.details() and time.monotonic() - started < 10
    assert not len(verify.servicer.sessions)


LONG_NEW, SHORT_NEW = 200, 64


def test_one_keys_long_requests_do_not_make_another_keys_short_ones_re_prefill(
    tiny_models, plain_target_model, smollm2_tokenizer
):
    """KV pressure from key A: three clients sending long requests one after another, which
    together outgrow a budget of 32 blocks (each fits alone). Key B's short requests, admitted
    while A's run, are never preempted: A, holding the most KV, gives first (when the most
    recently admitted session gave first, a third of B's were rebuilt); every output equals plain
    decoding."""
    target = budget_target(tiny_models, 32)
    verify = start_verify(target)
    coordinator = CoordinatorThread(
        CoordinatorSettings(
            port=0,
            draft_address="127.0.0.1:1",  # no draft: plain decoding, the KV pressure alone
            verify_addresses=[f"127.0.0.1:{verify.port}"],
            tokenizer=str(tiny_models.target_dir),
            api_keys=["key-a", "key-b"],
            draft_retry_s=600,
        )
    )
    address = f"127.0.0.1:{coordinator.port}"
    long_prompts = [f"word {'word ' * 20}{i}" for i in range(3)]
    short_prompts = [f"Short story {i}." for i in range(6)]
    completions: dict[str, list] = {}
    b_done = threading.Event()

    def run(name: str, key: str, prompt: str, max_new: int) -> None:
        request = coordinator_pb2.GenerateRequest(
            text=prompt, max_new_tokens=max_new, ignore_eos=True, num_speculative_tokens=0
        )
        completions.setdefault(name, []).append(generate(address, request, timeout_s=180, api_key=key))

    def keep_sending(name: str, prompt: str) -> None:
        while not b_done.is_set():
            run(name, "key-a", prompt, LONG_NEW)

    try:
        longs = [threading.Thread(target=keep_sending, args=(f"a{i}", p)) for i, p in enumerate(long_prompts)]
        for thread in longs:
            thread.start()
        time.sleep(0.5)
        for i, prompt in enumerate(short_prompts):  # one after another while A's grow
            run(f"b{i}", "key-b", prompt, SHORT_NEW)
        b_done.set()
        for thread in longs:
            thread.join(180)
    finally:
        coordinator.stop()
        verify.stop(0)
    rebuilds = {name: [c.metrics.num_verify_rebuilds for c in done] for name, done in completions.items()}
    assert all(rebuilds[f"b{i}"] == [0] for i in range(len(short_prompts))), rebuilds  # B never held the most
    assert target.lm.kv_usage().num_preemptions >= 1
    for name, prompt, max_new in [
        *((f"a{i}", p, LONG_NEW) for i, p in enumerate(long_prompts)),
        *((f"b{i}", p, SHORT_NEW) for i, p in enumerate(short_prompts)),
    ]:
        expected = plain_greedy(plain_target_model, chat_ids(smollm2_tokenizer, prompt), max_new)
        assert all(c.token_ids == expected for c in completions[name]), name

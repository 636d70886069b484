"""Adaptive K: the choice from known costs and acceptance estimates, the fallback to plain decode
and its recovery, over real gRPC with a scripted drafter whose accuracy switches mid-request."""

import pytest
import torch

from coordinator.adaptive import AcceptanceModel, AdaptiveK, AdaptiveState, StepCosts, choose_k
from coordinator.client import generate
from coordinator.metrics import RoundRecord
from specdec.v1 import coordinator_pb2, draft_pb2, verify_pb2

FLAT = [60.0, 70.0, 75.0, 80.0, 85.0]  # verify ms for K = 0..4, like SmolLM2 on 2 CPU cores


def record(k: int, drafted: int, accepted: int) -> RoundRecord:
    return RoundRecord(k, drafted, accepted, draft_ms=1.0 * drafted, verify_ms=FLAT[drafted], wall_ms=FLAT[drafted] + drafted + 2.0, wire_bytes=0)


def test_expected_tokens_follow_the_per_position_rates():
    model = AcceptanceModel([0.9, 0.5, 0.2, 0.0])
    assert model.expected_tokens(0) == 1.0
    assert model.expected_tokens(3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert AcceptanceModel([0.5] * 4).expected_tokens(4) == pytest.approx((1 - 0.5**5) / 0.5)  # the brief's formula


def test_observe_updates_only_the_observed_positions():
    model = AcceptanceModel([0.5] * 4, weight=0.5)
    model.observe(drafted=4, accepted=1)  # position 1 passed, position 2 rejected, 3 and 4 unseen
    assert model.rates == [0.75, 0.25, 0.5, 0.5]
    model.observe(drafted=2, accepted=2)  # both passed, nothing rejected
    assert model.rates == [0.875, 0.625, 0.5, 0.5]


def test_choose_k_from_costs_and_acceptance():
    costs = StepCosts(draft_ms_per_token=15.0, verify_ms=list(FLAT), overhead_ms=[1.0, 3.0])
    assert choose_k(AcceptanceModel([0.0] * 4), costs, 4) == 0  # drafts never pass: plain decode
    assert choose_k(AcceptanceModel([0.95] * 4), costs, 4) == 4
    # 0.5 per position: K=0 gives 1 token in 61 ms, K=1 1.5 in 88 ms, K=2 1.75 in 108 ms
    assert choose_k(AcceptanceModel([0.5] * 4), costs, 4) == 1
    free = StepCosts(draft_ms_per_token=0.0, verify_ms=list(FLAT), overhead_ms=[1.0, 3.0])
    assert choose_k(AcceptanceModel([0.5] * 4), free, 4) == 3  # a free draft (n-gram) pays for more
    assert choose_k(AcceptanceModel([0.95] * 4), costs, 2) == 2  # never above K_max


def test_fallback_then_probe_then_recovery():
    policy = AdaptiveK(4, AcceptanceModel([0.8] * 4), StepCosts(15.0, list(FLAT), [1.0, 3.0]), probe_interval=4, probe_k=2)
    assert policy.next_k() == 3  # prior 0.8: K=3 gives 2.95 tokens in 128 ms, K=4 3.36 in 148
    for _ in range(6):  # the drafter turns wrong: every draft is rejected at the first position
        policy.observe(record(4, 4, 0))
    ks = [policy.next_k() for _ in range(8)]
    assert ks == [0, 0, 0, 2, 0, 0, 0, 2]  # fallback, with a 2-token probe every 4th round
    for _ in range(3):  # the probes pass: the text became predictable again
        policy.observe(record(2, 2, 2))
    assert policy.next_k() > 0


def test_costs_follow_live_rounds():
    costs = StepCosts(draft_ms_per_token=10.0, verify_ms=[50.0, 60.0], overhead_ms=[1.0, 2.0], weight=0.5)
    costs.observe(RoundRecord(1, 1, 1, draft_ms=20.0, verify_ms=80.0, wall_ms=106.0, wire_bytes=0))
    assert (costs.draft_ms_per_token, costs.verify_ms, costs.overhead_ms) == (15.0, [50.0, 70.0], [1.0, 4.0])


def test_sessions_warm_start_from_the_previous_ones():
    state = AdaptiveState(prior_rate=0.8)
    drafter = draft_pb2.DrafterInfo(name="llama-cpp", step_ms=7.0)
    target = verify_pb2.VerifyServiceGetInfoResponse(model="t", verify_ms=[50.0, 55.0, 60.0])
    first = state.policy(drafter, target, k_max=4)
    assert first.acceptance.rates == [0.8] * 4 and first.costs.verify_ms == [50.0, 55.0, 60.0, 60.0, 60.0]
    first.acceptance.rates = [0.0] * 4
    state.remember(first)
    second = state.policy(drafter, target, k_max=4)
    assert second.acceptance.rates == [0.4] * 4 and second.costs is first.costs


def plain_greedy(model, prompt_ids, max_new):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_switching_drafter_falls_back_and_recovers(tiny_pipeline, tiny_drafters, smollm2_tokenizer):
    """Drafts right for the first 20 tokens, wrong until 60, right again after: the request falls
    back to plain decode in the middle, speculates again at the end, and stays lossless."""
    prompt, max_new = "Tell me a story about a cat.", 200
    ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    expected = plain_greedy(tiny_pipeline.target.model, list(ids), max_new)
    tiny_drafters["switching"].script = [*ids, *expected]
    completion = generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(
        text=prompt, max_new_tokens=max_new, drafter="switching"), timeout_s=120)
    assert completion.token_ids == expected
    m = completion.metrics
    assert m.adaptive and m.rounds_per_k[0] > 0, "no fallback to plain decode while every draft was wrong"
    # at most 20 drafts can pass before the switch: many more passed, so speculation resumed
    assert m.num_accepted_draft_tokens > 60, f"no recovery: {m}"

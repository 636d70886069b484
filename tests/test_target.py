"""verify_service.target: a Prefill that also decodes the first token gives exactly the token a
Decode right after a plain Prefill gives (greedy and seeded sampling), in the forward of the
prompt's last chunk, in as many steps as the prompt's chunks of the step budget, and after a
prefix found in the prefix cache; loaded from a folder, its linear layers run on oneDNN
(:mod:`specdec.engine.cpu_linear`) unless told not to, with the same tokens."""

import pytest
import torch

from specdec.engine.cpu_linear import PackedLinear
from specdec.rpc.errors import InvalidArgument
from specdec.sampling.sampling_params import SamplingParams
from tests.conftest import StepRecorder
from verify_service.target import EngineLimits, Target


@pytest.fixture(scope="module")
def small_budget_target(tiny_target) -> Target:
    """The tiny target with a 16-token step budget, alone too, so that a 40-token prompt prefills in chunks;
    prefix caching off, so that each session computes its whole prompt."""
    limits = EngineLimits(4, 16, 0.0, max_num_batched_tokens_alone=16)
    target = Target(tiny_target.lm.model, tiny_target.tokenizer, "small-budget", 4, limits, None)
    yield target
    target.engine.stop()


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.5, seed=7)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("prompt_len", [1, 5, 32, 40])
def test_prefill_with_decode_gives_the_next_decode_token(small_budget_target, sampling, prompt_len):
    prompt = [(7 * i + 3) % 1000 for i in range(prompt_len)]
    plain = small_budget_target.new_session(prompt, sampling)
    _, expected = plain.verify([], None)
    plain.close()
    recorder, metrics = StepRecorder(), small_budget_target.engine.metrics
    small_budget_target.engine.metrics = recorder
    try:
        fused = small_budget_target.new_session(prompt, sampling, decode=True)
    finally:
        small_budget_target.engine.metrics = metrics
    assert fused.committed == [*prompt, expected]
    # every step is a chunk of the whole budget but the last, which decodes the token from its
    # last row: no forward of its own, and no step more than the prompt's chunks
    assert len(recorder.batch_sizes) == -(-prompt_len // 16)
    assert fused.verify([], None) == plain_next(small_budget_target, [*prompt, expected], sampling)
    fused.close()


def plain_next(target: Target, committed: list[int], sampling: SamplingParams) -> tuple[int, int]:
    """The Decode after a plain prefill of ``committed``."""
    session = target.new_session(committed, sampling)
    try:
        return session.verify([], None)
    finally:
        session.close()


def test_prefill_with_decode_after_a_cached_prefix(tiny_target):
    """The prefix cache holds the prompt but its last 5 tokens: the decode step feeds just those
    (one step, nothing recomputed) and gives the token a plain prefill and Decode give."""
    prompt = [(11 * i + 5) % 1000 + 2000 for i in range(3 * 16 + 5)]  # ids no other test's context starts with
    plain = tiny_target.new_session(prompt, SamplingParams())
    _, expected = plain.verify([], None)
    plain.close()
    recorder, metrics = StepRecorder(), tiny_target.engine.metrics
    tiny_target.engine.metrics = recorder
    try:
        fused = tiny_target.new_session(prompt, SamplingParams(), decode=True)
    finally:
        tiny_target.engine.metrics = metrics
    assert fused.kv_cache.num_cached_tokens == 3 * 16 and fused.committed == [*prompt, expected]
    assert len(recorder.batch_sizes) == 1
    fused.close()


@pytest.mark.parametrize("pack", [True, False])
def test_load_packs_the_linear_layers_on_a_cpu_unless_told_not_to(tiny_models, tiny_target, pack):
    target = Target.load(str(tiny_models.target_dir), "float32", None, 4, pack_linear_weights=pack)
    try:
        packed = [m for m in target.lm.model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (pack and torch.backends.mkldnn.is_available())
        prompt = [(7 * i + 3) % 1000 for i in range(12)]
        assert plain_next(target, prompt, SamplingParams()) == plain_next(tiny_target, prompt, SamplingParams())
    finally:
        target.engine.stop()


def test_a_verify_over_the_services_k_limit_names_its_setting(tiny_target):
    session = tiny_target.new_session([1, 2, 3], SamplingParams())
    limit = tiny_target.max_num_speculative_tokens
    with pytest.raises(InvalidArgument, match="--max-num-speculative-tokens, SPECDEC_VERIFY_MAX_NUM_SPECULATIVE"):
        session.verify([5] * (limit + 1), None)
    session.close()

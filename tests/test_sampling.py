"""Invariant 2: speculative sampling generates exactly the target's distribution.

On an 8-token vocabulary the exact distribution of the first two generated tokens is enumerated
from the target; many seeded pipeline runs (draft proposals + the verify service's acceptance
test, called in-process) must match it by a chi-square test at significance 0.001. The same
harness with a deliberately wrong acceptance rule (resampling from p instead of max(0, p - q) at a
rejection) must be rejected by the same test: the negative control shows the test has power.

The seeded runs go through CONCURRENT_SESSIONS threads at once, so their sessions share the
target's and the model draft's batched steps (invariant 5 under sampling; it also makes the runs
2.5x faster than one at a time).
"""

import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chisquare

import verify_service.target as target_module
from coordinator.adaptive import AcceptanceModel, AdaptiveK, StepCosts
from coordinator.metrics import RoundRecord
from draft_service.drafters.base import Proposal
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.transformers_lm import TransformersDrafter
from specdec.engine import EngineMetrics
from specdec.ngram import DRAFTER_NAME as NGRAM, NgramIndex
from specdec.sampling import logits_to_probs, sample
from specdec.sampling_params import SamplingParams
from tests.conftest import tiny_llama
from tests.test_concurrency import StepRecorder
from verify_service.target import Target

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 3000
CONCURRENT_SESSIONS = 16
ALPHA = 1e-3


class _Tokenizer:
    """Just enough of a tokenizer for Target / TransformersDrafter fingerprints."""

    def __len__(self):
        return VOCAB

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


@pytest.fixture(scope="module")
def small_vocab():
    target_model = tiny_llama(seed=10, vocab_size=VOCAB, init_std=0.15)
    draft_model = tiny_llama(seed=11, vocab_size=VOCAB, init_std=0.15)
    reference = copy.deepcopy(target_model)  # Target switches its copy to the ragged attention
    target = Target(target_model, _Tokenizer(), "small-target", max_num_speculative_tokens=8)
    target.reference = reference
    drafters = {
        "model": TransformersDrafter(draft_model, _Tokenizer(), "small-draft"),
        "ngram": NgramDrafter(1, 2),
    }
    return target, drafters


def exact_pair_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(first two generated tokens = (a, b)), ``[VOCAB * VOCAB]``, after the sampling transform."""
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        contexts = torch.tensor([[*PROMPT, a] for a in range(VOCAB)])
        second = logits_to_probs(model(contexts).logits[:, -1], params)
    return (first[:, None] * second).reshape(-1)


def adaptive_policy(ngram_max: int) -> AdaptiveK:
    """Adaptive K whose choice follows the last round closely (EMA weight 0.9): a rejection at the
    first position makes the next round a plain decode step, a full acceptance makes it K = 3. So
    the second token's round depends on the first round's random outcome. With ``ngram_max``, n-gram
    matches (free, so preferred while their estimate holds) compete with the model drafter."""
    rates = lambda: AcceptanceModel([0.8] * 3, weight=0.9)  # noqa: E731
    return AdaptiveK(3, "model", rates(), {NGRAM: [rates() for _ in range(ngram_max)]}, StepCosts(0.05, [1.0, 1.1, 1.2, 1.3]))


def pipeline_pair(target: Target, drafter, params: SamplingParams, k: int | str) -> int:
    """Runs rounds of K = ``k`` draft tokens (``"adaptive"``: drafter and K chosen by
    :func:`adaptive_policy`; ``"hybrid"``: also n-gram lookup) until two tokens are committed;
    returns them as one index a * VOCAB + b."""
    verify = target.new_session(PROMPT, params)
    draft = drafter.new_session(params)
    draft.prefill(PROMPT)
    policy = adaptive_policy(2 if k == "hybrid" else 0) if isinstance(k, str) else None
    index, context = NgramIndex(1, 2), list(PROMPT)
    generated: list[int] = []
    while len(generated) < 2:
        match = index.lookup(context, 3) if k == "hybrid" else None
        matches = {NGRAM: match} if match else {}
        source, round_k = policy.next_round(matches) if policy else ("model", k)
        if source == NGRAM:
            proposal = Proposal(match.tokens[:round_k])
        else:
            proposal = draft.propose(round_k) if round_k else Proposal([])
        probs = proposal.probs
        if probs is None:  # a point-mass drafter
            probs = torch.nn.functional.one_hot(torch.tensor(proposal.tokens, dtype=torch.long), VOCAB).float()
        n, token = verify.verify(proposal.tokens, probs)
        new = [*proposal.tokens[:n], token]
        if policy:
            policy.observe(RoundRecord(source, round_k, len(proposal.tokens), n, 0.0, 1.0, 1.0, 0), matches, new)
        generated.extend(new)
        context.extend(new)
        draft.sync(new)
    verify.close()
    draft.close()
    return generated[0] * VOCAB + generated[1]


def chi_square_p_value(target, drafter, params, k, samples: int = SAMPLES) -> float:
    """The p-value of ``samples`` seeded runs against the exact distribution; asserts that their
    sessions did share steps."""
    counts = torch.zeros(VOCAB * VOCAB)
    run = lambda seed: pipeline_pair(target, drafter, dataclasses.replace(params, seed=seed), k)  # noqa: E731
    recorder = StepRecorder()
    target.engine.metrics = recorder
    try:
        with ThreadPoolExecutor(CONCURRENT_SESSIONS) as pool:
            for pair in pool.map(run, range(samples)):
                counts[pair] += 1
    finally:
        target.engine.metrics = EngineMetrics()
    assert max(recorder.batch_sizes) > 1, "no step batched two sessions"
    expected = exact_pair_distribution(target.reference, params) * samples
    if counts[expected == 0].sum() > 0:  # a pair the target can never generate
        return 0.0
    large, small = expected >= 5, (expected > 0) & (expected < 5)
    observed, wanted = counts[large], expected[large]
    if small.any():  # chi-square needs >= 5 expected per cell: pool the small cells into one
        observed = torch.cat([observed, counts[small].sum(0, keepdim=True)])
        wanted = torch.cat([wanted, expected[small].sum(0, keepdim=True)])
    wanted *= observed.sum() / wanted.sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


CASES = [
    ("model", SamplingParams(temperature=1.0), 3),
    ("model", SamplingParams(temperature=0.8, top_k=5, top_p=0.9), 2),
    ("ngram", SamplingParams(temperature=1.0), 2),
    ("model", SamplingParams(temperature=1.0), "adaptive"),
    ("model", SamplingParams(temperature=1.0), "hybrid"),
]


@pytest.mark.parametrize("drafter,params,k", CASES)
def test_speculative_sampling_matches_target_distribution(small_vocab, drafter, params, k):
    target, drafters = small_vocab
    assert chi_square_p_value(target, drafters[drafter], params, k) > ALPHA


def wrong_rejection_sample(draft_tokens, draft_probs, target_probs, generator):
    """A plausible bug: at a rejection, resample from p instead of normalise(max(0, p - q))."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            continue
        return i, sample(p, generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)


def test_negative_control_wrong_rule_is_detected(small_vocab, monkeypatch):
    target, drafters = small_vocab
    monkeypatch.setattr(target_module, "rejection_sample", wrong_rejection_sample)
    # the wrong rule's bias is large: a sixth of the samples finds it (p about 6e-16 at 500)
    p_value = chi_square_p_value(target, drafters["model"], SamplingParams(temperature=1.0), 3, samples=SAMPLES // 6)
    print(f"wrong rule: chi-square p-value {p_value:.2e}")
    assert p_value < ALPHA


def test_same_seed_reproduces_a_sampled_completion(small_vocab):
    target, drafters = small_vocab
    params = SamplingParams(temperature=1.0, seed=1234)
    runs = {pipeline_pair(target, drafters["model"], params, 3) for _ in range(5)}
    assert len(runs) == 1

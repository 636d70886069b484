"""specdec.sampling.probs's filters, and invariant *lossless sampling* end to end: speculative sampling through the real
round code and services generates exactly the target's distribution.

The acceptance rule alone (known outcomes, and a model-free chi-square test) is tested in
tests/test_acceptance.py. Here, on an 8-token vocabulary, the exact distribution of the first three
generated tokens is enumerated from the target; many seeded requests run through the
coordinator's round code (:meth:`coordinator.speculation.rounds.RequestRounds.prefill`, which
draws the first token in the target's prefill, then
:meth:`~coordinator.speculation.rounds.RequestRounds.step`, one round at a time, under an adaptive
policy) against real draft and verify services over gRPC, and must match it by a chi-square test
at significance 0.001: the first token's distribution, and that of the next two (the rounds'),
marginalised over the first. The one case covers the rest of the path: temperature, top-k and
top-p applied on both sides; the model drafter's distributions and the coordinator's n-gram lookup
(a point mass) on the wire; K = 3 in the first round and K chosen from the first round's random
outcome in the second. The same harness with a deliberately wrong acceptance rule (resampling from
p instead of max(0, p - q) at a rejection) must fail the same test: the negative control shows the
test has power.

The requests run CONCURRENT_SESSIONS at a time, so their sessions share the target's and the
model draft's batched steps (invariant *batch independence* under sampling).

With a grammar (a regex over the 8 tokens, which the byte-level tokenizer spells as letters) the
same harness must give the exact distribution of the masked target (invariant *lossless under
constraints*): the model draft drafts under the mask, the lookup's proposals are cut after their
first rejected token, and its negative control fails the same way. A draft drawn from an unmasked
q (grammar-aware drafting off) is tested on the verify service's session alone: the token the
grammar rejects is kept and rejected by the rule, and cutting before it (a plain step from p)
fails the same test.
"""

import asyncio
import copy
import dataclasses

import pytest
import torch

import verify_service.target as target_module
from coordinator.observability.metrics import PLAIN
from coordinator.speculation.draft_client import DraftClient
from coordinator.speculation.plan import ResolvedRequest
from coordinator.speculation.policy.acceptance_model import AcceptanceModel
from coordinator.speculation.policy.adaptive import AdaptiveK
from coordinator.speculation.policy.fixed import FixedK
from coordinator.speculation.policy.step_costs import StepCosts
from coordinator.speculation.rounds import RequestRounds
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from draft_service.drafters.transformers_lm import TransformersDrafter
from draft_service.service import build as build_draft
from draft_service.settings import DraftSettings
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramIndex
from specdec.rpc.errors import InvalidArgument
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.probs import argmax, best_other, logits_to_probs
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import GrammarLimits, StructuredOutput, grammar_tokenizer
from tests.conftest import (
    StepRecorder,
    chi_square_p_value,
    tiny_llama,
    wrong_rejection_sample,
)
from verify_service.service import build as build_verify
from verify_service.settings import VerifySettings
from verify_service.target import Target

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
K_MAX = 3
PARAMS = SamplingParams(temperature=1.2, top_k=6, top_p=0.95)  # top-k and top-p each remove tokens
SAMPLES = 1000
CONCURRENT_SESSIONS = 32
ALPHA = 1e-3
LIMITS = GrammarLimits()


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [
        True,
        True,
        False,
        False,
        False,
    ]
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [True, True, True, False, False]  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.8))
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_argmax_is_torchs_first_largest_index_of_every_row(dtype):
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(-3, 4, (n, 49_152), generator=generator).to(dtype) for n in (1, 5, 2)]  # many ties
    rows.append(torch.randn(7, generator=generator).to(dtype))  # one [V] row
    rows.append(torch.randn(9, 3, generator=generator).to(dtype).t())  # [3, 9], not contiguous
    expected = [token for x in rows for token in x.argmax(dim=-1).reshape(-1).tolist()]
    assert argmax(rows) == expected
    assert argmax(rows[:3]) == expected[:8]  # the contiguous ones, read by numpy where it can


def test_best_other_is_the_runner_up_around_the_excluded_index():
    values = torch.tensor([1.0, 5.0, 3.0, 5.0, 0.0])
    assert [best_other(values, i) for i in range(5)] == [1, 3, 1, 1, 1]  # the first of equals
    assert best_other(torch.tensor([2.0, 1.0]), 0) == 1 and best_other(torch.tensor([2.0, 1.0]), 1) == 0
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(49_152, generator=generator)
    top = scores.topk(2).indices.tolist()
    assert best_other(scores, top[0]) == top[1] and best_other(scores, top[1]) == top[0]


def letters_tokenizer():
    """A byte-level tokenizer of 8 tokens, ``a b </s> c d e f g`` (``</s>``, id 2, the models' EOS),
    so that a grammar can name the tokens as letters."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(BPE({"a": 0, "b": 1, "</s>": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


# the first token a, b or c (ids 0, 1, 3), the second and third d, e or f (4, 5, 6), then g or the end
GRAMMAR = StructuredOutput("regex", "[abc][def][def]g?")
GRAMMAR_SAMPLES = 500  # 9 outcomes of the second and third token: fewer samples than for the 64 above
GRAMMAR_PARAMS = dataclasses.replace(
    PARAMS, top_k=0, eos_token_ids=(2,), num_prompt_tokens=len(PROMPT), structured_output=GRAMMAR
)


@dataclasses.dataclass
class SmallVocab:
    target: Target
    reference: torch.nn.Module  # the target with transformers' own attention
    draft_address: str
    verify_address: str


@pytest.fixture(scope="module")
def small_vocab():
    """Draft and verify services on free ports serving two random 8-token-vocabulary models."""
    target_model = tiny_llama(seed=10, vocab_size=VOCAB, init_std=0.15)
    draft_model = tiny_llama(seed=11, vocab_size=VOCAB, init_std=0.15)
    reference = copy.deepcopy(target_model)  # Target switches its copy to the ragged attention
    target = Target(target_model, letters_tokenizer(), "small-target", max_num_speculative_tokens=8)
    sessions = 2 * CONCURRENT_SESSIONS
    verify = build_verify(VerifySettings(port=0, max_sessions=sessions), target=target)
    draft = build_draft(
        DraftSettings(port=0, drafters=["model"], default_drafter="model", max_sessions=sessions),
        drafters={"model": TransformersDrafter(draft_model, letters_tokenizer(), "small-draft")},
    )
    yield SmallVocab(target, reference, f"127.0.0.1:{draft.port}", f"127.0.0.1:{verify.port}")
    draft.stop(0)
    verify.stop(0)


def _allowed(params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """``[VOCAB]`` bool: the tokens ``params``' grammar allows after ``generated`` (all of them
    without a grammar, or after tokens it rejects: such a prefix has probability 0)."""
    if params.structured_output is None:
        return torch.ones(VOCAB, dtype=torch.bool)
    vocab = grammar_tokenizer(letters_tokenizer(), VOCAB, list(params.eos_token_ids))
    try:
        return torch.from_numpy(GrammarMatcher.from_log(params.structured_output, vocab, LIMITS, generated).allowed())
    except InvalidArgument:
        return torch.ones(VOCAB, dtype=torch.bool)


def _next_probs(model, params: SamplingParams, generated: list[list[int]]) -> torch.Tensor:
    """``[len(generated), VOCAB]``: the distribution of the token after each generated prefix, after
    the grammar's mask (if any) and the sampling transform."""
    with torch.inference_mode():
        logits = model(torch.tensor([[*PROMPT, *g] for g in generated])).logits[:, -1]
    masks = torch.stack([_allowed(params, g) for g in generated])
    return logits_to_probs(logits.masked_fill(~masks, float("-inf")), params)


def exact_distributions(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(first generated token = a), ``[VOCAB]``, and P(second and third = (b, c)), ``[VOCAB * VOCAB]``
    (marginalised over the first), of the target after the sampling transform and ``params``'
    grammar, if any."""
    first = _next_probs(model, params, [[]])[0]
    second = _next_probs(model, params, [[a] for a in range(VOCAB)])  # [a, b]
    third = _next_probs(model, params, [[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None, None] * second[:, :, None] * third
    return first, joint.sum(0).reshape(-1)


def adaptive_policy() -> AdaptiveK:
    """Adaptive K whose choice follows the last round closely (EMA weight 0.9): a rejection at the
    first position makes the next round a plain decode step, a full acceptance makes it K = 3. So
    the second token's round depends on the first round's random outcome. N-gram matches (free,
    so preferred while their estimate holds) compete with the model drafter."""

    def rates() -> AcceptanceModel:
        return AcceptanceModel([0.8] * K_MAX, weight=0.9)

    return AdaptiveK(K_MAX, "model", rates(), {NGRAM: [rates(), rates()]}, StepCosts(0.05, [1.0, 1.1, 1.2, 1.3]))


async def pipeline_tokens(
    clients: ServiceClients, params: SamplingParams, session_prefix: str
) -> tuple[list[int], list[tuple[str, int]]]:
    """One request's prefill and rounds, as the coordinator runs them, until three tokens are
    committed; returns them, and each round's (drafter, K)."""
    request = ResolvedRequest(PROMPT, 3, params, [], K_MAX, "model", adaptive=True)
    request_rounds = RequestRounds(
        DraftClient(clients), VerifyClient(clients), session_prefix, request, list(PROMPT), {NGRAM: NgramIndex(1, 2)}
    )
    policy, rounds = adaptive_policy(), []
    try:
        # a fixed K at the prefill: the adaptive policy would start from the load the prefill met
        # (32 sessions at once), with which these synthetic costs make every first round a plain
        # one, and the model drafter's K = 3 rounds, which follow a full acceptance, would hardly
        # ever run
        await request_rounds.prefill(FixedK(request.drafter, K_MAX))
        while len(request_rounds.committed) < len(PROMPT) + 3:
            _, _, record = await request_rounds.step(policy, K_MAX)
            rounds.append((record.drafter, record.k))
    finally:
        await request_rounds.release()
    return request_rounds.committed[len(PROMPT) : len(PROMPT) + 3], rounds


def pipeline_runs(services: SmallVocab, params: SamplingParams, seeds) -> list[tuple[list[int], list[tuple[str, int]]]]:
    """:func:`pipeline_tokens` for every seed, CONCURRENT_SESSIONS requests at a time."""

    async def run_all():
        clients = ServiceClients([services.draft_address], [services.verify_address], 60, 60)
        limit = asyncio.Semaphore(CONCURRENT_SESSIONS)

        async def one(i: int, seed: int):
            async with limit:
                return await pipeline_tokens(clients, dataclasses.replace(params, seed=seed), f"run-{i}")

        try:
            return await asyncio.gather(*(one(i, seed) for i, seed in enumerate(seeds)))
        finally:
            await clients.close()

    return asyncio.run(run_all())


def pipeline_p_value(services: SmallVocab, params: SamplingParams, samples: int) -> float:
    """The chi-square p-value of ``samples`` seeded requests against the exact distributions (of
    the masked target, with a grammar): the smaller of the first token's and the next two's;
    asserts that their sessions did share steps and that every kind of round ran: the model
    drafter's at K = 3, the n-gram lookup's, and plain decode steps (without a grammar: with one,
    the masked draft rarely misses at the first position, the adaptive policy's cue for a plain
    step, in the fewer samples its test takes)."""
    recorder, metrics = StepRecorder(), services.target.engine.metrics
    services.target.engine.metrics = recorder
    try:
        runs = pipeline_runs(services, params, range(samples))
    finally:
        services.target.engine.metrics = metrics
    assert max(recorder.batch_sizes) > 1, "no step batched two sessions"
    rounds = {r for _, rs in runs for r in rs}
    assert ("model", K_MAX) in rounds and NGRAM in {drafter for drafter, _ in rounds}, rounds
    assert params.structured_output is not None or (PLAIN, 0) in rounds, rounds
    first, pair = exact_distributions(services.reference, params)
    first_counts = torch.bincount(torch.tensor([tokens[0] for tokens, _ in runs]), minlength=VOCAB).float()
    pairs = torch.tensor([tokens[1] * VOCAB + tokens[2] for tokens, _ in runs])
    pair_counts = torch.bincount(pairs, minlength=VOCAB * VOCAB).float()
    return min(chi_square_p_value(first_counts, first), chi_square_p_value(pair_counts, pair))


def test_speculative_sampling_matches_target_distribution(small_vocab):
    assert pipeline_p_value(small_vocab, PARAMS, SAMPLES) > ALPHA


def test_negative_control_wrong_rule_is_detected(small_vocab, monkeypatch):
    monkeypatch.setattr(target_module, "rejection_sample", wrong_rejection_sample)
    # the wrong rule's bias is large: half the samples find it
    p_value = pipeline_p_value(small_vocab, PARAMS, SAMPLES // 2)
    print(f"wrong rule: chi-square p-value {p_value:.2e}")
    assert p_value < ALPHA


def test_speculative_sampling_under_a_grammar_matches_the_masked_target(small_vocab):
    assert pipeline_p_value(small_vocab, GRAMMAR_PARAMS, GRAMMAR_SAMPLES) > ALPHA


def test_negative_control_under_a_grammar_is_detected(small_vocab, monkeypatch):
    monkeypatch.setattr(target_module, "rejection_sample", wrong_rejection_sample)
    p_value = pipeline_p_value(small_vocab, GRAMMAR_PARAMS, GRAMMAR_SAMPLES)
    print(f"wrong rule under a grammar: chi-square p-value {p_value:.2e}")
    assert p_value < ALPHA


def verified_first_tokens(target: Target, q: torch.Tensor, samples: int) -> torch.Tensor:
    """Counts of the first generated token over ``samples`` seeded verifies of one draft token drawn
    from ``q`` (``[VOCAB]``, not masked by the grammar: a draft without grammar-aware drafting)."""
    draws = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for seed in range(samples):
        draft = int(torch.multinomial(q, 1, generator=draws))
        session = target.new_session(PROMPT, dataclasses.replace(GRAMMAR_PARAMS, seed=seed))
        try:
            n, token = session.verify([draft], q[None])
        finally:
            session.close()
        counts[draft if n else token] += 1
    return counts


# b (id 1) 3/4, and 1/4 on d, e, f and g (ids 4-7), which the grammar rejects at the first position
UNMASKED_Q = torch.tensor([0.0, 0.75, 0.0, 0.0, 0.0625, 0.0625, 0.0625, 0.0625])
UNMASKED_SAMPLES = 300


def test_a_draft_token_off_the_grammar_is_rejected_by_the_rule_not_cut(small_vocab):
    """A draft drawn from an unmasked q (grammar-aware drafting off): the verify service keeps the
    first token the grammar rejects, so the rule rejects it (p = 0 there) and recovers from
    max(0, p - q); the first token then follows the masked target's distribution."""
    counts = verified_first_tokens(small_vocab.target, UNMASKED_Q, UNMASKED_SAMPLES)
    exact = exact_distributions(small_vocab.reference, GRAMMAR_PARAMS)[0]
    assert chi_square_p_value(counts, exact) > ALPHA


def test_negative_control_a_cut_before_the_rejected_token_is_detected(small_vocab, monkeypatch):
    """Cutting the proposal before that token (a plain decode step from p when it is the first)
    biases the output toward p wherever q put mass off the grammar: the same test finds it."""
    valid_prefix = GrammarMatcher.valid_prefix

    def one_less_when_rejected(self, tokens):  # the verify service keeps valid_prefix + 1 tokens
        valid = valid_prefix(self, tokens)
        return valid - (valid < len(tokens))

    monkeypatch.setattr(GrammarMatcher, "valid_prefix", one_less_when_rejected)
    counts = verified_first_tokens(small_vocab.target, UNMASKED_Q, UNMASKED_SAMPLES)
    exact = exact_distributions(small_vocab.reference, GRAMMAR_PARAMS)[0]
    p_value = chi_square_p_value(counts, exact)
    print(f"cut before the rejected token: chi-square p-value {p_value:.2e}")
    assert p_value < ALPHA


def test_same_seed_reproduces_a_sampled_completion(small_vocab):
    assert len({tuple(tokens) for tokens, _ in pipeline_runs(small_vocab, PARAMS, [1234] * 5)}) == 1

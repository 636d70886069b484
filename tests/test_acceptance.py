"""specdec.sampling.acceptance alone, without models or services (as vLLM's
tests/v1/sample/test_rejection_sampler.py does): hand-built logits and probabilities whose outcome
is known (perfect match and bonus token, early mismatch and recovered token, empty proposal, p
equal to q, greedy), and a chi-square test over many seeded draws that the tokens rejection
sampling emits are distributed as the target's, with its negative control (a wrong rule fails the
same test).

Terms as in the module: of K draft tokens, n are accepted; the next token is the recovered token
(drawn from normalise(max(0, p - q)) at the first rejection) or, when all K pass, the bonus token
(drawn from p after the last draft).
"""

import pytest
import torch

from specdec.sampling.acceptance import greedy_accept, rejection_sample
from specdec.sampling.probs import sample
from tests.conftest import chi_square_p_value, wrong_rejection_sample

V = 6
SEEDS = range(200)


def rows(*probs: dict[int, float]) -> torch.Tensor:
    """``[len(probs), V]`` float32 rows, each given as {token: probability}."""
    out = torch.zeros(len(probs), V)
    for i, row in enumerate(probs):
        for token, p in row.items():
            out[i, token] = p
    return out


def logits_preferring(*tokens: int) -> torch.Tensor:
    """``[len(tokens), V]`` logits whose row i has its argmax at ``tokens[i]``."""
    logits = torch.randn(len(tokens), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(tokens)), list(tokens)] = 10.0
    return logits


def one_sequence(rule):
    """A batched rule (:func:`rejection_sample`'s arguments) as a rule for one sequence:
    ``(drafts, q, p, generator) -> (n, next_token)``."""
    return lambda drafts, q, p, generator: rule([drafts], [q], [p], [generator])[0]


sample_one, wrong_one = one_sequence(rejection_sample), one_sequence(wrong_rejection_sample)


def outcomes(drafts, q, p) -> set[tuple[int, int]]:
    """The ``(n, next_token)`` results of rejection sampling over every seed in SEEDS."""
    return {sample_one(drafts, q, p, torch.Generator().manual_seed(seed)) for seed in SEEDS}


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_perfect_match_takes_the_bonus_token():
    assert greedy_accept([[1, 2, 3]], [logits_preferring(1, 2, 3, 5)]) == [(3, 5)]


def test_greedy_early_mismatch_returns_the_targets_token():
    assert greedy_accept([[1, 2, 3]], [logits_preferring(1, 4, 3, 5)]) == [(1, 4)]
    assert greedy_accept([[1, 2, 3]], [logits_preferring(0, 2, 3, 5)]) == [(0, 0)]  # a later match does not count


def test_greedy_empty_proposal_is_a_plain_decode_step():
    assert greedy_accept([[]], [logits_preferring(4)]) == [(0, 4)]


# --- rejection sampling: known outcomes ---------------------------------------------------------


def test_perfect_match_accepts_every_draft_and_adds_the_bonus_token():
    """p(x) >= q(x) for every draft token x: each is accepted with probability min(1, p/q) = 1,
    and the bonus token is drawn from p's last row (a point mass on 5 here)."""
    drafts = [1, 2, 3]
    q = rows({1: 0.5, 0: 0.5}, {2: 1.0}, {3: 0.4, 4: 0.6})
    p = rows({1: 0.7, 0: 0.3}, {2: 1.0}, {3: 0.9, 4: 0.1}, {5: 1.0})
    assert outcomes(drafts, q, p) == {(3, 5)}


def test_early_mismatch_recovers_from_the_residual_not_from_p():
    """Draft 1 passes (p >= q), draft 2 has p = 0 and is always rejected; the recovered token is
    drawn from max(0, p - q) = {3: 0.5}, never token 4, which p and q give equally (a rule that
    resampled from p would give 4 half the time)."""
    drafts = [1, 2, 3]
    q = rows({1: 1.0}, {2: 0.5, 4: 0.5}, {3: 1.0})
    p = rows({1: 1.0}, {3: 0.5, 4: 0.5}, {3: 1.0}, {5: 1.0})
    assert outcomes(drafts, q, p) == {(1, 3)}
    assert {token for _, token in outcomes(drafts, q, p)} == {3}
    assert {wrong_one(drafts, q, p, torch.Generator().manual_seed(s))[1] for s in SEEDS} == {3, 4}


def test_mismatch_at_the_first_draft_commits_only_the_recovered_token():
    drafts = [2, 3]
    q = rows({2: 1.0}, {3: 1.0})
    p = rows({0: 0.25, 1: 0.75}, {3: 1.0}, {5: 1.0})
    assert outcomes(drafts, q, p) == {(0, 0), (0, 1)}


def test_empty_proposal_samples_from_p():
    """K = 0 (a plain decode step): no draft, the next token is drawn from p's only row."""
    assert outcomes([], torch.zeros(0, V), rows({2: 1.0})) == {(0, 2)}
    drawn = [
        sample_one([], torch.zeros(0, V), rows({2: 0.5, 4: 0.5}), torch.Generator().manual_seed(s))[1] for s in SEEDS
    ]
    assert set(drawn) == {2, 4} and 70 < drawn.count(2) < 130  # p = 1/2 each over 200 draws


def test_p_equal_to_q_accepts_every_draft():
    generator = torch.Generator().manual_seed(1)
    q = torch.rand(4, V, generator=generator)
    q /= q.sum(-1, keepdim=True)
    p = torch.cat([q, rows({0: 0.5, 5: 0.5})])
    for seed in SEEDS:
        drafts = [sample(row, generator) for row in q]
        n, bonus = sample_one(drafts, q, p, torch.Generator().manual_seed(seed))
        assert n == 4 and bonus in (0, 5)


def test_p_nowhere_above_q_recovers_from_p():
    """p <= q everywhere (p == q up to float rounding; the gap exaggerated here so that drafts are
    rejected at all): the residual max(0, p - q) is empty, so the recovered token is drawn from p
    rather than from 0 / 0."""
    q = rows({1: 0.5, 2: 0.5})
    p = rows({1: 0.25, 2: 0.25}, {5: 1.0})
    assert outcomes([1], q, p) == {(1, 5), (0, 1), (0, 2)}


def test_same_seed_same_outcome():
    generator = torch.Generator().manual_seed(2)
    q = torch.rand(3, V, generator=generator).softmax(-1)
    p = torch.rand(4, V, generator=generator).softmax(-1)
    drafts = [0, 3, 1]
    runs = [[sample_one(drafts, q, p, torch.Generator().manual_seed(seed)) for seed in SEEDS] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 3  # and the seed does matter


# --- rejection sampling: the output distribution ---------------------------------------------

START = 0
DRAWS = 6000
ALPHA = 1e-3


def markov_chains() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q as first-order Markov chains over V tokens (row a: the distribution
    after token a), with zeros so that both supports differ: p never goes from a to a + 1, q never
    from a to a + 2 (mod V)."""
    generator = torch.Generator().manual_seed(3)
    p = torch.rand(V, V, generator=generator) ** 2
    q = torch.rand(V, V, generator=generator) ** 2
    tokens = torch.arange(V)
    p[tokens, (tokens + 1) % V] = 0
    q[tokens, (tokens + 2) % V] = 0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def first_two_tokens(rule, p, q, k: int, generator: torch.Generator) -> int:
    """Rounds of k drafts from the chain q after START, each checked by ``rule`` against the
    chain p's rows after the same tokens, until two tokens are emitted; returns them as one index
    a * V + b."""
    emitted, last = [], START
    while len(emitted) < 2:
        drafts = []
        for _ in range(k):
            drafts.append(sample(q[drafts[-1] if drafts else last], generator))
        contexts = [last, *drafts]
        n, token = rule(drafts, q[contexts[:-1]], p[contexts], generator)
        emitted += [*drafts[:n], token]
        last = emitted[-1]
    return emitted[0] * V + emitted[1]


def pair_p_value(rule, k: int, draws: int) -> float:
    p, q = markov_chains()
    generator = torch.Generator().manual_seed(k)
    counts = torch.zeros(V * V)
    for _ in range(draws):
        counts[first_two_tokens(rule, p, q, k, generator)] += 1
    exact = (p[START][:, None] * p).reshape(-1)  # P(a, b) = p(a | START) p(b | a)
    return chi_square_p_value(counts, exact)


@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_are_distributed_as_the_target(k):
    """K = 1: pairs of (accepted, bonus), (recovered, next round's token); K = 3: rejections at
    every position too. Two tokens catch a rule that is right for the first token only."""
    assert pair_p_value(sample_one, k, DRAWS) > ALPHA


def test_negative_control_wrong_rule_is_detected():
    """Resampling from p at a rejection (instead of max(0, p - q)) over-weights tokens the draft
    over-proposes: the same test rejects it with a sixth of the draws."""
    p_value = pair_p_value(wrong_one, 3, DRAWS // 6)
    print(f"wrong rule: chi-square p-value {p_value:.2e}")
    assert p_value < ALPHA


# --- the step's batch against the per-sequence rule ---------------------------------------------


def reference_rejection_sample(drafts, q, p, generator) -> tuple[int, int]:
    """The rule one sequence and one token at a time, as specdec ran it before acceptance was
    batched: one uniform per examined draft token, then the recovered or bonus token."""
    for i, token in enumerate(drafts):
        if float(torch.rand((), generator=generator)) * float(q[i, token]) < float(p[i, token]):
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        return i, sample(residual / residual.sum(), generator)
    return len(drafts), sample(p[len(drafts)], generator)


def ragged_step(seed: int) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """1 to 6 sequences of 0 to 5 drafts each, drawn from q; p close to q in half of the
    sequences (long accepted runs) and unrelated in the others (early rejections)."""
    generator = torch.Generator().manual_seed(seed)
    drafts, qs, ps = [], [], []
    for b in range(int(torch.randint(1, 7, (), generator=generator))):
        k = int(torch.randint(0, 6, (), generator=generator))
        q = (torch.rand(k, V, generator=generator) ** 3).softmax(-1)
        p = (torch.rand(k + 1, V, generator=generator) ** 3).softmax(-1)
        if b % 2:
            p[:k] = (q + 0.05 * torch.rand(k, V, generator=generator)) / 1.15
            p[:k] /= p[:k].sum(-1, keepdim=True)
        drafts.append([sample(row, generator) for row in q])
        qs.append(q)
        ps.append(p)
    return drafts, qs, ps


def test_a_batch_draws_exactly_what_each_sequence_draws_alone():
    """Over many ragged steps: each sequence's (n, next token) equals the per-sequence rule's with
    the same seed, and its generator is left in the same state (the draws are the same ones)."""
    outcomes_seen = set()
    for step in range(300):
        drafts, qs, ps = ragged_step(step)
        seeds = [step * 10 + b for b in range(len(drafts))]
        alone = [torch.Generator().manual_seed(s) for s in seeds]
        expected = [reference_rejection_sample(*args) for args in zip(drafts, qs, ps, alone, strict=True)]
        batched = [torch.Generator().manual_seed(s) for s in seeds]
        assert rejection_sample(drafts, qs, ps, batched) == expected
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(alone, batched, strict=True))
        outcomes_seen |= {(n == len(d), n == 0) for (n, _), d in zip(expected, drafts, strict=True)}
    assert outcomes_seen >= {(True, False), (False, True), (False, False)}  # all accepted, first and later rejection


def test_greedy_batch_equals_each_sequence_alone():
    """Ragged greedy steps with planted matches (a draft agrees with the argmax for a random
    prefix, then differs): the batch's outcomes equal the one-sequence rule's."""
    generator = torch.Generator().manual_seed(4)
    accepted = set()
    for _ in range(100):
        drafts, logits = [], []
        for _ in range(int(torch.randint(1, 7, (), generator=generator))):
            scores = torch.randn(int(torch.randint(1, 6, (), generator=generator)), V, generator=generator)
            argmax = scores.argmax(-1).tolist()
            agree = int(torch.randint(0, len(argmax), (), generator=generator))
            drafts.append([*argmax[:agree], *[(t + 1) % V for t in argmax[agree : len(argmax) - 1]]])
            logits.append(scores)
        expected = [greedy_accept([d], [scores])[0] for d, scores in zip(drafts, logits, strict=True)]
        for d, scores, (n, token) in zip(drafts, logits, expected, strict=True):
            argmax = scores.argmax(-1).tolist()
            assert n == next((i for i, t in enumerate(d) if t != argmax[i]), len(d)) and token == argmax[n]
            accepted.add(n == len(d))
        assert greedy_accept(drafts, logits) == expected
    assert accepted == {True, False}

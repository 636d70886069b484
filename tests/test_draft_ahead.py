"""Draft-ahead: the draft service drafts the next round while the verify service checks this one,
for the most likely outcomes of that verification (branches).

A proposal drafted ahead, on any branch, must be the one a plain Propose after the same committed
tokens gives (greedy and seeded sampling alike), so the pipeline's output does not depend on
whether a round's proposal was drafted ahead, on which branch, hit or missed; and so must one the
draft service drafted proactively, before the Propose asked for it."""

import asyncio
import contextlib
import types

import pytest
import torch

from coordinator.api.client import generate
from coordinator.observability.metrics import BONUS, HIT, MAIN, MISS, RECOVERED
from coordinator.speculation.draft_client import DraftClient
from coordinator.speculation.plan import DraftPlan, ResolvedRequest
from coordinator.speculation.policy.fixed import FixedK
from coordinator.speculation.rounds import RequestRounds
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from draft_service.drafters import model_drafting
from draft_service.drafters.contract import Proposal
from draft_service.drafters.model_drafting import Alternative, likely_outcomes
from specdec.rpc.errors import FailedPrecondition
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import StructuredOutput
from specdec.v1 import coordinator_pb2

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 12, 300, 45, 9]
MAX_NEW = 40


@contextlib.contextmanager
def _two_sessions(drafter, sampling: SamplingParams):
    """Two sessions of ``drafter`` prefilled with PROMPT, closed after."""
    first, second = drafter.new_session(sampling), drafter.new_session(sampling)
    try:
        first.prefill(PROMPT)
        second.prefill(PROMPT)
        yield first, second
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)])
def test_proposal_drafted_ahead_is_the_plain_proposal(tiny_drafters, sampling):
    """propose_ahead(predicted, K) = the bonus guess (the draft's argmax after predicted) and the
    K tokens (and, under sampling, the draft distributions) that propose(K) gives once predicted
    and that bonus are committed."""
    drafter = tiny_drafters["transformers"]
    with _two_sessions(drafter, sampling) as (ahead, plain):
        predicted = ahead.propose(4).tokens
        branch = ahead.propose_ahead(predicted, 5)
        plain.sync(predicted)
        greedy_bonus = drafter.new_session(SamplingParams())
        greedy_bonus.prefill([*PROMPT, *predicted])
        assert branch.bonus_token_id == greedy_bonus.propose(1).tokens[0]
        greedy_bonus.close()
        plain.sync([branch.bonus_token_id])
        expected = plain.propose(5)
        assert branch.tokens == expected.tokens and len(branch.tokens) == 5
        if not sampling.greedy:
            torch.testing.assert_close(branch.probs, expected.probs, rtol=1e-4, atol=1e-6)
        # a miss: the next proposal, after what verification really committed, rolls the draft back
        committed = [*predicted[:2], (predicted[2] + 1) % 500]
        ahead.sync(committed)
        fresh = drafter.new_session(sampling)
        fresh.prefill([*PROMPT, *committed])
        assert ahead.propose(3).tokens == fresh.propose(3).tokens
        fresh.close()


def _same_proposal(ours, theirs, sampling: SamplingParams) -> None:
    assert ours.proactive and not theirs.proactive
    assert ours.tokens == theirs.tokens and ours.bonus_token_id == theirs.bonus_token_id
    if not sampling.greedy:
        torch.testing.assert_close(ours.probs, theirs.probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)])
def test_proposal_drafted_proactively_is_the_draft_ahead_asked_for(tiny_drafters, sampling):
    """draft_next drafts the draft-ahead expected next; that Propose gets it (marked proactive),
    equal to what a session without proactive drafting proposes for the same call, also cut to a
    smaller K and chained round after round; a Propose after another outcome cancels it and gets
    the plain proposal after what was really committed (the KV rolled back)."""
    drafter = tiny_drafters["transformers"]
    with _two_sessions(drafter, sampling) as (proactive, reference):
        first = reference.propose(4)
        assert proactive.draft_next(4, [], proactive.propose(4))
        second = proactive.propose_ahead(first.tokens, 4)  # after a plain Propose: the draft-ahead of its tokens
        _same_proposal(second, reference.propose_ahead(first.tokens, 4), sampling)
        assert proactive.draft_next(4, first.tokens, second)
        outcome = [*first.tokens, second.bonus_token_id]
        proactive.sync(outcome)
        reference.sync(outcome)
        third = proactive.propose_ahead(second.tokens, 3)  # its own continuation; K 4 -> 3: cut
        _same_proposal(third, reference.propose_ahead(second.tokens, 3), sampling)
        assert proactive.draft_next(3, second.tokens, third)
        rejected = [*second.tokens[:1], (second.tokens[1] + 1) % 500]  # verification went elsewhere
        proactive.sync(rejected)
        missed = proactive.propose(3)
        assert not missed.proactive
        fresh = drafter.new_session(sampling)
        fresh.prefill([*PROMPT, *outcome, *rejected])
        assert missed.tokens == fresh.propose(3).tokens
        fresh.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)])
def test_proposal_drafted_proactively_serves_a_plain_propose_after_its_bonus_guess(tiny_drafters, sampling):
    """A coordinator that does not draft ahead asks for a plain proposal once verification has
    committed the drafted tokens and a bonus token: when that is the token the proactive draft
    guessed, the proposal drafted after it is the plain one (without a bonus guess of its own);
    after another bonus token, the Propose gets a proposal of its own."""
    drafter = tiny_drafters["transformers"]
    with _two_sessions(drafter, sampling) as (proactive, reference):
        drafted = reference.propose(4).tokens
        assert proactive.draft_next(4, [], proactive.propose(4))
        guess = reference.propose_ahead(drafted, 4).bonus_token_id
        proactive.sync([*drafted, guess])
        reference.sync([*drafted, guess])
        served = proactive.propose(4)
        _same_proposal(served, reference.propose(4), sampling)
        assert served.bonus_token_id is None
        assert proactive.draft_next(4, [], served)
        other = (guess + 1) % 500
        proactive.sync([*served.tokens, other])
        reference.sync([*served.tokens, other])
        own = proactive.propose(4)
        assert not own.proactive and own.tokens == reference.propose(4).tokens


def test_no_proactive_draft_where_its_state_is_shared_or_short(tiny_drafters):
    """None after a short proposal, a draft-ahead without a bonus guess, past the window, or under
    a grammar; a session closed while one runs stops it first."""
    drafter = tiny_drafters["transformers"]
    session = drafter.new_session(SamplingParams())
    letters = StructuredOutput("regex", "[a-z ]{99}")
    constrained = drafter.new_session(
        SamplingParams(eos_token_ids=(2,), num_prompt_tokens=12, structured_output=letters)
    )
    try:
        session.prefill(PROMPT)
        proposal = session.propose(4)
        assert not session.draft_next(5, [], proposal)  # 4 of 5 tokens: the draft ended early
        assert not session.draft_next(4, [1, 2], Proposal(proposal.tokens))  # no bonus guessed
        session.window = len(PROMPT) + 8
        assert not session.draft_next(4, [], proposal)  # 12 + 4 + 1 + 4 tokens > 20
        session.window = 1024
        constrained.prefill(PROMPT)
        assert constrained.grammar is not None
        assert not constrained.draft_next(4, [], constrained.propose(4))
        assert session.draft_next(4, [], proposal)
        running = session._next
    finally:
        session.close()
        constrained.close()
    assert running is not None and running.ended.is_set() and running.work.cancelled


@pytest.mark.parametrize("num_branches", [1, 4])
def test_proposal_drafted_proactively_is_the_main_branch_of_a_draft_ahead_for_branches(tiny_drafters, num_branches):
    """A draft-ahead for several branches gets the proactive draft as its main branch and drafts
    its other branches on arrival: the same main branch and the same branches as a session that
    drafts them all when asked."""
    drafter = tiny_drafters["transformers"]
    with _two_sessions(drafter, SamplingParams()) as (proactive, reference):
        for session in (proactive, reference):
            session.keep_alternatives()
        first = reference.propose(4)
        assert proactive.draft_next(4, [], proactive.propose(4))
        ours = proactive.propose_ahead(first.tokens, 4, num_branches=num_branches)
        theirs = reference.propose_ahead(first.tokens, 4, num_branches=num_branches)
        _same_proposal(ours, theirs, SamplingParams())
        assert len(ours.branches) == len(theirs.branches) == num_branches - 1
        for branch, expected in zip(ours.branches, theirs.branches, strict=True):
            assert (branch.num_accepted, branch.next_token) == (expected.num_accepted, expected.next_token)
            assert branch.proposal.tokens == expected.proposal.tokens


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)])
def test_each_branch_drafted_ahead_is_the_plain_proposal_of_its_outcome(tiny_drafters, sampling):
    """With branches, propose_ahead also drafts the next most likely outcomes (a rejection, then
    the draft's second choice; all accepted, then its second bonus guess): each branch's tokens
    (and q) are those propose(K) gives after that outcome is committed."""
    drafter = tiny_drafters["transformers"]
    ahead = drafter.new_session(sampling)
    try:
        ahead.prefill(PROMPT)
        ahead.keep_alternatives()
        predicted = ahead.propose(4).tokens
        proposal = ahead.propose_ahead(predicted, 5, num_branches=4)
        assert len(proposal.branches) == 3
        outcomes = {(b.num_accepted, b.next_token) for b in proposal.branches}
        assert len(outcomes) == 3 and (len(predicted), proposal.bonus_token_id) not in outcomes
        for branch in proposal.branches:
            assert branch.num_accepted == len(predicted) or branch.next_token != predicted[branch.num_accepted]
            plain = drafter.new_session(sampling)
            plain.prefill([*PROMPT, *predicted[: branch.num_accepted], branch.next_token])
            expected = plain.propose(5)
            plain.close()
            assert branch.proposal.tokens == expected.tokens and len(expected.tokens) == 5
            if not sampling.greedy:
                torch.testing.assert_close(branch.proposal.probs, expected.probs, rtol=1e-4, atol=1e-6)
    finally:
        ahead.close()


@pytest.mark.parametrize(("budget_s", "num_branches"), [(1.5, 0), (2.0, 1), (3.0, 2), (None, 3)])
def test_a_branch_is_begun_only_if_it_ends_within_the_budget(tiny_drafters, monkeypatch, budget_s, num_branches):
    """On a clock where every draft run takes 1 s, the main branch ends at 1 s and each further
    branch is expected to take 1 s more: within a 1.5 s budget none is begun (the round would wait
    for it), within 2 s one, within 3 s two; no budget, all three."""
    session = tiny_drafters["transformers"].new_session(SamplingParams())
    clock = [0.0]
    submit = session.engine.submit

    def submit_one_second(work, *args):
        clock[0] += 1.0
        return submit(work, *args)

    monkeypatch.setattr(model_drafting, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(session.engine, "submit", submit_one_second)
    try:
        session.prefill(PROMPT)
        session.keep_alternatives()
        predicted = session.propose(4).tokens
        proposal = session.propose_ahead(predicted, 5, num_branches=4, budget_s=budget_s)
        assert len(proposal.branches) == num_branches
    finally:
        session.close()


def test_branches_are_ranked_by_the_drafts_probabilities():
    """P(rejection at n, then the second choice) = the product of the first n tokens' probabilities
    times the second choice's; all accepted, then the second bonus guess: all of them times its;
    a forced token (None) always passes and has no branch of its own."""
    alternatives = [Alternative(0.9, 11, 0.08), None, Alternative(0.5, 13, 0.45)]
    bonus = Alternative(0.6, 14, 0.3)
    # rejection at 0: 0.08; at 2: 0.9 x 0.45 = 0.405; the second bonus: 0.9 x 0.5 x 0.3 = 0.135
    assert likely_outcomes([1, 2, 3], alternatives, bonus) == [(2, 13), (3, 14), (0, 11)]
    assert likely_outcomes([1, 2, 3], [], bonus) == [(3, 14)]  # drafted before branching: the bonus only


def test_model_free_drafter_refuses_draft_ahead(tiny_drafters):
    session = tiny_drafters["ngram"].new_session(SamplingParams())
    session.prefill(PROMPT)
    answers: list = []
    session.start_proposal(3, [1, 2], 1, None, answers.append)
    assert len(answers) == 1 and isinstance(answers[0], FailedPrecondition)
    assert "without predicted_token_ids" in str(answers[0])


async def _generate(pipeline, drafter: str, k: int, sampling: SamplingParams, draft_ahead: bool, branches: int = 1):
    """Runs one request's rounds with a fixed K through the real services; returns the generated
    tokens and the rounds' draft-ahead outcomes (a hit's branch after a colon, and ``+asked``
    where the round asked the draft for a proposal of its own: the draft service's time for it
    is in the round's record)."""
    clients = ServiceClients([pipeline.draft_address], [pipeline.verify_address], 60, 60)
    plan = DraftPlan(drafts_ahead=draft_ahead, branches=branches)
    request = ResolvedRequest(PROMPT, MAX_NEW, sampling, [], k, drafter, adaptive=False, draft=plan)
    rounds = RequestRounds(
        DraftClient(clients),
        VerifyClient(clients),
        f"ahead-{drafter}-{draft_ahead}-{branches}-{sampling.seed}",
        request,
        list(PROMPT),
    )
    rounds.draft.observe_verify(60_000)  # time enough for every branch: the tiny models' verify takes ms
    generated, outcomes, policy = [], [], FixedK(drafter, k)
    try:
        generated, _ = await rounds.prefill(policy)  # the first token: the target's prefill
        while len(generated) < MAX_NEW:
            new, _, record = await rounds.step(policy, MAX_NEW - len(generated) - 1)
            generated += new
            outcome = ":".join(filter(None, [record.draft_ahead, record.draft_ahead_branch]))
            outcomes.append(outcome + "+asked" * (record.draft_compute_ms > 0))
    finally:
        await rounds.release()
        await clients.close()
    return generated, outcomes


@pytest.mark.parametrize(
    "drafter, k, sampling",
    [("close", 1, SamplingParams()), ("self", 3, SamplingParams(temperature=0.4, seed=3))],
    ids=["greedy", "seeded"],
)
def test_draft_ahead_changes_no_token(tiny_pipeline, drafter, k, sampling):
    """The same request with and without draft-ahead, through the real draft and verify services:
    identical tokens, with rounds that hit and rounds that missed the pre-drafted branch (the
    draft and the settings are chosen so that both happen: a near copy of the target under
    greedy decoding; the target itself under sampling, where the sampled bonus token is not
    always the draft's argmax guess); and with three more branches, identical tokens again and,
    greedy, hits on the other branches too."""
    serial, serial_outcomes = asyncio.run(_generate(tiny_pipeline, drafter, k, sampling, draft_ahead=False))
    used = _proactive_drafts_used(tiny_pipeline)
    ahead, outcomes = asyncio.run(_generate(tiny_pipeline, drafter, k, sampling, draft_ahead=True))
    assert ahead == serial
    assert _proactive_drafts_used(tiny_pipeline) > used  # the draft service drafts before it is asked too
    assert "+asked" in serial_outcomes and set(serial_outcomes) <= {"+asked", ""}  # "": a plain last round
    # a hit asks for nothing; a miss asks for its own proposal once the work ahead is done
    assert f"{HIT}:{MAIN}" in outcomes and f"{MISS}+asked" in outcomes, outcomes
    assert not [outcome for outcome in outcomes if outcome.startswith(HIT) and outcome.endswith("+asked")]
    used = _proactive_drafts_used(tiny_pipeline)
    branched, branch_outcomes = asyncio.run(_generate(tiny_pipeline, drafter, k, sampling, True, branches=4))
    assert branched == serial
    assert _proactive_drafts_used(tiny_pipeline) > used
    if sampling.greedy:  # the near copy's rejections: its second choice is often the target's token
        # a round that misses the main branch may hit another: they turn misses into hits
        assert {f"{HIT}:{BONUS}", f"{HIT}:{RECOVERED}"} <= set(branch_outcomes), branch_outcomes
        assert branch_outcomes.count(f"{MISS}+asked") < outcomes.count(f"{MISS}+asked"), (branch_outcomes, outcomes)


def _proactive_drafts_used(pipeline) -> float:
    registry = pipeline.draft.servicer.metrics.registry
    return registry.get_sample_value("specdec_proactive_drafts_total", {"outcome": "used"}) or 0.0


def test_request_reports_draft_ahead(tiny_pipeline):
    """Through the coordinator (draft-ahead on by default): the self-draft's proposals are always
    accepted and its bonus guess is the target's token, so (nearly) every branch hits; the
    request's metrics say so, and its tokens are plain greedy decoding's."""
    request = coordinator_pb2.GenerateRequest(
        text="Tell me a story.", max_new_tokens=MAX_NEW, num_speculative_tokens=4, drafter="self"
    )
    used = _proactive_drafts_used(tiny_pipeline)
    completion = generate(tiny_pipeline.address, request, timeout_s=120)
    assert _proactive_drafts_used(tiny_pipeline) > used  # the coordinator's defaults: draft-ahead, one branch
    plain = coordinator_pb2.GenerateRequest(text="Tell me a story.", max_new_tokens=MAX_NEW, num_speculative_tokens=0)
    assert completion.token_ids == generate(tiny_pipeline.address, plain, timeout_s=120).token_ids
    m = completion.metrics
    assert m.num_draft_ahead_proposals > 0 and m.num_draft_ahead_hits >= m.num_draft_ahead_proposals - 1
    assert m.draft_ahead_hit_rate == pytest.approx(m.num_draft_ahead_hits / m.num_draft_ahead_proposals)
    assert sum(m.draft_ahead_hits_per_branch.values()) == m.num_draft_ahead_hits

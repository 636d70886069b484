"""coordinator.api.request: the draft plan a request is resolved with (its validation and errors:
test_bad_input.py)."""

import pytest

from coordinator.api.request import draft_plan
from coordinator.settings import CoordinatorSettings
from coordinator.speculation.plan import DraftPlan
from specdec.sampling.sampling_params import SamplingParams

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, seed=1)


def plan(ahead: bool, hidden: bool, branches: int, with_target: bool) -> DraftPlan:
    return DraftPlan(
        drafts_ahead=ahead, hidden_behind_verify=hidden, branches=branches, prefill_with_target=with_target
    )


def settings(**fields) -> CoordinatorSettings:
    return CoordinatorSettings(insecure=True, draft_ahead_branches=3, **fields)


@pytest.mark.parametrize(
    ("fields", "sampling", "model_drafter", "expected"),
    [
        # a draft of its own hardware: drafted ahead, hidden behind the verify, every branch when greedy
        ({}, GREEDY, True, plan(True, True, 3, True)),
        ({}, SAMPLED, True, plan(True, True, 1, True)),
        # on the target's cores: one branch, its forwards the round's price; greedy opens after the first token
        ({"draft_shares_target_cores": True}, GREEDY, True, plan(True, False, 1, False)),
        ({"draft_shares_target_cores": True}, SAMPLED, True, plan(True, False, 1, True)),
        # no draft-ahead, or a model-free drafter (n-gram, suffix): nothing drafted ahead
        ({"draft_ahead": False}, GREEDY, True, plan(False, False, 1, True)),
        ({}, GREEDY, False, plan(False, False, 1, True)),
    ],
)
def test_the_draft_plan_follows_the_draft_s_hardware_and_the_sampling(fields, sampling, model_drafter, expected):
    assert draft_plan(settings(**fields), sampling, model_drafter) == expected

"""Logits processors (specdec/sampling/logits_processors.py): each against a hand computation, the rows of a
proposal, and under speculation: the target's acceptance and the model drafter's proposals both
use the processed distributions (a draft that is the target itself passes every token, greedy and
sampled), and greedy output equals transformers' own repetition penalty and min_new_tokens, in
process and through the services; the new GenerateRequest fields' errors and ignore_eos."""

import math

import grpc
import pytest
import torch

from coordinator.api.client import generate
from specdec.rpc.errors import InvalidArgument
from specdec.sampling.logits_processors import process
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.conftest import TINY_VOCAB, chat_ids, plain_greedy

EOS = 2
LOGITS = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5, 2.0]])


def hand(logits: list[float], params: SamplingParams, prompt: list[int], generated: list[int]) -> list[float]:
    """The processors of one position, one token at a time, from their definitions."""
    out = list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(generated) < params.min_tokens:
        for token in params.eos_token_ids:
            out[token] = -math.inf
    for token in range(len(out)):
        count = generated.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(logit_bias=((1, 5.0), (4, -100.0))),
        SamplingParams(min_tokens=4, eos_token_ids=(2, 5)),
        SamplingParams(
            frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5, logit_bias=((0, -1.0),), min_tokens=3
        ),
    ],
)
def test_each_processor_equals_the_hand_computation(params):
    prompt, generated = [0, 4], [3, 3, 1]
    params = SamplingParams(**{**params.__dict__, "num_prompt_tokens": len(prompt)})
    got = process(LOGITS, params, prompt + generated)
    assert got[0].tolist() == pytest.approx(hand(LOGITS[0].tolist(), params, prompt, generated))


def test_row_i_follows_the_first_i_draft_tokens():
    params = SamplingParams(frequency_penalty=1.0, min_tokens=2, eos_token_ids=(2,), num_prompt_tokens=1)
    context, drafts = [0, 5], [3, 3]
    got = process(LOGITS.expand(3, 6), params, context, drafts)
    for i in range(3):
        assert got[i].tolist() == pytest.approx(hand(LOGITS[0].tolist(), params, [0], [5, *drafts[:i]]))
    assert got[0, 2] == -math.inf and got[2, 2] != -math.inf  # min_tokens: 1, 2 then 3 generated


def test_no_processor_leaves_the_logits_alone():
    assert process(LOGITS, SamplingParams(temperature=0.5), [1, 2, 3]) is LOGITS


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty is 2.5: it must lie in"),
        ({"presence_penalty": -3.0}, "presence_penalty is -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty is 0.0: it must be finite and > 0"),
        ({"logit_bias": ((7, 101.0),)}, "logit_bias maps token 7 to 101.0"),
        ({"min_tokens": -1}, "min_tokens is -1"),
    ],
)
def test_out_of_range_values_are_refused(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**fields)


def test_proto_round_trip():
    params = SamplingParams(
        frequency_penalty=0.5, repetition_penalty=1.25, logit_bias=((3, -2.0), (9, 1.5)), min_tokens=4,
        eos_token_ids=(2,), num_prompt_tokens=7,
    )  # fmt: skip
    assert SamplingParams.from_proto(params.to_proto()) == params


PENALTIES = SamplingParams(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3)


def speculate(target, drafter, prompt: list[int], params: SamplingParams, max_new: int, k: int = 4):
    """Rounds of draft-then-verify on the target and a draft session; returns the generated ids
    and the (accepted, drafted) counts."""
    session, draft = target.new_session(prompt, params), drafter.new_session(params)
    draft.prefill(prompt)
    accepted = drafted = 0
    try:
        while len(session.committed) - len(prompt) < max_new:
            proposal = draft.propose(k)
            n, token = session.verify(proposal.tokens, proposal.probs)
            draft.sync([*proposal.tokens[:n], token])
            accepted, drafted = accepted + n, drafted + len(proposal.tokens)
    finally:
        session.close()
        draft.close()
    return session.committed[len(prompt) :][:max_new], (accepted, drafted)


def test_greedy_speculation_equals_transformers_repetition_penalty_and_min_new_tokens(
    tiny_target, tiny_drafters, plain_target_model
):
    prompt = [5, 17, 230, 17, 5, 900, 41]
    params = SamplingParams(repetition_penalty=1.4, min_tokens=12, eos_token_ids=(EOS,), num_prompt_tokens=len(prompt))
    with torch.inference_mode():
        out = plain_target_model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.4, min_new_tokens=12,
            eos_token_id=EOS, pad_token_id=0,
        )  # fmt: skip
    reference = out[0, len(prompt) :].tolist()
    assert reference != plain_greedy(plain_target_model, prompt, 24)  # the processors change the output
    generated, _ = speculate(tiny_target, tiny_drafters["close"], prompt, params, len(reference))
    assert generated == reference


def test_a_self_draft_passes_every_token_under_the_same_processors(tiny_target, tiny_drafters):
    """The draft model is the target: the draft's and the target's processed distributions are
    the same, so greedy drafts all pass, and sampled ones pass with probability min(1, p/q) = 1."""
    prompt = [5, 17, 230, 17, 5, 900, 41]
    for params in (PENALTIES, SamplingParams(**{**PENALTIES.__dict__, "temperature": 1.0, "seed": 3})):
        params = SamplingParams(**{**params.__dict__, "num_prompt_tokens": len(prompt)})
        _, (accepted, drafted) = speculate(tiny_target, tiny_drafters["self"], prompt, params, 20)
        assert drafted and accepted == drafted


# --- through the services (the tiny pipeline: real gRPC servers on free ports) ---------------


@pytest.mark.parametrize("drafter", ["self", "close", "ngram"])
def test_pipeline_with_processors_equals_transformers_generate(tiny_pipeline, smollm2_tokenizer, drafter):
    prompt = chat_ids(smollm2_tokenizer, "Say something about the sea")
    with torch.inference_mode():
        out = tiny_pipeline.plain_model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.4, min_new_tokens=12,
            eos_token_id=EOS, pad_token_id=0,
        )  # fmt: skip
    request = coordinator_pb2.GenerateRequest(
        text="Say something about the sea", max_new_tokens=24, num_speculative_tokens=4, drafter=drafter,
        repetition_penalty=1.4, min_tokens=12,
    )  # fmt: skip
    completion = generate(tiny_pipeline.address, request, timeout_s=120)
    assert completion.token_ids == out[0, len(prompt) :].tolist()
    if drafter == "self":  # the draft applies the target's processors: every draft passes
        assert completion.metrics.draft_acceptance_rate == 1.0


def test_ignore_eos_generates_past_eos(tiny_pipeline):
    request = coordinator_pb2.GenerateRequest(text="Hi", max_new_tokens=6, logit_bias={EOS: 100.0}, drafter="self")
    assert generate(tiny_pipeline.address, request, timeout_s=120).token_ids == [EOS]
    request.ignore_eos = True
    completion = generate(tiny_pipeline.address, request, timeout_s=120)
    assert (completion.token_ids, completion.finish_reason) == ([EOS] * 6, "length")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens is 9: it must not exceed max_new_tokens"),
        ({"logit_bias": {TINY_VOCAB: 1.0}}, f"logit_bias names token {TINY_VOCAB}"),
        ({"frequency_penalty": 3.0}, "frequency_penalty is 3.0"),
    ],
)
def test_bad_processor_fields_are_invalid_argument(tiny_pipeline, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(text="Hi", **fields), timeout_s=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()

"""Log-probabilities of committed tokens (:mod:`specdec.sampling.logprobs`, the verify service's Verify and
Decode, ``GenerateRequest.logprobs`` over gRPC): raw, the log_softmax of the target's logits at
the position that committed each token, equal to the in-process target's within 1e-4 whatever
the drafter, K, sampling transform, processors, grammar or a rebuild from the committed log."""

import threading

import pytest
import torch

from coordinator.api.client import generate, stream
from specdec.rpc.errors import InvalidArgument
from specdec.sampling.logprobs import committed_logprobs, token_logprobs
from specdec.sampling.sampling_params import SamplingParams
from specdec.v1 import common_pb2, coordinator_pb2
from tests.conftest import chat_ids, plain_greedy

TOLERANCE = 1e-4
PROMPT = "Tell me a story about a cat."


def reference(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """``[len(generated), V]``: the in-process target's log_softmax at each generated position
    (one plain forward, transformers' own attention)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(dim=-1)


def assert_equal_to_the_target(logprobs, model, prompt: list[int], generated: list[int], num_top: int) -> None:
    assert len(logprobs) == len(generated)
    expected = reference(model, prompt, generated)
    top_values, top_ids = expected.topk(num_top, dim=-1)
    for i, (entry, token) in enumerate(zip(logprobs, generated, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[i, token]), abs=TOLERANCE), f"position {i}"
        assert list(entry.top_token_ids) == top_ids[i].tolist(), f"position {i}"
        assert torch.allclose(torch.tensor(list(entry.top_logprobs)), top_values[i], atol=TOLERANCE)


# --- the computation --------------------------------------------------------------------------


def test_committed_logprobs_of_a_ragged_step():
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 50, generator=generator) * 3 for n in (3, 1, 2)]
    tokens, tops = [[4, 9, 0], [49], [7, 7]], [0, 2, 5]
    out = committed_logprobs(rows, tokens, tops)
    for logits, ids, top, entries in zip(rows, tokens, tops, out, strict=True):
        expected = logits.log_softmax(dim=-1)
        assert [e.logprob for e in entries] == pytest.approx(expected[range(len(ids)), ids].tolist(), abs=1e-6)
        for i, entry in enumerate(entries):
            assert list(entry.top_token_ids) == expected[i].argsort(descending=True)[:top].tolist()
            assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
    one = token_logprobs(rows[0][1], 9, 3)
    assert one.logprob == out[0][1].logprob and len(one.top_token_ids) == 3


def test_top_logprobs_needs_logprobs_and_fits_the_vocabulary(tiny_target):
    with pytest.raises(InvalidArgument, match="top_logprobs is 2 without logprobs: set logprobs to true"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(InvalidArgument, match="top_logprobs is -1"):
        SamplingParams(logprobs=True, top_logprobs=-1)
    too_many = SamplingParams(logprobs=True, top_logprobs=tiny_target.vocab_size + 1)
    with pytest.raises(InvalidArgument, match="must not exceed the vocabulary size"):
        tiny_target.new_session([1, 2, 3], too_many)
    assert SamplingParams.from_proto(too_many.to_proto()) == too_many


# --- the verify service's sessions ---------------------------------------------------------------


def test_verify_and_decode_return_raw_logprobs_under_sampling_and_processors(tiny_target, plain_target_model):
    """Temperature, top-k, penalties and a logit bias change what is drawn, not the values: raw,
    before all of them. Verify returns one per committed token (the accepted drafts and the next
    token), Decode one; a session rebuilt from the log gives the same."""
    prompt = [5, 17, 230, 41, 8]
    continuation = plain_greedy(plain_target_model, prompt, 12)
    params = SamplingParams(
        temperature=0.8, top_k=20, seed=3, frequency_penalty=0.5, logit_bias=((continuation[1], 3.0),),
        num_prompt_tokens=len(prompt), logprobs=True, top_logprobs=3,
    )  # fmt: skip
    session = tiny_target.new_session(prompt, params)
    logprobs = []
    try:
        while len(session.committed) < len(prompt) + 10:
            drafts = continuation[len(session.committed) - len(prompt) :][:3]
            q = torch.zeros(len(drafts), tiny_target.vocab_size)
            q[range(len(drafts)), drafts] = 1.0  # point masses, as a lookup's
            n, _ = session.verify(drafts, q)
            assert len(session.last_logprobs) == n + 1
            logprobs += session.last_logprobs
        session.verify([], None)  # a Decode
        assert len(session.last_logprobs) == 1
        logprobs += session.last_logprobs
        generated = session.committed[len(prompt) :]
        assert_equal_to_the_target(logprobs, plain_target_model, prompt, generated, 3)
        rebuilt = tiny_target.new_session(session.committed, params)
        try:
            session.verify([], None)
            rebuilt.verify([], None)
            assert rebuilt.committed == session.committed
            assert rebuilt.last_logprobs[0].logprob == pytest.approx(session.last_logprobs[0].logprob, abs=TOLERANCE)
            assert rebuilt.last_logprobs[0].top_token_ids == session.last_logprobs[0].top_token_ids
        finally:
            rebuilt.close()
    finally:
        session.close()


def test_a_step_computes_them_only_for_the_sessions_that_ask(tiny_target, plain_target_model):
    prompts = [[5, 17, 230, 41], [9, 9, 300, 12, 77]]
    asking, silent = SamplingParams(logprobs=True, top_logprobs=2), SamplingParams()
    sessions = [tiny_target.new_session(prompts[0], asking), tiny_target.new_session(prompts[1], silent)]
    barrier = threading.Barrier(2)

    def decode(session):
        for _ in range(4):
            barrier.wait()  # the two decodes tend to share steps
            session.verify([], None)

    threads = [threading.Thread(target=decode, args=(session,)) for session in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sessions[1].last_logprobs == []
        generated = sessions[0].committed[len(prompts[0]) :]
        last = sessions[0].last_logprobs
        expected = reference(plain_target_model, prompts[0], generated)[-1]
        assert last[0].logprob == pytest.approx(float(expected[generated[-1]]), abs=TOLERANCE)
    finally:
        for session in sessions:
            session.close()


# --- Generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_speculative_tokens=0),
        dict(num_speculative_tokens=3, drafter="transformers"),
        dict(num_speculative_tokens=4, drafter="wrong"),
        dict(drafter="ngram"),  # adaptive K: the coordinator's lookup and plain decode
        dict(temperature=0.9, top_p=0.9, seed=11, num_speculative_tokens=2, drafter="transformers"),
        dict(
            num_speculative_tokens=3,
            drafter="transformers",
            structured_output=common_pb2.StructuredOutput(regex="[a-z ]{4,40}"),
        ),
    ],
    ids=["plain", "transformers-K3", "wrong-K4", "adaptive-ngram", "sampled", "regex"],
)
def test_generate_returns_the_targets_logprobs_with_every_message(tiny_pipeline, smollm2_tokenizer, fields):
    request = coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=24, logprobs=True, top_logprobs=4, **fields)
    responses = list(stream(tiny_pipeline.address, request, timeout_s=120))
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    generated = [token for r in responses for token in r.token_ids]
    logprobs = [entry for r in responses for entry in r.logprobs]
    assert_equal_to_the_target(logprobs, tiny_pipeline.plain_model, chat_ids(smollm2_tokenizer, PROMPT), generated, 4)


def test_without_logprobs_the_messages_carry_none(tiny_pipeline):
    request = coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=8, num_speculative_tokens=2)
    assert all(not r.logprobs for r in stream(tiny_pipeline.address, request, timeout_s=60))
    plain = generate(tiny_pipeline.address, request, timeout_s=60)
    with_logprobs = coordinator_pb2.GenerateRequest(
        text=PROMPT, max_new_tokens=8, num_speculative_tokens=2, logprobs=True
    )
    assert generate(tiny_pipeline.address, with_logprobs, timeout_s=60).token_ids == plain.token_ids

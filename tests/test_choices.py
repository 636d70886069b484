"""A request's choices (``GenerateRequest.n``, :mod:`coordinator.api.choices`): their requests,
the merged stream (the others start after choice 0's prefill; errors and closing), and over gRPC:
choice i equals the request seeded with seed + i, each message names its choice, and a choice
resumes on its own by its request id."""

import asyncio
import json

import grpc
import pytest

from coordinator.api.choices import choice_requests, interleave, num_choices
from coordinator.api.client import Completion, generate, generate_choices, stream
from specdec.rpc.errors import InvalidArgument
from specdec.v1 import coordinator_pb2

PROMPT = "Tell me about tides."


def request(**fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=10, **fields)


# --- the requests ---------------------------------------------------------------------------------


def test_choice_requests_take_seed_plus_index_and_suffixed_ids():
    choices = choice_requests(request(n=3, seed=2**64 - 2, temperature=1.0), "abc", max_n=4)
    assert [c.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]
    assert [c.request_id for c in choices] == ["abc:0", "abc:1", "abc:2"]
    assert all(not c.HasField("n") and c.text == PROMPT and c.temperature == 1.0 for c in choices)
    unseeded = choice_requests(request(n=2), "x", max_n=4)
    assert not any(c.HasField("seed") for c in unseeded)  # each draws its own
    [single] = choice_requests(request(seed=5), "abc", max_n=4)
    assert single.request_id == "abc" and single.seed == 5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(n=0), "n is 0: it must lie in [1, 4] (the coordinator's --max-n)"),
        (dict(n=5), "n is 5: it must lie in [1, 4]"),
        (dict(n=2, request_id="r", resume_from=3), "n is 2 with resume_from: resume one choice at a time"),
        (
            dict(n=4, request_id="x" * 127),
            "request_id has 127 characters: with n = 4 it may have at most 126 (choice i is stored as "
            "<request_id>:<i>); shorten it",
        ),
    ],
)
def test_bad_n(fields, message):
    with pytest.raises(InvalidArgument) as caught:
        num_choices(request(**fields), max_n=4)
    assert str(caught.value).startswith(message)


# --- the merged stream ----------------------------------------------------------------------------


def test_the_other_choices_start_after_choice_0s_prefill_and_interleave():
    events: list[str] = []
    prefilled = asyncio.Event()

    async def choice(i: int):
        events.append(f"start {i}")
        if i == 0:
            await asyncio.sleep(0.01)
            events.append("prefilled 0")
            prefilled.set()
        for j in range(2):
            await asyncio.sleep(0.01)
            yield (i, j)

    async def run():
        return [item async for item in interleave([choice(i) for i in range(3)], prefilled)]

    items = asyncio.run(run())
    assert sorted(items) == [(i, j) for i in range(3) for j in range(2)]
    assert events[:2] == ["start 0", "prefilled 0"] and set(events[2:]) == {"start 1", "start 2"}
    for i in range(3):  # each choice's own order is kept
        assert items.index((i, 0)) < items.index((i, 1))


def test_an_error_cancels_the_other_choices_and_closing_closes_them():
    closed: list[int] = []

    async def choice(i: int, fail: bool):
        try:
            yield i
            if fail:
                raise InvalidArgument("choice failed")
            await asyncio.sleep(10)
            yield i
        finally:
            closed.append(i)

    async def failing():
        prefilled = asyncio.Event()
        prefilled.set()
        async for _ in interleave([choice(0, False), choice(1, True)], prefilled):
            pass

    with pytest.raises(InvalidArgument, match="choice failed"):
        asyncio.run(asyncio.wait_for(failing(), 5))
    assert sorted(closed) == [0, 1]

    async def closed_early():
        prefilled = asyncio.Event()  # never set: choice 1 never starts
        merged = interleave([choice(0, False), choice(1, False)], prefilled)
        assert await anext(merged) == 0
        await merged.aclose()

    closed.clear()
    asyncio.run(asyncio.wait_for(closed_early(), 5))
    assert closed == [0]


# --- over gRPC ------------------------------------------------------------------------------------


def test_choice_i_is_the_request_seeded_with_seed_plus_i(tiny_pipeline):
    """A fixed K: under adaptive K the choices' load (they run at once) could choose other K than
    a request alone, and a seed reproduces a sampled completion at the same K."""
    fields = dict(temperature=1.0, num_speculative_tokens=2, logprobs=True, top_logprobs=1)
    responses = list(stream(tiny_pipeline.address, request(n=3, seed=7, request_id="three", **fields), timeout_s=60))
    choices = [Completion() for _ in range(3)]
    for response in responses:
        if not choices[response.index].token_ids:
            assert response.request_id == f"three:{response.index}"
        choices[response.index].add(response)
        assert len(response.logprobs) == len(response.token_ids)
    assert sum(bool(r.request_id) for r in responses) == 3
    for i, choice in enumerate(choices):
        alone = generate(tiny_pipeline.address, request(seed=7 + i, **fields), timeout_s=60)
        assert choice.token_ids == alone.token_ids and choice.text == alone.text
        assert [e.top_token_ids for e in choice.logprobs] == [e.top_token_ids for e in alone.logprobs]
        assert choice.finish_reason and choice.metrics.num_generated_tokens == len(choice.token_ids)
    assert len({tuple(c.token_ids) for c in choices}) > 1
    with pytest.raises(ValueError, match="generate_choices"):
        generate(tiny_pipeline.address, request(n=2), timeout_s=60)


def test_a_choice_resumes_by_its_own_request_id(tiny_pipeline):
    fields = dict(temperature=1.0, seed=3, num_speculative_tokens=2, logprobs=True)
    choices = generate_choices(tiny_pipeline.address, request(n=2, request_id="pair", **fields), timeout_s=60)
    rest = list(
        stream(tiny_pipeline.address, coordinator_pb2.GenerateRequest(request_id="pair:1", resume_from=4), timeout_s=60)
    )
    assert {r.index for r in rest} == {1}
    assert [t for r in rest for t in r.token_ids] == choices[1].token_ids[4:]
    assert [e.logprob for r in rest for e in r.logprobs] == [e.logprob for e in choices[1].logprobs[4:]]
    with pytest.raises(grpc.RpcError) as caught:
        generate_choices(tiny_pipeline.address, request(n=2, request_id="pair", resume_from=0), timeout_s=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume one choice at a time" in caught.value.details()


def test_cli_generate_prints_every_choice_with_its_logprobs(tiny_pipeline):
    from typer.testing import CliRunner

    from specdec_app.cli import app

    args = ["generate", PROMPT, "--coordinator", tiny_pipeline.address, "--max-new-tokens", "4", "-k", "2"]
    args += ["--n", "2", "--seed", "1", "--temperature", "1", "--logprobs", "--top-logprobs", "2"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    choices = json.loads(result.stdout.splitlines()[-1])["choices"]
    assert len(choices) == 2 and all(len(c["logprobs"]) == len(c["token_ids"]) == 4 for c in choices)
    assert all(len(entry["top_token_ids"]) == 2 and entry["logprob"] <= 0 for entry in choices[1]["logprobs"])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "choice 1" in result.output and result.output.count("log-probabilities") == 2

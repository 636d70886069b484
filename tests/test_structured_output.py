"""Structured output through the services (invariant *lossless under constraints*): greedy output
of the pipeline equals plain constrained decoding in process (the same grammar module over
transformers' logits, one token at a time) for every drafter and K, a grammar that forces the end
finishes with stop, and a bad spec is INVALID_ARGUMENT naming its field (or the limit it exceeds
and the coordinator's setting of it). Under adaptive K the tokens the grammar forces are free
proposals (RequestMetrics.num_forced_draft_tokens). The tiny pipeline: real gRPC servers on free
ports, the tiny random models."""

import json
import uuid

import grpc
import pytest

from coordinator.api.client import generate
from coordinator.api.request import resolve
from coordinator.settings import CoordinatorSettings
from specdec.engine.vocab import tokenizer_fingerprint
from specdec.rpc.errors import InvalidArgument
from specdec.sampling.grammar import FORCED, GrammarMatcher
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import GrammarLimits, StructuredOutput
from specdec.v1 import common_pb2, coordinator_pb2, verify_pb2
from tests.conftest import TINY_VOCAB, chat_ids, constrained_greedy

EOS = 2
MAX_NEW = 32
PROMPT = "Describe a person as JSON"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "regex": common_pb2.StructuredOutput(regex=r"(yes|no), [a-z]{2,8}\."),
    "choice": common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["red", "green", "blue"])),
}


@pytest.fixture(scope="module")
def references(tiny_pipeline, smollm2_tokenizer, tiny_grammar_vocab):
    prompt = chat_ids(smollm2_tokenizer, PROMPT)
    return {
        kind: constrained_greedy(
            tiny_pipeline.plain_model, prompt, StructuredOutput.from_proto(msg), tiny_grammar_vocab, MAX_NEW
        )
        for kind, msg in SPECS.items()
    }


def request(kind: str, **fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=MAX_NEW, structured_output=SPECS[kind], **fields)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize(("drafter", "k"), [("self", 4), ("close", 2), ("close", 8), ("ngram", 4), ("wrong", 4)])
def test_greedy_pipeline_equals_plain_constrained_decoding(tiny_pipeline, references, kind, drafter, k):
    completion = generate(tiny_pipeline.address, request(kind, num_speculative_tokens=k, drafter=drafter), 120)
    assert completion.token_ids == references[kind], f"{drafter} K={k} diverged under {kind}"


@pytest.mark.parametrize("drafter", ["close", "suffix"])
def test_adaptive_k_equals_plain_constrained_decoding(tiny_pipeline, references, drafter):
    """Adaptive K proposes the tokens the grammar forces (the keys and punctuation of the schema)
    free: the model drafter's proposals open with them, and the coordinator's forced-token lookup
    proposes them alone (with the suffix lookup the only one that can: its rounds, none of the
    draft service's). A cache partition of its own (cache_salt): the suffix lookup's shared cache
    holds the other tests' outputs of this schema, which it would propose, forced tokens and all."""
    partition = f"forced-{drafter}-{uuid.uuid4().hex}"
    completion = generate(tiny_pipeline.address, request("json_schema", drafter=drafter, cache_salt=partition), 120)
    assert completion.token_ids == references["json_schema"]
    metrics = completion.metrics
    assert 0 < metrics.num_forced_draft_tokens <= metrics.num_draft_tokens
    if drafter == "suffix":
        assert metrics.drafter_usage[FORCED].num_draft_tokens >= metrics.num_forced_draft_tokens > 0


@pytest.mark.parametrize("k", [4, None])
def test_a_grammar_that_forces_the_end_finishes_with_stop(tiny_pipeline, k):
    """After the last choice's text only EOS is allowed: the request ends there with ``stop``,
    at a fixed K and under adaptive K (with its forced-token lookup)."""
    completion = generate(tiny_pipeline.address, request("choice", num_speculative_tokens=k, drafter="self"), 120)
    assert (completion.finish_reason, completion.token_ids[-1]) == ("stop", EOS)
    assert completion.text in ("red", "green", "blue")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (common_pb2.StructuredOutput(regex="(a|b"), "structured_output.regex is not valid"),
        (common_pb2.StructuredOutput(json_schema='{"type": "objekt"}'), "structured_output.json_schema is not valid"),
        (common_pb2.StructuredOutput(grammar="start: foo"), 'unknown name: "foo"'),
    ],
)
def test_a_bad_spec_is_invalid_argument_naming_its_field(tiny_pipeline, spec, message):
    with pytest.raises(grpc.RpcError) as err:
        generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(text="Hi", structured_output=spec), 60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_a_spec_over_the_size_limit_is_invalid_argument_naming_the_limit_and_the_setting(tiny_pipeline):
    schema = json.dumps({"type": "object", "description": "x" * 70_000})
    spec = common_pb2.StructuredOutput(json_schema=schema)
    with pytest.raises(grpc.RpcError) as err:
        generate(tiny_pipeline.address, coordinator_pb2.GenerateRequest(text="Hi", structured_output=spec), 60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"structured_output.json_schema is {len(schema)} bytes: the limit is 65536 bytes" in err.value.details()
    assert "--grammar-max-spec-bytes" in err.value.details()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("grammar_max_symbols", "grammar size (number of symbols) too big (limit for this grammar: 10)"),
        ("grammar_max_lexer_fuel", "initial lexer configuration (grammar) too big (limit for this grammar: 10)"),
    ],
)
def test_a_grammar_over_a_compile_limit_names_the_limit_and_the_setting(smollm2_tokenizer, setting, message):
    """The coordinator compiles every spec within its settings' limits (the services trust it)."""
    settings = CoordinatorSettings(**{setting: 10})
    target = verify_pb2.VerifyServiceGetInfoResponse(
        model="tiny",
        vocab_fingerprint=tokenizer_fingerprint(smollm2_tokenizer),
        vocab_size=TINY_VOCAB,
        eos_token_ids=[EOS],
        max_context_length=512,
        max_num_speculative_tokens=16,
    )
    with pytest.raises(InvalidArgument) as err:
        resolve(request("json_schema"), settings, smollm2_tokenizer, target.vocab_fingerprint, target, None)
    flag = setting.replace("_", "-")
    assert f"structured_output.json_schema is not valid: {message} (the coordinator's {setting} is 10" in str(err.value)
    assert f"--{flag} or SPECDEC_COORDINATOR_{setting.upper()}" in str(err.value)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_self_draft_under_the_grammar_passes_every_token(tiny_pipeline, temperature):
    """The draft model is the target and masks its logits by the same grammar: its greedy drafts
    all pass, and its sampled ones pass with probability min(1, p/q) = 1."""
    completion = generate(
        tiny_pipeline.address,
        request("json_schema", num_speculative_tokens=4, drafter="self", temperature=temperature, seed=7),
        120,
    )
    assert completion.metrics.num_draft_tokens and completion.metrics.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_model_drafter_proposes_forced_tokens_without_a_forward(
    tiny_drafters, smollm2_tokenizer, tiny_grammar_vocab, temperature
):
    """At the start of the schema's object the grammar forces ``{"name": "``: those tokens open
    the proposal (q a point mass on each under sampling), and the model drafts after them."""
    prompt = chat_ids(smollm2_tokenizer, PROMPT)
    spec = StructuredOutput.from_proto(SPECS["json_schema"])
    forced = GrammarMatcher.from_log(spec, tiny_grammar_vocab, GrammarLimits()).forced_tokens()
    assert smollm2_tokenizer.decode(forced).startswith('{"name":')
    params = SamplingParams(
        temperature=temperature, seed=1, eos_token_ids=(EOS,), num_prompt_tokens=len(prompt), structured_output=spec
    )
    session = tiny_drafters["close"].new_session(params)
    session.prefill(prompt)
    try:
        proposal = session.propose(len(forced) + 3)
    finally:
        session.close()
    assert proposal.tokens[: len(forced)] == forced and len(proposal.tokens) == len(forced) + 3
    assert proposal.forced[: len(forced)] == [True] * len(forced)  # reported to the coordinator's adaptive K
    matcher = GrammarMatcher.from_log(spec, tiny_grammar_vocab, GrammarLimits())
    assert matcher.valid_prefix(proposal.tokens) == len(proposal.tokens)  # drafted under the mask
    if temperature:
        assert proposal.probs is not None
        assert proposal.probs[: len(forced)].max(dim=1).values.tolist() == [1.0] * len(forced)

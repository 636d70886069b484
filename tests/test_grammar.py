"""The grammar matcher (specdec/sampling/grammar.py) and the compilation of structured-output specs
(specdec/sampling/structured_output.py) on SmolLM2's real tokenizer: rollback against a fresh matcher fed
the committed log, the masks along a proposal, forced tokens and the coordinator's forced-token
lookup, the end of a grammar, and the errors for invalid specs and limits. No model: a few seconds."""

import json
import random

import numpy as np
import pytest

from specdec.rpc.errors import InvalidArgument
from specdec.sampling.grammar import ForcedMatch, ForcedTokenLookup, GrammarMatcher
from specdec.sampling.structured_output import GrammarLimits, GrammarTooLarge, StructuredOutput, grammar_tokenizer

EOS = 2
LIMITS = GrammarLimits()
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PERSON_SPEC = StructuredOutput("json_schema", json.dumps(PERSON))
PERSON_TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]})


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return grammar_tokenizer(smollm2_tokenizer, len(smollm2_tokenizer), [EOS])


@pytest.fixture(scope="module")
def person_ids(smollm2_tokenizer):
    return [*smollm2_tokenizer(PERSON_TEXT, add_special_tokens=False).input_ids, EOS]


def test_eos_repeats_after_the_end(tokenizer, person_ids):
    """Past the end only EOS is allowed, as often as it comes (ignore_eos), and rolls back."""
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS, person_ids[:-2])
    assert matcher.valid_prefix([*person_ids[-2:], EOS, EOS, 5]) == 4
    matcher.advance([*person_ids[-2:], EOS, EOS])
    assert matcher.ended and matcher.allowed().nonzero()[0].tolist() == [EOS]
    matcher.rollback(4)
    assert_same_state(matcher, GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS, person_ids[:-2]))


def state(matcher: GrammarMatcher) -> tuple[np.ndarray, list[int], bool]:
    return matcher.allowed(), matcher.forced_tokens(), matcher.ended


def assert_same_state(matcher: GrammarMatcher, reference: GrammarMatcher) -> None:
    (mask, forced, ended), (mask_ref, forced_ref, ended_ref) = state(matcher), state(reference)
    assert np.array_equal(mask, mask_ref)
    assert (forced, ended) == (forced_ref, ended_ref)
    assert matcher.num_tokens == reference.num_tokens


def test_a_valid_instance_is_accepted_to_its_end(tokenizer, person_ids):
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS)
    for token in person_ids[:-1]:
        assert matcher.allowed()[token]
        matcher.advance([token])
    assert matcher.ended
    assert matcher.allowed().nonzero()[0].tolist() == [EOS]  # the grammar forces the end


def test_rollback_equals_a_fresh_matcher_fed_the_committed_log(tokenizer, person_ids):
    """Speculative rounds: advance by a proposal's accepted prefix plus one token, or tentatively
    by a whole proposal and roll back what was rejected; after each round the matcher equals one
    rebuilt from the committed log."""
    rng = random.Random(0)
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS)
    committed = 0
    while committed < len(person_ids):
        proposal = person_ids[committed : committed + rng.randint(1, 6)]
        matcher.advance(proposal)
        accepted = rng.randint(0, len(proposal) - 1)
        matcher.rollback(len(proposal) - accepted - 1)  # keep the accepted drafts and the next token
        committed += accepted + 1
        assert_same_state(matcher, GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS, person_ids[:committed]))


def test_masks_along_a_proposal_are_the_masks_of_each_prefix(tokenizer, person_ids):
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS, person_ids[:3])
    before = state(matcher)
    masks = matcher.masks_along(person_ids[3:8])
    assert masks.shape == (6, tokenizer.vocab_size) and masks.dtype == np.bool_
    for i in range(6):
        prefix = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS, person_ids[: 3 + i])
        assert np.array_equal(masks[i], prefix.allowed())
    after = state(matcher)
    assert np.array_equal(before[0], after[0]) and before[1:] == after[1:]  # the matcher did not move


def test_masks_after_a_rejected_draft_token_allow_everything(tokenizer, smollm2_tokenizer):
    matcher = GrammarMatcher.from_log(StructuredOutput("choice", '["yes", "no"]'), tokenizer, LIMITS)
    rejected = smollm2_tokenizer("maybe", add_special_tokens=False).input_ids[0]
    masks = matcher.masks_along([rejected, rejected])
    assert not masks[0, rejected] and bool(masks[1:].all())
    assert matcher.valid_prefix([rejected]) == 0 and matcher.num_tokens == 0


def test_valid_prefix_cuts_a_proposal_at_its_first_rejected_token(tokenizer, person_ids, smollm2_tokenizer):
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS)
    number = smollm2_tokenizer("42", add_special_tokens=False).input_ids  # ": " then a string
    assert matcher.valid_prefix(person_ids[:3] + number + person_ids[3:6]) == 3
    assert matcher.num_tokens == 0


def test_forced_tokens_are_the_schema_keys_and_punctuation(tokenizer, smollm2_tokenizer, person_ids):
    matcher = GrammarMatcher.from_log(PERSON_SPEC, tokenizer, LIMITS)
    forced = matcher.forced_tokens()
    assert forced and smollm2_tokenizer.decode(forced) == '{"name":'[: len(smollm2_tokenizer.decode(forced))]
    assert forced == person_ids[: len(forced)]
    assert GrammarMatcher.from_log(StructuredOutput("choice", '["yes", "no"]'), tokenizer, LIMITS).forced_tokens() == []


def test_the_forced_token_lookup_follows_the_committed_log(tokenizer, person_ids):
    """The coordinator's forced-token lookup: the tokens the grammar forces after the log, up to
    k; a lookup that starts from a log already grown (a resumed request) proposes what one that
    followed it round by round does."""
    prompt = [1, 5, 9]
    following = ForcedTokenLookup(GrammarMatcher(PERSON_SPEC, tokenizer, LIMITS), len(prompt))
    first = following.lookup(prompt, 16)
    assert first is not None and first.tokens == person_ids[: len(first.tokens)]
    assert following.lookup(prompt, 2) == ForcedMatch(first.tokens[:2])
    rng = random.Random(1)
    committed = 0
    while committed < len(person_ids) - 1:
        committed = min(committed + rng.randint(1, 5), len(person_ids) - 1)
        log = [*prompt, *person_ids[:committed]]
        resumed = ForcedTokenLookup(GrammarMatcher(PERSON_SPEC, tokenizer, LIMITS), len(prompt))
        assert following.lookup(log, 16) == resumed.lookup(log, 16)
    assert following.lookup([*prompt, *person_ids], 16) is None  # after the end: nothing forced


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (StructuredOutput("json_object"), '{"a": [1, 2.5, null], "b": {"c": "d"}}'),
        (StructuredOutput("regex", r"\d{3}-[a-z]+"), "123-abc"),
        (StructuredOutput("choice", '["positive", "negative"]'), "negative"),
        (StructuredOutput("grammar", 'start: "ab" NUM\nNUM: /[0-9]+/'), "ab42"),  # Lark
        (StructuredOutput("grammar", 'root ::= "x" [0-9]+ "y"'), "x12y"),  # GBNF
    ],
)
def test_each_kind_accepts_its_text_and_rejects_others(spec, text, tokenizer, smollm2_tokenizer):
    ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
    matcher = GrammarMatcher.from_log(spec, tokenizer, LIMITS, ids)
    assert matcher.allowed()[EOS]  # the text may end here
    fresh = GrammarMatcher.from_log(spec, tokenizer, LIMITS)
    assert fresh.valid_prefix(smollm2_tokenizer("%%%", add_special_tokens=False).input_ids) == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("json_schema", "{not json"), "structured_output.json_schema must be a JSON schema"),
        (StructuredOutput("json_schema", "[1, 2]"), "a JSON schema is an object or a boolean"),
        (StructuredOutput("json_schema", '{"type": "objekt"}'), "Invalid type: objekt"),
        (StructuredOutput("json_schema", '{"type": "string", "format": "nonsense"}'), "Unknown format: nonsense"),
        (StructuredOutput("json_schema", '{"properties": {"a": {"$ref": "#/defs/x"}}}'), "/defs/x"),
        (StructuredOutput("regex", "(a|b"), "structured_output.regex is not valid"),
        (StructuredOutput("choice", "[]"), "non-empty list of strings"),
        (StructuredOutput("choice", '["a", 1]'), "non-empty list of strings"),
        (StructuredOutput("grammar", "start: foo"), 'unknown name: "foo"'),
        (StructuredOutput("xml", "<a/>"), "kind 'xml' is unknown"),  # type: ignore[arg-type]
    ],
)
def test_invalid_specs_name_the_field_and_the_reason(spec, message, tokenizer):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace("|", r"\|").replace("$", r"\$")):
        GrammarMatcher.from_log(spec, tokenizer, LIMITS)


@pytest.mark.parametrize(
    ("limits", "limit", "message"),
    [
        (GrammarLimits(max_spec_bytes=64), "max_spec_bytes", "the limit is 64 bytes"),
        (GrammarLimits(max_symbols=10), "max_symbols", r"too big \(limit for this grammar: 10\)"),
        (GrammarLimits(max_lexer_fuel=100), "max_lexer_fuel", r"too big \(limit for this grammar: 100\)"),
    ],
)
def test_a_spec_over_a_limit_names_the_limit(limits, limit, message, tokenizer):
    """In the matcher and in the check alike: GrammarTooLarge, which the coordinator turns into a
    message naming its setting."""
    with pytest.raises(GrammarTooLarge, match=message) as err:
        GrammarMatcher.from_log(PERSON_SPEC, tokenizer, limits)
    assert err.value.limit == limit
    with pytest.raises(GrammarTooLarge, match=message) as err:
        PERSON_SPEC.check(tokenizer, limits)
    assert err.value.limit == limit


def test_a_committed_log_off_the_grammar_is_refused(tokenizer, smollm2_tokenizer):
    ids = smollm2_tokenizer("maybe", add_special_tokens=False).input_ids
    with pytest.raises(InvalidArgument, match="does not follow the request's grammar"):
        GrammarMatcher.from_log(StructuredOutput("choice", '["yes", "no"]'), tokenizer, LIMITS, ids)

"""The HTTP API's log-probabilities (:mod:`coordinator.api.logprobs`) on SmolLM2's tokenizer: the
chat and completions shapes, and in a stream each token's entry in the chunk whose text completes
the token's own (multi-byte characters, text held back for a stop string, EOS), fed the messages
the coordinator's :class:`coordinator.api.output.StreamOutput` makes."""

import itertools

import pytest

from coordinator.api.logprobs import MIN_LOGPROB, ChoiceLogprobs, token_texts
from coordinator.api.output import StreamOutput
from specdec.v1 import common_pb2

EOS = 2
PROMPT_IDS = [1, 9690, 198]


def fake_logprobs(position: int, token: int) -> common_pb2.TokenLogprobs:
    """Position ``position``'s, recognisable by its value; the alternatives: the token and 100."""
    return common_pb2.TokenLogprobs(logprob=-position, top_token_ids=[token, 100], top_logprobs=[-position, -50.0])


def messages(tokenizer, token_ids: list[int], stop: list[str]):
    """The GenerateResponses of a stream of ``token_ids`` in rounds of 1, 2 and 3 tokens."""
    output = StreamOutput(tokenizer, PROMPT_IDS, stop, [EOS], len(token_ids) + 8)
    logprobs = [fake_logprobs(i, token) for i, token in enumerate(token_ids)]
    start = 0
    for size in itertools.cycle([1, 2, 3]):
        kept = output.add(token_ids[start : start + size], logprobs[start : start + size])
        start += size
        if response := output.response(kept):
            yield response
        if output.finish:
            return


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("naïve café \u2013 東京 🚀 done", []),  # an en dash among other multi-byte characters
        ("Hello world. END of story", ["END"]),  # the stop string's tokens: text cut, entries at the end
        ("one two, three STOP", ["STOP", "two, th"]),  # text held back while it could be a stop string
    ],
)
def test_a_chunks_entries_are_those_of_the_tokens_whose_text_it_completes(smollm2_tokenizer, text, stop):
    tok = smollm2_tokenizer
    token_ids = [*tok(text, add_special_tokens=False).input_ids, EOS]
    choice = ChoiceLogprobs(tok, PROMPT_IDS, stop, chat=True)
    sent, released, generated = "", 0, 0
    for response in messages(tok, token_ids, stop):
        final, generated = bool(response.finish_reason), generated + len(response.token_ids)
        chunk = choice.add(response.token_ids, response.logprobs, response.text, final)
        sent += response.text
        entries = chunk["content"] if chunk else []
        assert [e["logprob"] for e in entries] == [-i for i in range(released, released + len(entries))]
        released += len(entries)
        if not final:
            assert sent.startswith(tok.decode(token_ids[:released]))  # their text is out
            following = tok.decode(token_ids[: released + 1])  # the next one's is not yet
            assert "\ufffd" in following or not sent.startswith(following) or released == generated
    assert released == generated > 0


def test_completions_shape_offsets_and_the_stop_strings_tokens(smollm2_tokenizer):
    tok, stop = smollm2_tokenizer, ["END"]
    token_ids = tok("Hello wörld. END of story", add_special_tokens=False).input_ids
    choice = ChoiceLogprobs(tok, PROMPT_IDS, stop, chat=False)
    chunks, text, generated = [], "", []
    for response in messages(tok, token_ids, stop):
        text, generated = text + response.text, generated + list(response.token_ids)
        chunks.append(choice.add(response.token_ids, response.logprobs, response.text, bool(response.finish_reason)))
    merged = {key: [v for chunk in chunks if chunk for v in chunk[key]] for key in chunks[-1]}
    sent = len(merged["tokens"])
    assert text == "Hello wörld. " and tok.decode(generated).endswith("END") and sent == len(generated)
    assert merged["tokens"] == token_texts(tok, token_ids[:sent])
    assert merged["token_logprobs"] == [-i for i in range(sent)]
    assert merged["text_offset"] == [min(len(tok.decode(token_ids[:i])), len(text)) for i in range(sent)]
    for i, top in enumerate(merged["top_logprobs"]):  # the alternatives and the token itself
        assert top == {merged["tokens"][i]: -i, token_texts(tok, [100])[0]: -50.0}


def test_chat_entries_carry_token_text_bytes_and_alternatives(smollm2_tokenizer):
    tok = smollm2_tokenizer
    token_ids = [*tok("é", add_special_tokens=False).input_ids, EOS]
    entry = common_pb2.TokenLogprobs(logprob=float("-inf"), top_token_ids=[EOS], top_logprobs=[-0.5])
    chunk = ChoiceLogprobs(tok, PROMPT_IDS, [], chat=True).add(
        token_ids, [entry] * len(token_ids), tok.decode(token_ids[:-1]), final=True
    )
    first, eos = chunk["content"][0], chunk["content"][-1]
    assert first["token"] == token_texts(tok, token_ids[:1])[0] and first["bytes"] == list(first["token"].encode())
    assert first["logprob"] == MIN_LOGPROB  # JSON has no -infinity
    assert eos["token"] == "<|im_end|>" and eos["top_logprobs"] == [
        {"token": "<|im_end|>", "logprob": -0.5, "bytes": list(b"<|im_end|>")}
    ]
    assert ChoiceLogprobs(tok, PROMPT_IDS, [], chat=True).add([], [], "", final=True) is None

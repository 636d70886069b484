"""The coordinator's incremental detokenizer (:mod:`coordinator.api.text`): stop strings and
multi-byte text, on SmolLM2's tokenizer."""

from coordinator.api.text import IncrementalDetokenizer


def test_stop_string_cuts_text_and_holds_back_a_possible_prefix(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("Hello world. END of story", add_special_tokens=False).input_ids
    text = IncrementalDetokenizer(tok, [], ["END"])
    deltas, stopped_at = [], None
    for i, token in enumerate(ids):
        if text.add(token):
            stopped_at = i
            break
        deltas.append(text.take_delta())
    assert stopped_at is not None and tok.decode(ids[: stopped_at + 1]).endswith("END")
    assert "".join(deltas) + text.take_delta(final=True) == "Hello world. "


def test_detokenizer_reassembles_multibyte_text(smollm2_tokenizer):
    source = "naïve café \u2013 東京 🚀"  # an en dash among other multibyte characters
    text = IncrementalDetokenizer(smollm2_tokenizer, [], [])
    pieces = []
    for token in smollm2_tokenizer(source, add_special_tokens=False).input_ids:
        text.add(token)
        pieces.append(text.take_delta())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + text.take_delta(final=True) == source

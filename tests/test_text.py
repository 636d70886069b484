"""The coordinator's incremental detokenizer (:mod:`coordinator.api.text`): stop strings and
multi-byte text, on SmolLM2's tokenizer."""

import random

from coordinator.api.text import IncrementalDetokenizer, StopMatcher


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


def test_stop_matcher_finds_the_first_completed_stop_string_across_pieces():
    matcher = StopMatcher(["abc", "b", ""])
    assert matcher.feed("xa") is None and matcher.held_back() == 1
    assert matcher.feed("bc") == 0  # "b" completes first (before "abc" would): the text is cut before it
    overlapping = StopMatcher(["aab"])
    assert overlapping.feed("aaa") is None and overlapping.held_back() == 2
    assert overlapping.feed("ab") == -1  # "aaaab": the match starts at 2, one before this piece


def test_stop_matcher_matches_like_str_find_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("ab", k=rng.randint(0, 12)))
        matcher, fed, cut = StopMatcher(stops), "", None
        for piece in (text[i : i + 2] for i in range(0, len(text), 2)):
            found = matcher.feed(piece)
            if found is not None:
                cut = len(fed) + found
                break
            fed += piece
        first_end = min((text.find(s) + len(s) for s in stops if s in text), default=None)
        if first_end is None:
            assert cut is None
        else:
            completing = [text.find(s, 0) for s in stops if s in text and text.find(s) + len(s) == first_end]
            assert cut == min(completing), (stops, text)

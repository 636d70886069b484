"""The prompt-size pre-check (coordinator.api.prompt_bound) holds with tokenizers that normalize
text: the least number of tokens it finds from a text's normalized bytes never exceeds the tokens
the tokenizer gives, a text too long for the window is refused untokenized, one that the
normalizer shortens is not refused for its raw bytes, and where the bound would not hold there is
none."""

import hypothesis
import pytest
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

from coordinator.api.prompt_bound import FORCED_SPLIT_BYTES, split_pieces, token_bound
from coordinator.api.request import check_prompt_bytes
from specdec.rpc.errors import InvalidArgument
from specdec.v1 import coordinator_pb2


def with_normalizer(base, normalizer) -> PreTrainedTokenizerFast:
    """``base`` (a fast tokenizer) with ``normalizer`` in front of its model."""
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="module")
def nfkc_tokenizer(smollm2_tokenizer):
    return with_normalizer(smollm2_tokenizer, normalizers.NFKC())


def prompt_error(text: str, tokenizer, window: int) -> str | None:
    try:
        check_prompt_bytes(coordinator_pb2.GenerateRequest(text=text), tokenizer, window)
    except InvalidArgument as err:
        return str(err)
    return None


def test_the_prompt_pre_check_holds_with_a_normalizer(nfkc_tokenizer):
    """A text too long for the window is refused untokenized though the tokenizer normalizes; and
    one that NFKC shortens 3 times (ideographic spaces to ASCII ones, which the byte-level BPE
    takes 81 to a token) fits the window: it is not refused for its raw bytes."""
    bound = token_bound(nfkc_tokenizer)
    assert bound is not None and bound.normalizer is not None
    window = 512
    error = prompt_error("word " * (window * bound.longest_token_bytes), nfkc_tokenizer, window)
    assert error is not None and "context window is 512" in error
    spaces = "\u3000" * (window * bound.longest_token_bytes // 3)
    assert len(spaces.encode()) // bound.longest_token_bytes >= window  # its raw bytes' bound: too long
    assert len(nfkc_tokenizer(spaces).input_ids) < window
    assert prompt_error(spaces, nfkc_tokenizer, window) is None


TRICKY = ["a", " ", "  ", "\t", "e", "\u0301", "\u0323", "Σ", "ﬀ", "\U0001d400", "\ufdfa", "가", "\u1100", "\u1161"]
TRICKY += ["\u11a8", "\uff9e", "カ", "İ", "\u212a", "中", "\uff21", "\u0958", "<|im_end|>", "hello", ".", "é", "ñ"]
NORMALIZERS = {
    "NFC": normalizers.NFC(),
    "NFKC": normalizers.NFKC(),
    "NFD+StripAccents+Lowercase": normalizers.Sequence(
        [normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
    ),
    "Prepend+Replace (Llama 2)": normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
    "Strip": normalizers.Strip(),
}


@pytest.fixture(scope="module")
def normalizing_tokenizers(smollm2_tokenizer) -> dict[str, PreTrainedTokenizerFast]:
    return {name: with_normalizer(smollm2_tokenizer, normalizer) for name, normalizer in NORMALIZERS.items()}


@pytest.mark.parametrize("name", NORMALIZERS)
@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(parts=st.lists(st.sampled_from(TRICKY), max_size=300))
def test_the_bound_is_at_most_the_tokens(normalizing_tokenizers, name, parts):
    """The bound never exceeds the tokens the tokenizer gives; nor does the sum over pieces of 7
    characters (so that a text has many) exceed the normalized text's bytes."""
    tokenizer = normalizing_tokenizers[name]
    bound = token_bound(tokenizer)
    assert bound is not None
    text = "".join(parts)
    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert bound.min_tokens(text) <= tokens
    pieces, forced = split_pieces(text, size=7)
    normalized = sum(len(NORMALIZERS[name].normalize_str(piece).encode()) for piece in pieces)
    splits = max(0, len(pieces) - 1)
    assert normalized - splits * bound.piece_overhead - forced * FORCED_SPLIT_BYTES <= len(
        NORMALIZERS[name].normalize_str(text).encode()
    )


def test_no_bound_where_it_would_not_hold(smollm2_tokenizer):
    """A normalizer that may join text across any split (a regex Replace) leaves the prompt to be
    tokenized: no pre-check, rather than a wrong one."""
    tokenizer = with_normalizer(smollm2_tokenizer, normalizers.Replace(Regex(" {2,}"), " "))
    assert token_bound(tokenizer) is None
    assert prompt_error(" " * 100_000, tokenizer, 512) is None


def test_a_run_of_combining_marks_is_split_with_room_for_what_joins_across(normalizing_tokenizers):
    """Combining marks one after another leave no split where nothing joins: the split is forced,
    and the bound takes off what may join across it."""
    text = "e" + "\u0301\u0323" * 40_000
    pieces, forced = split_pieces(text, size=1000)
    assert forced > 0 and "".join(pieces) == text
    tokenizer = normalizing_tokenizers["NFKC"]
    bound = token_bound(tokenizer)
    assert bound.min_tokens(text) <= len(tokenizer(text, add_special_tokens=False).input_ids)


def test_the_bound_stops_normalizing_once_it_reaches_enough(normalizing_tokenizers):
    bound = token_bound(normalizing_tokenizers["NFKC"])
    text = "\ufdfa" * 1_000_000  # NFKC: 33 bytes each
    assert 10 <= bound.min_tokens(text, enough=10) < bound.min_tokens(text[:100_000])

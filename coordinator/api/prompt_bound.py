"""The least number of tokens a text can have, found without tokenizing it: the coordinator's
pre-check of a prompt's size against the context window.

A token stands for at most L bytes of the text its tokenizer's model is given, L the UTF-8 length of
the longest token string (a byte-level token's string spells each byte in one character of 1 or 2
bytes, a Metaspace one a space in 3), so a text of B such bytes has at least B / L tokens. The text
the model is given is the prompt after the tokenizer's normalizer, which may shorten it (NFKC maps
the 4-byte mathematical letters to ASCII ones, Strip and StripAccents drop characters), so B is
counted on the normalized text. Normalizing costs about 45 ns a byte, but the tokenizers library
holds the GIL while it runs (0.4 s for 8 MiB, whatever thread it runs in), so the text is
normalized in pieces of about 16 K characters, split where no normalizer on the list below joins
a character to what precedes it: before a character that is not a combining mark, not the second
of a canonical composition, and whose compatibility decomposition starts with neither (then NFC,
NFD, NFKC and NFKD compose nothing across the split, and the others act on each character alone).
The pieces' normalized bytes then add up to the whole text's, less what a Prepend adds to each
(and less FORCED_SPLIT_BYTES at a split forced inside a long run of combining marks).

Where the bound would not hold, there is none (None: the prompt is tokenized, which
``--max-request-bytes`` bounds): a normalizer outside NFC, NFD, NFKC, NFKD, Lowercase, Strip,
StripAccents, BertNormalizer, ByteLevel, Nmt, Prepend and a Replace of one character (a Replace of
a longer pattern or a regex can join across a split, Precompiled maps sequences); a pre-tokenizer
that drops text (Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, a Split or
Punctuation that removes what it matches); a model whose one token can stand for more than its
string (WordPiece and WordLevel map a whole unknown word to one token, Unigram fuses unknown
characters, as does BPE with ``fuse_unk`` and no byte fallback); an added token that strips the
whitespace beside it (``lstrip``, ``rstrip``).
"""

import functools
import json
import unicodedata
from dataclasses import dataclass

PIECE_CHARS = 16 * 1024  # characters normalized in one call (about 1 ms of holding the GIL)
LOCAL_NORMALIZERS = frozenset(
    {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "BertNormalizer", "ByteLevel", "Nmt"}
)
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"})
# Hangul vowel and trailing jamo: composed into a syllable with what precedes them (algorithmically:
# the Unicode database lists no decomposition for Hangul syllables)
# Bytes a normalization may save by joining characters across a split inside a run of combining
# marks: a composition turns a character and a mark (at most 4 bytes each) into one of at least 2
# bytes, and at most 3 marks compose onto one character (canonical decompositions have at most 4
# code points); Hangul saves 6 bytes (three jamo, 3 bytes each, into one syllable)
FORCED_SPLIT_BYTES = 32
HANGUL_JOINING = frozenset(map(chr, [*range(0x1161, 0x1176), *range(0x11A8, 0x11C3)]))


@dataclass(frozen=True)
class TokenBound:
    """``longest_token_bytes``: L; ``normalizer``: the tokenizer's (a ``tokenizers`` normalizer)
    or None; ``piece_overhead``: bytes the normalizer may add to every piece whatever its text (a
    Prepend's)."""

    longest_token_bytes: int
    normalizer: object | None = None
    piece_overhead: int = 0

    def min_tokens(self, text: str, enough: int | None = None) -> int:
        """The least number of tokens ``text`` tokenizes to; with ``enough``, as soon as that
        reaches ``enough`` (the rest of the text is not normalized)."""
        longest = self.longest_token_bytes
        if self.normalizer is None:
            return -(-len(text.encode()) // longest)
        pieces, forced = split_pieces(text)
        num_bytes = -forced * FORCED_SPLIT_BYTES
        for i, piece in enumerate(pieces):
            # at most the piece's bytes in the whole text's normalized form: its own, less a Prepend's
            num_bytes += len(self.normalizer.normalize_str(piece).encode()) - (self.piece_overhead if i else 0)  # type: ignore[attr-defined]
            if enough is not None and num_bytes >= enough * longest:
                break
        return max(0, -(-num_bytes // longest))


@functools.cache
def token_bound(tokenizer) -> TokenBound | None:
    """The bound of a Hugging Face fast tokenizer, None where it would not hold (see the module)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    normalizer, overhead = config.get("normalizer"), 0
    if not (_keeps_text(config.get("pre_tokenizer")) and _covers_its_string(config["model"])):
        return None
    if any(added.get("lstrip") or added.get("rstrip") for added in config.get("added_tokens", [])):
        return None
    if normalizer is not None:
        if not _local(normalizer):
            return None
        if _prepends(normalizer):  # at least the bytes a Prepend adds, as the normalizer leaves them
            overhead = len(backend.normalizer.normalize_str("a").encode())
    longest = max(len(token.encode()) for token in tokenizer.get_vocab())
    return TokenBound(longest, backend.normalizer if normalizer is not None else None, overhead)


def _local(normalizer: dict) -> bool:
    """Whether a normalizer (its JSON) acts on each character alone, but for the Unicode
    normalization forms' compositions, a Strip's ends and a Prepend's start."""
    kind = normalizer["type"]
    if kind == "Sequence":
        return all(_local(part) for part in normalizer["normalizers"])
    if kind == "Replace":
        return set(normalizer["pattern"]) == {"String"} and len(normalizer["pattern"]["String"]) == 1
    return kind in LOCAL_NORMALIZERS or kind == "Prepend"


def _prepends(normalizer: dict) -> bool:
    if normalizer["type"] == "Sequence":
        return any(_prepends(part) for part in normalizer["normalizers"])
    return normalizer["type"] == "Prepend"


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer (its JSON) passes on every character of the text."""
    if pre_tokenizer is None:
        return True
    if pre_tokenizer["type"] == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer["pretokenizers"])
    return pre_tokenizer["type"] in KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _covers_its_string(model: dict) -> bool:
    """Whether each of a model's (its JSON) tokens stands for at most its string's characters."""
    if model["type"] == "BPE":
        return model.get("byte_fallback") or not (model.get("fuse_unk") and model.get("unk_token"))
    return model["type"] == "Unigram" and bool(model.get("byte_fallback"))


@functools.cache
def _composed_seconds() -> frozenset[str]:
    """Characters a canonical composition joins to the character before them (the second of a
    canonical decomposition into two), Hangul's vowel and trailing jamo among them."""
    seconds = set(HANGUL_JOINING)
    for code in range(0x110000):
        parts = unicodedata.decomposition(chr(code)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            seconds.add(chr(int(parts[1], 16)))
    return frozenset(seconds)


def _starts_fresh(char: str) -> bool:
    """Whether no normalization joins ``char`` to the characters before it."""
    if char < "\x80":
        return True
    first = unicodedata.normalize("NFKD", char)[0]
    seconds = _composed_seconds()
    return not any(unicodedata.combining(c) or c in seconds for c in (char, first))


def split_pieces(text: str, size: int = PIECE_CHARS) -> tuple[list[str], int]:
    """``text`` in pieces of about ``size`` characters, each after the first starting with a
    character no normalization joins to what precedes it, and how many of the splits were forced
    instead: after ``4 * size`` characters without such a character (combining marks one after
    the other), where up to FORCED_SPLIT_BYTES may be joined across."""
    pieces, start, forced = [], 0, 0
    while len(text) - start > size:
        cut, last = start + size, min(len(text), start + 4 * size)
        while cut < last and not _starts_fresh(text[cut]):
            cut += 1
        if cut < len(text) and not _starts_fresh(text[cut]):
            forced += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [piece for piece in pieces if piece], forced

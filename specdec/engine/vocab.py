"""Vocabulary fingerprints (invariant *same vocabulary*, docs/architecture.md#invariants).

A draft and a target can only cooperate if token id i means the same string on both sides. Each
side hashes its vocabulary, id by id, and the coordinator compares the hashes at session start.
"""

import hashlib
from collections.abc import Iterable, Sequence

from specdec.rpc.errors import InvalidArgument


def vocab_fingerprint(tokens: Iterable[str | bytes]) -> str:
    """SHA-256 (hex) over the token strings in id order, each length-prefixed."""
    digest = hashlib.sha256()
    for token in tokens:
        raw = token.encode("utf-8") if isinstance(token, str) else token
        digest.update(len(raw).to_bytes(4, "little"))
        digest.update(raw)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Fingerprint of a transformers tokenizer, over ids ``0 .. len(tokenizer) - 1``."""
    return vocab_fingerprint(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def check_token_ids(ids: Sequence[int], vocab_size: int | None, field: str) -> None:
    """Raises InvalidArgument unless every id in ``ids`` (the request field ``field``) lies in
    ``[0, vocab_size)``; ``vocab_size`` None (a model-free drafter) only rules out negative ids."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidArgument(f"{field} holds the id {bad}: token ids must lie in {allowed}, the model's vocabulary")

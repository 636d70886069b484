"""Incremental detokenization with stop strings.

Tokens are decoded a few at a time from a sliding window (the offsets technique of Hugging Face
text-generation-inference and vLLM), so a multi-byte character split across tokens is emitted
only once complete, and SentencePiece leading spaces survive. Text that might be the start of a
stop string is held back until it is known not to be one.
"""

from collections.abc import Sequence

# Prompt tokens that seed the decode window, so the first generated token decodes in context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.num_context = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Adds one generated token; True when the text now contains a stop string (the text is
        then cut before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    @property
    def num_decoded(self) -> int:
        """The added tokens whose text is in ``text``: all but those after the last token that
        completed some text (the start of a multi-byte character, a token that decodes to
        nothing), which count once a later token completes it."""
        return self.read_offset - self.num_context

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet returned, minus anything that may still turn into a stop string."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

"""Incremental detokenization with stop strings.

Tokens are decoded a few at a time from a sliding window (the offsets technique of Hugging Face
text-generation-inference and vLLM), so a multi-byte character split across tokens is emitted
only once complete, and SentencePiece leading spaces survive. Text that might be the start of a
stop string is held back until it is known not to be one.

Stop strings are matched as the text grows, one character at a time, by one Knuth-Morris-Pratt
automaton per stop string (Knuth, Morris & Pratt 1977): a token costs time linear in its own text
times the number of stop strings, whatever the length of the text before it, and the automata's
states are the held-back lengths. The coordinator bounds the stop strings' number and length
(``max_stop_strings``, ``max_stop_string_bytes``) before a request runs.
"""

from collections.abc import Sequence

# Prompt tokens that seed the decode window, so the first generated token decodes in context.
_CONTEXT_TOKENS = 5


def _failure_function(pattern: str) -> list[int]:
    """KMP's failure function: entry i is the length of the longest proper prefix of
    ``pattern[: i + 1]`` that is also its suffix."""
    failure = [0] * len(pattern)
    matched = 0
    for i in range(1, len(pattern)):
        while matched and pattern[i] != pattern[matched]:
            matched = failure[matched - 1]
        if pattern[i] == pattern[matched]:
            matched += 1
        failure[i] = matched
    return failure


class StopMatcher:
    """Finds the first stop string in a text fed piece by piece. For each stop string it keeps
    the length of the longest suffix of the text fed so far that is a prefix of it (its KMP
    state), which is also how much text must be held back for it."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self._failure = [_failure_function(s) for s in self.stop]
        self._matched = [0] * len(self.stop)

    def feed(self, text: str) -> int | None:
        """Feeds ``text``; returns the number of its characters that come before the first stop
        string completed in it (the stop string that completes first, the longest of those
        completing at the same character), or None when none completes. Feed nothing after a
        match."""
        for end, char in enumerate(text, start=1):
            starts = [end - len(s) for i, s in enumerate(self.stop) if self._advance(char, i)]
            if starts:
                return min(starts)
        return None

    def _advance(self, char: str, i: int) -> bool:
        """Moves stop string ``i``'s automaton over ``char``; True when the string is complete."""
        pattern, failure, matched = self.stop[i], self._failure[i], self._matched[i]
        while matched and char != pattern[matched]:
            matched = failure[matched - 1]
        if char == pattern[matched]:
            matched += 1
        self._matched[i] = matched
        return matched == len(pattern)

    def held_back(self) -> int:
        """Characters at the end of the text fed so far that may be the start of a stop string."""
        return max(self._matched, default=0)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = StopMatcher(stop)
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
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        cut = self.stop.feed(new)
        if cut is not None:
            self.text = (self.text + new)[: len(self.text) + cut]
            return True
        self.text += new
        return False

    @property
    def num_decoded(self) -> int:
        """The added tokens whose text is in ``text``: all but those after the last token that
        completed some text (the start of a multi-byte character, a token that decodes to
        nothing), which count once a later token completes it."""
        return self.read_offset - self.num_context

    def take_delta(self, final: bool = False) -> str:
        """Text not yet returned, minus anything that may still turn into a stop string."""
        end = len(self.text) if final else len(self.text) - self.stop.held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

"""The HTTP API's log-probabilities: a choice's ``GenerateResponse.logprobs`` in OpenAI's shapes,
each sent with the text of its token.

Shapes: chat completions ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}]}``; (legacy) completions ``{"tokens", "token_logprobs", "top_logprobs"
(a dict per token: its top alternatives and the token itself, so up to ``logprobs`` + 1 entries),
"text_offset"}``. A token's ``token`` is its decoded text as vLLM gives it
(``convert_ids_to_tokens``, then ``convert_tokens_to_string``: part of a multi-byte character
shows as U+FFFD), ``bytes`` that text's UTF-8 bytes; every generated token has an entry, EOS
included (its text is the special token's). Log-probabilities below -9999 are sent as -9999, as
vLLM does (JSON has no -infinity). ``text_offset`` is where the token's text starts in the
choice's text (a token whose text is cut off by a stop string, or has none, at the end of the
text before it).

Alignment in a stream: a message's text may lag its token ids (a multi-byte character not yet
complete, text that could still be a stop string) and EOS has no text, so a chunk carries the
entries of the tokens whose text it completes, not of the tokens its message brought: a token's
entry waits until the text up to the end of its own has been sent, and the choice's last chunk
carries every entry still held back (those of EOS and of a stop string's tokens). Concatenated,
a stream's chunks give the entries of the non-streamed response, in order.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.api.request import prompt_ids
from coordinator.api.text import IncrementalDetokenizer
from specdec.v1 import common_pb2, coordinator_pb2

MIN_LOGPROB = -9999.0  # what a lower log-probability (-inf included) is sent as


@dataclass
class _Token:
    """A generated token, its log-probabilities, and where its text ends in the choice's text
    (None until known)."""

    token_id: int
    logprobs: common_pb2.TokenLogprobs
    end: int | None = None


class ChoiceLogprobs:
    """One choice's entries, in the chat (``chat``) or the completions shape. ``prompt_ids`` and
    ``stop``: the request's, so that the text is decoded as the coordinator decodes it
    (:class:`coordinator.api.text.IncrementalDetokenizer`)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str], chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self._text = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
        self._held: list[_Token] = []  # added, not yet sent
        self._num_decoded = 0  # tokens added whose text end is known
        self._sent_chars = 0  # the choice's text the client has
        self._offset = 0  # where the next token's text starts

    def add(
        self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs], text: str, final: bool
    ) -> dict | None:
        """The ``logprobs`` object of the chunk of one message (``token_ids`` with their
        ``logprobs``, one each, and ``text``; ``final``: the choice's last message); None when it
        has no entries."""
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=True):
            self._held.append(_Token(token_id, token_logprobs))
            self._text.add(token_id)
            completed = self._text.num_decoded - self._num_decoded  # the last ones added: their text is in
            for token in self._held[len(self._held) - completed :]:
                token.end = len(self._text.text)
            self._num_decoded = self._text.num_decoded
        self._sent_chars += len(text)
        ready = 0
        while ready < len(self._held) and (final or self._text_sent(self._held[ready])):
            ready += 1
        sent, self._held = self._held[:ready], self._held[ready:]
        return self._shape(sent) if sent else None

    def _text_sent(self, token: _Token) -> bool:
        return token.end is not None and token.end <= self._sent_chars

    def _shape(self, tokens: list[_Token]) -> dict:
        offsets = []
        for token in tokens:
            offsets.append(min(self._offset, self._sent_chars))
            if token.end is not None:
                self._offset = token.end
        ids = [token_id for token in tokens for token_id in (token.token_id, *token.logprobs.top_token_ids)]
        texts = dict(zip(ids, token_texts(self.tokenizer, ids), strict=True))
        if self.chat:
            return {"content": [_chat_entry(token, texts) for token in tokens]}
        return {
            "tokens": [texts[token.token_id] for token in tokens],
            "token_logprobs": [_logprob(token.logprobs.logprob) for token in tokens],
            "top_logprobs": [_top_dict(token, texts) for token in tokens],
            "text_offset": offsets,
        }


def _top(token: _Token):
    """(id, log-probability) of the token's top alternatives."""
    return zip(token.logprobs.top_token_ids, token.logprobs.top_logprobs, strict=True)


def _chat_entry(token: _Token, texts: dict[int, str]) -> dict:
    entry = _chat_token(texts[token.token_id], token.logprobs.logprob)
    return entry | {"top_logprobs": [_chat_token(texts[i], logprob) for i, logprob in _top(token)]}


def _top_dict(token: _Token, texts: dict[int, str]) -> dict[str, float]:
    """A completions token's ``top_logprobs``: its alternatives' and its own, by text."""
    alternatives = {texts[i]: _logprob(logprob) for i, logprob in _top(token)}
    return alternatives | {texts[token.token_id]: _logprob(token.logprobs.logprob)}


class RequestLogprobs:
    """The :class:`ChoiceLogprobs` of each choice of ``request`` (one that asks for logprobs), in
    the chat (``chat``) or the completions shape, each made when first asked for."""

    def __init__(self, request: coordinator_pb2.GenerateRequest, tokenizer, chat: bool):
        self.prompt_ids, self.stop = prompt_ids(request, tokenizer), list(request.stop)
        self.tokenizer, self.chat = tokenizer, chat
        self._choices: dict[int, ChoiceLogprobs] = {}

    def choice(self, index: int) -> ChoiceLogprobs:
        if index not in self._choices:
            self._choices[index] = ChoiceLogprobs(self.tokenizer, self.prompt_ids, self.stop, self.chat)
        return self._choices[index]


def token_texts(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's decoded text, as vLLM gives it: ``convert_tokens_to_string`` of the token alone."""
    return [tokenizer.convert_tokens_to_string([token]) for token in tokenizer.convert_ids_to_tokens(list(token_ids))]


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

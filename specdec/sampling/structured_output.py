"""What a request's output must match (structured output) and its compilation to a grammar.

A request asks for one of: a JSON schema (OpenAI's ``response_format: json_schema`` and vLLM's
``structured_outputs.json``), any JSON object (``response_format: json_object``), a regular
expression, one of a list of strings (``choice``), or a context-free grammar in Lark or GBNF
(``grammar``), as vLLM's ``structured_outputs``. Each compiles to one llguidance grammar
(https://github.com/guidance-ai/llguidance; why this library: docs/profiles.md#choosing-the-grammar-library),
checked against the target's tokenizer before any token is generated, so that a bad schema or
grammar is an INVALID_ARGUMENT naming the part that failed, never a failure mid-request.

JSON is generated in one fixed layout, as Python's ``json.dumps`` writes it inline (``", "``
between items, ``": "`` after keys, no other whitespace): the layout small chat models write, and
one that leaves no choice of whitespace, so punctuation and the keys of a schema are forced tokens
(jump-forward, :meth:`specdec.sampling.grammar.GrammarMatcher.forced_tokens`) and whitespace cannot loop.

No torch here, so the coordinator (which only validates) can use it; the per-position token masks
are :mod:`specdec.sampling.grammar`.
"""

import json
import sys
from dataclasses import dataclass
from typing import Literal

import llguidance
from llguidance import LLMatcher

from specdec.rpc.errors import InvalidArgument
from specdec.v1 import common_pb2

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what a request may ask a matcher to build: ``max_spec_bytes``, the UTF-8 size of
    the schema, regex, choices or grammar text; ``max_symbols``, the compiled grammar's symbols
    (llguidance's ``max_grammar_size``); ``max_lexer_fuel``, the work of building its lexer
    (llguidance's ``initial_lexer_fuel``, about 50,000 a millisecond, so the default bounds a
    compile near 20 ms). The defaults here are the coordinator's settings' (``--grammar-<field>``,
    docs/settings.md): the coordinator checks every spec against them, and the draft and verify
    services compile what it let through without limits of their own (:data:`UNLIMITED`)."""

    max_spec_bytes: int = 64 * 1024
    max_symbols: int = 500_000
    max_lexer_fuel: int = 1_000_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_symbols, initial_lexer_fuel=self.max_lexer_fuel, verbose_errors=False
        )


# The services' limits: they trust the coordinator, which compiled the same spec against the same
# vocabulary within its limits before any service saw it (so one setting, the coordinator's, bounds
# a grammar everywhere; a client that bypasses the coordinator is not bounded).
UNLIMITED = GrammarLimits(sys.maxsize, sys.maxsize, sys.maxsize)
# How llguidance 1.9 reports a grammar over a limit of LLParserLimits: the field of GrammarLimits
_LIMIT_ERRORS = {
    "grammar size (number of symbols) too big": "max_symbols",
    "initial lexer configuration (grammar) too big": "max_lexer_fuel",
}


class GrammarTooLarge(InvalidArgument):
    """A spec over one of its :class:`GrammarLimits`: ``limit`` names the field."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class StructuredOutput:
    """A request's output constraint. ``kind`` is one of :data:`KINDS`; ``spec`` is the JSON
    schema's text (``json_schema``), the regex, the grammar text (Lark, or GBNF: converted by
    llguidance), or a JSON list of the strings allowed (``choice``); empty for ``json_object``."""

    kind: Kind
    spec: str = ""

    @classmethod
    def from_proto(cls, msg: common_pb2.StructuredOutput) -> "StructuredOutput | None":
        """None when no kind is set (no constraint)."""
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls("choice", json.dumps(list(msg.choice.choices)))
        return cls(kind, "" if kind == "json_object" else getattr(msg, kind))  # type: ignore[arg-type]

    def to_proto(self) -> common_pb2.StructuredOutput:
        if self.kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if self.kind == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=json.loads(self.spec)))
        return common_pb2.StructuredOutput(**{self.kind: self.spec})  # type: ignore[arg-type]

    @property
    def field(self) -> str:
        """The request field it came from, for error messages (``structured_output.regex``)."""
        return f"structured_output.{self.kind}"

    def grammar(self, limits: GrammarLimits) -> str:
        """The llguidance grammar text, not yet compiled against a vocabulary (the matcher,
        :class:`specdec.sampling.grammar.GrammarMatcher`, does that, or :meth:`check`).

        Raises:
            InvalidArgument: unknown kind, or text that is not valid JSON where JSON is expected;
                GrammarTooLarge (an InvalidArgument) for a spec over ``limits.max_spec_bytes``.
        """
        size = len(self.spec.encode())
        if size > limits.max_spec_bytes:
            message = f"{self.field} is {size} bytes: the limit is {limits.max_spec_bytes} bytes; shorten it"
            raise GrammarTooLarge(message, "max_spec_bytes")
        return self._compile()

    def check(self, tokenizer: llguidance.LLTokenizer, limits: GrammarLimits) -> None:
        """Compiles the grammar against ``tokenizer`` within ``limits``. Raises InvalidArgument as
        :meth:`grammar` does, and for a schema, regex or grammar that llguidance rejects;
        GrammarTooLarge for one over a compile limit (its message gives the limit)."""
        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            self.grammar(limits), tokenizer, limits=limits.parser_limits()
        )
        if is_error:
            raise self.invalid(messages[0])

    def invalid(self, reason: str) -> InvalidArgument:
        """The error for a spec llguidance rejects, naming the field: GrammarTooLarge when
        ``reason`` is a limit's."""
        message = f"{self.field} is not valid: {reason.strip()}"
        limit = next((field for text, field in _LIMIT_ERRORS.items() if text in reason), None)
        return InvalidArgument(message) if limit is None else GrammarTooLarge(message, limit)

    def _compile(self) -> str:
        """The llguidance grammar text (not yet checked). Raises InvalidArgument."""
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        if self.kind == "json_schema":
            schema = self._json("a JSON schema (an object)")
            if not isinstance(schema, dict | bool):
                raise InvalidArgument(f"{self.field} is not valid: a JSON schema is an object or a boolean")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        if self.kind == "choice":
            choices = self._json("a JSON list of strings")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise InvalidArgument(f"{self.field} must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            try:
                return llguidance.grammar_from("grammar", self.spec)  # Lark as it is, GBNF converted to Lark
            except ValueError as err:
                raise InvalidArgument(f"{self.field} is not valid: {err}") from None
        raise InvalidArgument(f"structured output kind {self.kind!r} is unknown: use one of {', '.join(KINDS)}")

    def _json(self, what: str):
        try:
            return json.loads(self.spec)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"{self.field} must be {what}; it is not valid JSON: {err}") from None


def grammar_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The llguidance view of a transformers (fast) tokenizer: ``vocab_size`` ids (the model's
    output width; ids past the tokenizer's are never allowed) and the model's EOS ids, which a
    grammar allows where its text may end. Built once per service (about 0.4 s for SmolLM2).
    ``llguidance.hf`` imports transformers, so it is imported here, when a tokenizer is at hand."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)

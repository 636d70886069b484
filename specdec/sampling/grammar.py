"""A request's grammar state over its generated tokens: the allowed-token mask at each position.

One :class:`GrammarMatcher` per session, on each service, wraps an llguidance ``LLMatcher``
compiled from the request's :class:`specdec.sampling.structured_output.StructuredOutput`. It follows the
committed log: :meth:`advance` by committed tokens, :meth:`rollback` by rejected ones, and
:meth:`from_log` rebuilds it from the log alone (failover, a restarted service, a resume), which
gives the state the live matcher has (tests/test_grammar.py). For speculation it gives the masks
along a proposal without moving (:meth:`masks_along`: the target's distribution at each verified
position is masked by the state the tokens before it reach, invariant *lossless under
constraints*, docs/architecture.md#invariants), the valid prefix of a proposal
(:meth:`valid_prefix`, vLLM's ``validate_tokens``), and the tokens the grammar forces
(:meth:`forced_tokens`, jump-forward). :class:`ForcedTokenLookup` proposes those tokens as a
model-free lookup, the coordinator's beside n-gram and suffix (no draft call at all).

No torch here (masks are numpy arrays), so that the coordinator can follow a grammar too; the
services turn a mask into a tensor with ``torch.from_numpy`` (no copy).

Once the grammar's text is complete and nothing may follow (:attr:`ended`), the mask allows the
model's EOS ids only, so a request whose grammar forces the end finishes with ``stop``.
"""

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from specdec.rpc.errors import InvalidArgument
from specdec.sampling.structured_output import GrammarLimits, StructuredOutput


class GrammarMatcher:
    """The grammar state after a session's generated tokens (the prompt is not matched)."""

    def __init__(self, structured_output: StructuredOutput, tokenizer: llguidance.LLTokenizer, limits: GrammarLimits):
        """Compiles ``structured_output`` against ``tokenizer`` (from
        :func:`specdec.sampling.structured_output.grammar_tokenizer`) within ``limits``. Raises
        InvalidArgument for a spec that does not compile or exceeds a limit, naming its field."""
        grammar = structured_output.grammar(limits)
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits.parser_limits())
        if self._matcher.is_error():
            raise structured_output.invalid(self._matcher.get_error())
        self.vocab_size = tokenizer.vocab_size
        self.num_tokens = 0  # tokens consumed
        self._eos_after_end = 0  # of them, EOS tokens after the text's end and its first EOS

    @classmethod
    def from_log(
        cls,
        structured_output: StructuredOutput,
        tokenizer: llguidance.LLTokenizer,
        limits: GrammarLimits,
        generated: Sequence[int] = (),
    ) -> "GrammarMatcher":
        """A matcher compiled from ``structured_output`` and fed the ``generated`` tokens (the
        committed log after the prompt). Raises InvalidArgument for a bad spec or generated tokens
        the grammar rejects."""
        matcher = cls(structured_output, tokenizer, limits)
        matcher.advance(generated)
        return matcher

    def allowed(self) -> np.ndarray:
        """``[V]`` bool: the tokens the grammar allows next (EOS where the text may end)."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def masks_along(self, draft_token_ids: Sequence[int]) -> np.ndarray:
        """``[K + 1, V]`` bool: row i is the mask after ``draft_token_ids[:i]`` (row 0: the mask
        now). Rows after the first draft token the grammar rejects allow everything: the
        acceptance test never reaches them, since that token has probability 0. The matcher is
        left where it was."""
        rows = [self.allowed()]
        consumed = 0
        for token in draft_token_ids:
            if not rows[-1][token]:
                break
            self.advance([token])
            consumed += 1
            rows.append(self.allowed())
        self.rollback(consumed)
        rows += [np.ones(self.vocab_size, dtype=bool)] * (len(draft_token_ids) + 1 - len(rows))
        return np.stack(rows)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here (the matcher stays). Once
        the text is complete, EOS is accepted as often as it comes, as the mask allows it (so a
        request with ``ignore_eos`` goes on with EOS)."""
        token_ids = list(token_ids)
        if self.ended:
            return self._leading_allowed(token_ids)
        valid = self._matcher.validate_tokens(token_ids)
        if 0 < valid < len(token_ids):
            self._matcher.consume_tokens(token_ids[:valid])
            extra = self._leading_allowed(token_ids[valid:]) if self.ended else 0
            self._matcher.rollback(valid)
            valid += extra
        return valid

    def _leading_allowed(self, token_ids: list[int]) -> int:
        """How many leading ``token_ids`` the mask now allows (all the same state: past the end,
        where only EOS is allowed)."""
        allowed = self.allowed()
        return next((i for i, token in enumerate(token_ids) if not allowed[token]), len(token_ids))

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces from here (``{"name": `` at the start of an
        object whose first key is required), in the tokenizer's canonical tokenization; empty
        when the next text is a choice. A proposal, not a certainty: the mask may also allow other
        tokenizations of the same text, so they are verified like any draft token."""
        return self._matcher.compute_ff_tokens()

    @contextlib.contextmanager
    def tentatively(self, token_ids: Sequence[int]) -> Iterator[bool]:
        """Consumes ``token_ids`` for the duration of the block, rolled back after; yields False
        (consuming nothing) when the grammar rejects one of them."""
        valid = self.valid_prefix(token_ids) == len(token_ids)
        if valid:
            self.advance(token_ids)
        try:
            yield valid
        finally:
            if valid:
                self.rollback(len(token_ids))

    def advance(self, token_ids: Sequence[int]) -> None:
        """Consumes committed tokens. Raises InvalidArgument for a token the grammar rejects (a
        committed log that does not follow the grammar: never the case for tokens this matcher
        masked)."""
        token_ids = list(token_ids)
        accepted = self.valid_prefix(token_ids)
        if accepted < len(token_ids):
            raise InvalidArgument(
                f"token {token_ids[accepted]} (position {self.num_tokens + accepted}) does not follow the "
                "request's grammar"
            )
        # llguidance takes the text and the first EOS after it; the EOS tokens after that are
        # counted here: its validate_tokens stops at them, and a rolled-back consume_token of one
        # leaves its state off (llguidance 1.9.1)
        real = 0 if self.ended else self._matcher.validate_tokens(token_ids)
        self._matcher.consume_tokens(token_ids[:real])
        self._eos_after_end += len(token_ids) - real
        self.num_tokens += len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last ``num_tokens`` consumed tokens (0 <= num_tokens <= consumed)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} consumed tokens")
        from_end = min(num_tokens, self._eos_after_end)
        self._eos_after_end -= from_end
        self._matcher.rollback(num_tokens - from_end)
        self.num_tokens -= num_tokens

    @property
    def ended(self) -> bool:
        """True once nothing but EOS may follow (the grammar's text is complete and closed)."""
        return self._matcher.is_stopped()


FORCED = "forced"  # how rounds and metrics name the forced-token lookup


@dataclass(frozen=True)
class ForcedMatch:
    """A :class:`ForcedTokenLookup`'s proposal: ``tokens``, those the grammar forces after the
    committed log. ``n`` = 1: one acceptance estimate, as a lookup's match of one length."""

    tokens: list[int]
    n: int = 1


class ForcedTokenLookup:
    """The tokens a request's grammar forces after its committed log, proposed as a model-free
    lookup (hybrid drafting's, beside n-gram and suffix): a proposal that costs no draft forward
    and no draft call. A proposal like any other: the target verifies it (another tokenization of
    the same text may win), a point mass under sampling.

    ``matcher``: a fresh matcher of the request's grammar (nothing consumed); ``num_prompt_tokens``:
    where the generated part of the committed log starts. It follows the log itself, so a resumed
    request's lookup starts from its stored tokens."""

    def __init__(self, matcher: GrammarMatcher, num_prompt_tokens: int):
        self.matcher, self.num_prompt_tokens = matcher, num_prompt_tokens

    def lookup(self, committed: Sequence[int], k: int) -> ForcedMatch | None:
        """Up to ``k`` tokens the grammar forces after ``committed`` (which must extend the list of
        the previous call); None when it forces none. Raises InvalidArgument for a committed log
        off the grammar (never the case for tokens the target masked)."""
        self.matcher.advance(committed[self.num_prompt_tokens + self.matcher.num_tokens :])
        forced = self.matcher.forced_tokens()[:k]
        return ForcedMatch(forced) if forced else None

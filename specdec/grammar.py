"""A request's grammar state over its generated tokens: the allowed-token mask at each position.

One :class:`GrammarMatcher` per session, on each service, wraps an llguidance ``LLMatcher``
compiled from the request's :class:`specdec.structured_output.StructuredOutput`. It follows the
committed log: :meth:`advance` by committed tokens, :meth:`rollback` by rejected ones, and
:meth:`from_log` rebuilds it from the log alone (failover, a restarted service, a resume), which
gives the state the live matcher has (tests/test_grammar.py). For speculation it gives the masks
along a proposal without moving (:meth:`masks_along`: the target's distribution at each verified
position is masked by the state the tokens before it reach, invariant *lossless under
constraints*, docs/architecture.md#invariants), the valid prefix of a proposal
(:meth:`valid_prefix`, vLLM's ``validate_tokens``), and the tokens the grammar forces
(:meth:`forced_tokens`, jump-forward).

Once the grammar's text is complete and nothing may follow (:attr:`ended`), the mask allows the
model's EOS ids only, so a request whose grammar forces the end finishes with ``stop``.
"""

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.structured_output import GrammarLimits, StructuredOutput


class GrammarMatcher:
    """The grammar state after a session's generated tokens (the prompt is not matched)."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer, limits: GrammarLimits):
        """``grammar``: from :meth:`specdec.structured_output.StructuredOutput.grammar` (already
        checked); ``tokenizer``: from :func:`specdec.structured_output.grammar_tokenizer`."""
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits.parser_limits())
        self.vocab_size = tokenizer.vocab_size
        self.num_tokens = 0  # tokens consumed

    @classmethod
    def from_log(
        cls,
        structured_output: StructuredOutput,
        tokenizer: llguidance.LLTokenizer,
        limits: GrammarLimits,
        generated: Sequence[int] = (),
    ) -> "GrammarMatcher":
        """A matcher compiled from ``structured_output`` and fed the ``generated`` tokens (the
        committed log after the prompt). Raises InvalidArgument for a bad spec (see
        :meth:`StructuredOutput.grammar`) or generated tokens the grammar rejects."""
        matcher = cls(structured_output.grammar(tokenizer, limits), tokenizer, limits)
        matcher.advance(generated)
        return matcher

    def allowed(self) -> torch.Tensor:
        """``[V]`` bool: the tokens the grammar allows next (EOS where the text may end)."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def masks_along(self, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """``[K + 1, V]`` bool: row i is the mask after ``draft_token_ids[:i]`` (row 0: the mask
        now). Rows after the first draft token the grammar rejects allow everything: the
        acceptance test never reaches them, since that token has probability 0. The matcher is
        left where it was."""
        rows = [self.allowed()]
        consumed = 0
        for token in draft_token_ids:
            if not (rows[-1][token] and self._matcher.consume_token(token)):
                break
            consumed += 1
            rows.append(self.allowed())
        self._matcher.rollback(consumed)
        rows += [torch.ones(self.vocab_size, dtype=torch.bool)] * (len(draft_token_ids) + 1 - len(rows))
        return torch.stack(rows)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here (the matcher stays)."""
        if self.ended and token_ids:  # llguidance's validate_tokens answers 0 for EOS once stopped
            return int(bool(self.allowed()[token_ids[0]]))
        return self._matcher.validate_tokens(list(token_ids))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows exactly one way from here (``{"name": `` after the start
        of an object with one required key), empty when the next token is a choice."""
        return self._matcher.compute_ff_tokens()

    def advance(self, token_ids: Sequence[int]) -> None:
        """Consumes committed tokens. Raises InvalidArgument for a token the grammar rejects (a
        committed log that does not follow the grammar: never the case for tokens this matcher
        masked)."""
        if not token_ids:
            return
        accepted = self.valid_prefix(token_ids)
        if accepted < len(token_ids):
            raise InvalidArgument(
                f"token {token_ids[accepted]} (position {self.num_tokens + accepted}) does not follow the "
                "request's grammar"
            )
        self._matcher.consume_tokens(list(token_ids))
        self.num_tokens += accepted

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last ``num_tokens`` consumed tokens (0 <= num_tokens <= consumed)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} consumed tokens")
        self._matcher.rollback(num_tokens)
        self.num_tokens -= num_tokens

    @property
    def ended(self) -> bool:
        """True once nothing but EOS may follow (the grammar's text is complete and closed)."""
        return self._matcher.is_stopped()

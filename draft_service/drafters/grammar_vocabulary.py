"""A model drafter's tokenizer as the grammar library sees it (:class:`GrammarVocabulary`), so that
its proposals are masked by a request's grammar as the target's tokens are."""

import contextlib
from collections.abc import Sequence

from llguidance import LLTokenizer

from specdec.rpc.errors import FailedPrecondition
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import UNLIMITED, grammar_tokenizer


class GrammarVocabulary:
    """A model drafter's tokenizer as the grammar library sees it, one per set of EOS ids (the
    target's, sent with each request), so the draft's masks are the target's. Built at start-up
    for the drafter's own EOS ids, the target's too when they share a vocabulary; another set is
    built at its first structured-output request (about 0.4 s for SmolLM2, the GIL held, so the
    draft's steps wait)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._built: dict[tuple[int, ...], LLTokenizer] = {}
        with contextlib.suppress(ValueError):  # a tokenizer llguidance cannot read: refused per request
            self._vocabulary(tuple(eos_token_ids))

    def matcher(self, sampling: SamplingParams, committed: Sequence[int]) -> GrammarMatcher | None:
        """The request's grammar state after ``committed`` (its generated part); None without
        structured output. Raises InvalidArgument for a spec that does not compile."""
        if sampling.structured_output is None:
            return None
        try:
            vocabulary = self._vocabulary(sampling.eos_token_ids)
        except ValueError as err:
            raise FailedPrecondition(f"the drafter's tokenizer cannot be read by the grammar library: {err}") from None
        generated = committed[sampling.num_prompt_tokens :]
        # no limits of its own: the coordinator checked the spec against its --grammar-* limits
        return GrammarMatcher.from_log(sampling.structured_output, vocabulary, UNLIMITED, generated)

    def _vocabulary(self, eos: tuple[int, ...]) -> LLTokenizer:
        """Raises ValueError for a tokenizer llguidance cannot read."""
        if eos not in self._built:
            self._built[eos] = grammar_tokenizer(self._tokenizer, self.vocab_size, list(eos))
        return self._built[eos]

"""A round's input: the resolved request (:class:`ResolvedRequest`) and how it uses the draft
service (:class:`DraftPlan`), decided once where the request is validated
(:func:`coordinator.api.request.resolve`) and read by every round after."""

from dataclasses import dataclass

from llguidance import LLTokenizer

from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.suffix import DRAFTER_NAME as SUFFIX
from specdec.sampling.grammar import ForcedTokenLookup, GrammarMatcher
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import GrammarLimits

LOOKUPS = (NGRAM, SUFFIX)  # model-free drafters the coordinator runs itself under adaptive K
DEFAULT_LIMITS = GrammarLimits()


@dataclass(frozen=True, kw_only=True)
class DraftPlan:
    """How a request that uses the draft service uses it, decided once where the request is
    resolved (:func:`coordinator.api.request.draft_plan`) and read by the round
    (:mod:`coordinator.speculation.rounds`), its draft client (:mod:`coordinator.speculation.draft_client`)
    and adaptive K. ``drafts_ahead``: a model drafter's proposal for the next round is asked for
    with this round's Verify (``--draft-ahead``). ``hidden_behind_verify``: that draft has
    hardware of its own (not ``--draft-shares-target-cores``), so its forwards ahead overlap the
    verify and adaptive K prices a round by what of them outlasts it (where it shares the
    target's cores they slow the verify instead, and a round is priced at its K forwards).
    ``branches``: outcomes of each verification drafted ahead (``--draft-ahead-branches``; 1
    under sampling, where a branch is hit only when the sampled token is the draft's second
    choice, and where the draft shares the target's cores). ``prefill_with_target``: the draft
    session prefills beside the target's prefill; else (greedy, the draft on the target's cores)
    only once the first token shows the request will use it."""

    drafts_ahead: bool = False
    hidden_behind_verify: bool = False
    branches: int = 1
    prefill_with_target: bool = True


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated GenerateRequest, every default filled in: its prompt's token ids, the most
    tokens it may generate, its sampling, stop strings, K and drafter, and whether K is chosen
    every round (``adaptive``)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    num_speculative_tokens: int  # the fixed K, or the adaptive choice's largest K
    drafter: str
    adaptive: bool
    ignore_eos: bool = False
    # adaptive K with structured output and grammar-aware drafting: the target's vocabulary as the
    # grammar library sees it, for the coordinator's forced-token lookup (None: no such lookup)
    grammar_tokenizer: LLTokenizer | None = None
    grammar_limits: GrammarLimits = DEFAULT_LIMITS
    draft: DraftPlan = DraftPlan()  # how it uses the draft service (when it does: uses_draft_service)
    # the partition of the services' shared caches it uses (coordinator.api.cache_salt): set by the
    # coordinator from the caller's owner and the request's cache_salt, never the API key itself
    cache_salt: str = ""

    @property
    def max_length(self) -> int:
        """The most tokens its sessions hold: the prompt's and the most it may generate (what
        placement weighs a session by)."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def uses_draft_service(self) -> bool:
        """False for plain decode, for an adaptive request with a model-free drafter (ngram or
        suffix: the coordinator runs the lookup itself), and when the draft service was never
        reached (no drafter)."""
        return (
            self.num_speculative_tokens > 0 and bool(self.drafter) and not (self.adaptive and self.drafter in LOOKUPS)
        )

    def forced_token_lookup(self) -> ForcedTokenLookup | None:
        """A new forced-token lookup over the request's grammar (see ``grammar_tokenizer``)."""
        spec = self.sampling.structured_output
        if self.grammar_tokenizer is None or spec is None:
            return None
        matcher = GrammarMatcher(spec, self.grammar_tokenizer, self.grammar_limits)
        return ForcedTokenLookup(matcher, len(self.prompt_ids))

"""A transformers causal LM as the draft (for example Qwen2.5-0.5B drafting for Qwen2.5-7B),
batched like the target: its sessions share one KV store (:class:`specdec.engine.ragged_lm.RaggedLM`, within
its budget of ``kv_cache_max_bytes``) and one engine loop; on a CPU its linear layers run on oneDNN, as
the target's (:mod:`specdec.engine.cpu_linear`)."""

from draft_service.drafters.contract import Drafter
from draft_service.drafters.grammar_vocabulary import GrammarVocabulary
from draft_service.drafters.model_drafting import ModelDraftSession
from specdec.engine.cpu_linear import pack_linears
from specdec.engine.engine import Engine
from specdec.engine.kv import SequenceKV
from specdec.engine.models import context_window, load_causal_lm
from specdec.engine.prefix_cache import DEFAULT_MAX_TOKENS
from specdec.engine.ragged_lm import RaggedLM
from specdec.engine.vocab import tokenizer_fingerprint
from specdec.sampling.sampling_params import SamplingParams


class TransformersDrafter(Drafter):
    """``max_num_seqs`` proposals share a step at most, of ``max_num_batched_tokens`` new tokens
    (prefill chunks fill what proposals leave); ``prefix_cache_max_tokens`` and
    ``kv_cache_max_bytes`` as :class:`specdec.engine.ragged_lm.RaggedLM`'s (None: prefix caching off; 0:
    the automatic budget)."""

    name = "transformers"
    engine: Engine  # a model drafter always has one

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        prefix_cache_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        kv_cache_max_bytes: int = 0,
    ):
        self.model = model_name
        self.vocab_fingerprint = tokenizer_fingerprint(tokenizer)
        self.window = context_window(model)
        self.lm = RaggedLM(
            model,
            prefix_cache_max_tokens=prefix_cache_max_tokens,
            kv_cache_max_bytes=kv_cache_max_bytes,
            name="draft service's transformers drafter",
        )
        self.engine = Engine(self.lm, max_num_seqs, max_num_batched_tokens, name=self.name)
        eos = model.generation_config.eos_token_id
        self.vocabulary = GrammarVocabulary(tokenizer, self.lm.vocab_size, [eos] if isinstance(eos, int) else eos or [])

    @classmethod
    def load(
        cls,
        spec: str,
        dtype: str = "auto",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        prefix_cache_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        kv_cache_max_bytes: int = 0,
    ) -> "TransformersDrafter":
        model, tokenizer = load_causal_lm(spec, dtype=dtype)
        pack_linears(model)  # a draft's rounding decides nothing: the target's acceptance test does
        return cls(
            model, tokenizer, spec, max_num_seqs, max_num_batched_tokens, prefix_cache_max_tokens, kv_cache_max_bytes
        )

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> ModelDraftSession:
        kv_cache = SequenceKV(self.lm, cache_salt, owner)
        return ModelDraftSession(sampling, kv_cache, self.window, self.engine, self.vocabulary)

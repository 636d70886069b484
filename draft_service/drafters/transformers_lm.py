"""A transformers causal LM as the draft (for example Qwen2.5-0.5B drafting for Qwen2.5-7B)."""

import threading

from draft_service.drafters.base import Drafter, ModelDraftSession
from specdec.kv import KVCachedLM
from specdec.models import context_window, load_causal_lm
from specdec.sampling import SamplingParams
from specdec.vocab import tokenizer_fingerprint


class TransformersDrafter(Drafter):
    name = "transformers"

    def __init__(self, model, tokenizer, model_name: str):
        self.lm_model = model
        self.model = model_name
        self.vocab_fingerprint = tokenizer_fingerprint(tokenizer)
        self.lock = threading.Lock()

    @classmethod
    def load(cls, spec: str, dtype: str = "auto") -> "TransformersDrafter":
        model, tokenizer = load_causal_lm(spec, dtype=dtype)
        return cls(model, tokenizer, spec)

    def new_session(self, sampling: SamplingParams) -> ModelDraftSession:
        return ModelDraftSession(sampling, KVCachedLM(self.lm_model, self.lock), context_window(self.lm_model))

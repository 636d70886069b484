"""A GGUF model run by llama.cpp (llama-cpp-python) as the draft.

The default draft is the target's own weights quantized to Q4_1 (a quantized self-draft, as in
ML-SpecQD, Georganas et al. 2025). Each session owns a llama.cpp context (its KV cache); contexts
are pooled and reused, the model file is memory-mapped once by the OS.
"""

import threading
from collections.abc import Sequence

import llama_cpp
import numpy as np
import torch

from draft_service.drafters.base import Drafter, ModelDraftSession
from specdec.kv import KVState
from specdec.models import resolve_model
from specdec.sampling import SamplingParams
from specdec.vocab import vocab_fingerprint


class LlamaCppKV(KVState):
    """A llama.cpp context as a :class:`KVState`. Rollback moves ``n_tokens`` back; the next
    ``eval`` removes the KV beyond it (``llama_memory_seq_rm``). ``cache_bytes`` is the context's
    whole KV buffer, which llama.cpp allocates for its ``n_ctx`` tokens up front."""

    def __init__(self, llm: llama_cpp.Llama, cache_bytes: int):
        super().__init__()
        self.llm = llm
        self._cache_bytes = cache_bytes
        llm.reset()

    def rollback(self, length: int) -> None:
        if length < len(self.cached_tokens):
            self.llm.n_tokens = length
            del self.cached_tokens[length:]

    def _forward(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        if num_logits != 1:
            raise ValueError("llama.cpp contexts here keep the last position's logits only")
        self.llm.eval(list(tokens))
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(logits, shape=(1, self.llm.n_vocab())).copy())

    def cache_bytes(self) -> int:
        return self._cache_bytes


def kv_buffer_bytes(llm: llama_cpp.Llama) -> int:
    """The KV buffer of one llama.cpp context, in bytes: ``n_ctx`` x layers x (key + value) x
    KV heads x head size (hidden size / heads) x 2 bytes (llama.cpp's default f16 cache). An
    estimate from the model's shape: models whose head size differs from hidden / heads, or with
    sliding-window layers, allocate otherwise."""
    model = llm.model
    head_size = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
    per_token = llama_cpp.llama_model_n_layer(model) * 2 * llama_cpp.llama_model_n_head_kv(model) * head_size * 2
    return llm.n_ctx() * per_token


class LlamaCppSession(ModelDraftSession):
    def __init__(self, sampling: SamplingParams, drafter: "LlamaCppDrafter"):
        super().__init__(sampling, LlamaCppKV(drafter.acquire_context(), drafter.context_kv_bytes), drafter.n_ctx)
        self.drafter = drafter

    def close(self) -> None:
        if self.kv is not None:
            self.drafter.release_context(self.kv.llm)
        super().close()


class LlamaCppDrafter(Drafter):
    """Args: ``spec`` a .gguf path or ``smollm2``; ``n_ctx`` the context window in tokens per
    session; ``n_threads`` CPU threads (0 = llama.cpp's default); ``n_gpu_layers`` layers
    offloaded to the GPU (-1 = all) when llama-cpp-python was built with CUDA."""

    name = "llama-cpp"

    def __init__(self, spec: str, n_ctx: int = 4096, n_threads: int = 0, n_gpu_layers: int = 0):
        self.model = spec
        self.path = resolve_model(spec).gguf_path
        self.n_ctx = n_ctx
        self._llama_kwargs = dict(
            n_ctx=n_ctx, n_threads=n_threads or None, n_gpu_layers=n_gpu_layers, verbose=False
        )
        self._idle: list[llama_cpp.Llama] = []
        self._lock = threading.Lock()
        first = self.acquire_context()
        vocab = first._model  # the loaded vocabulary, read through llama-cpp-python's model wrapper
        self.vocab_fingerprint = vocab_fingerprint(vocab.token_get_text(i) for i in range(first.n_vocab()))
        self.context_kv_bytes = kv_buffer_bytes(first)
        self.release_context(first)

    def acquire_context(self) -> llama_cpp.Llama:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return llama_cpp.Llama(self.path, **self._llama_kwargs)

    def release_context(self, llm: llama_cpp.Llama) -> None:
        with self._lock:
            self._idle.append(llm)

    def new_session(self, sampling: SamplingParams) -> LlamaCppSession:
        return LlamaCppSession(sampling, self)

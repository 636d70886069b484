from pydantic import Field, model_validator

from specdec.engine.model_files import DEFAULT_MODEL
from specdec.engine.prefix_cache import DEFAULT_MAX_TOKENS
from specdec.settings import CommaSeparated, SessionServiceSettings

DRAFTERS = ("llama-cpp", "transformers", "ngram", "suffix")  # the drafters a draft service can load


class DraftSettings(SessionServiceSettings):
    """Settings of ``specdec serve draft`` (environment prefix ``SPECDEC_DRAFT_``)."""

    model_config = SessionServiceSettings.model_config | {"env_prefix": "SPECDEC_DRAFT_"}

    port: int = Field(50052, description="gRPC port.")
    drafters: CommaSeparated = Field(
        ["llama-cpp", "ngram"],
        description="Drafters to host, comma-separated: llama-cpp, transformers, ngram, suffix.",
    )
    default_drafter: str = Field(
        "llama-cpp",
        description="Drafter used when a request names none; one of drafters, or the service does not start.",
    )
    llama_cpp_model: str = Field(
        DEFAULT_MODEL, description="GGUF file for the llama-cpp drafter ('smollm2' = the bundled SmolLM2 Q4_1)."
    )
    llama_cpp_requantize: str = Field(
        "q8_0",
        description="Re-quantize the GGUF once (cached under SPECDEC_CACHE_DIR) to this llama.cpp type "
        "before loading: q8_0, q4_0 or f16; '' loads the file as it is. The bundled Q4_1 has no fast CPU kernels: "
        "as Q8_0 it prefills about 1.5-1.8x and decodes up to 1.5x faster on a CPU, and drafts as well.",
    )
    llama_cpp_n_ctx: int = Field(4096, description="llama.cpp context window per session, in tokens.")
    llama_cpp_n_threads: int = Field(0, description="llama.cpp CPU threads; 0 = its default.")
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="CPU niceness of every thread of the service, set at start (Linux). Where the draft runs on "
        "the target's cores (one machine, no device of its own; the coordinator's draft_shares_target_cores), 19 "
        "leaves the draft only the CPU the target's steps do not take: those run on threads that wait for each "
        "other, so a draft thread on one of their cores slows a whole step. The price at batch 1: drafting ahead "
        "then waits for the target's step (measured in docs/architecture.md, Serving under load). "
        "specdec bench concurrency starts the draft at 19 (specdec bench ceiling at 0).",
    )
    llama_cpp_n_gpu_layers: int = Field(0, description="Layers llama.cpp offloads to the GPU (-1 = all).")
    llama_cpp_max_num_seqs: int = Field(
        16,
        ge=1,
        le=256,
        description="Sessions the llama-cpp drafter holds at once, one llama.cpp sequence each "
        "(n_seq_max; their KV, n_ctx tokens each, is allocated up front; more get RESOURCE_EXHAUSTED); also the "
        "most proposals one batched step takes.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Prefix caching for the model drafters: a prefill reuses the KV of the longest prefix of its "
        "context that an earlier or a concurrent session of the same cache salt (the tenant's partition, sent by "
        "the coordinator) computed. llama-cpp: token by token, from the sequences "
        "of freed sessions (kept until a new session takes their sequence) or of live ones; transformers: whole "
        "blocks of 16 committed tokens, bounded by prefix_cache_max_tokens.",
    )
    prefix_cache_max_tokens: int = Field(
        DEFAULT_MAX_TOKENS,
        ge=0,
        description="Tokens the transformers drafter's prefix cache keeps for sessions that are gone (whole "
        "blocks of 16: rounded down), least recently released evicted first; it lives in KV blocks no session "
        "uses and never makes the KV pool grow (0: only sessions open at once share). The llama-cpp drafter "
        "keeps freed sessions' sequences instead, up to llama_cpp_max_num_seqs.",
    )
    kv_cache_max_bytes: int = Field(
        0,
        ge=0,
        description="KV cache budget of the transformers drafter, bytes: its paged KV pool grows up to it and never "
        "past it; a Prefill whose context's KV it cannot hold (1% kept free for the running sessions to grow) gets "
        "RESOURCE_EXHAUSTED, a running session that cannot grow preempts the most recently admitted one (its next "
        "Propose gets NOT_FOUND: the coordinator prefills it again or goes on without the draft), and the pool "
        "shrinks back as sessions end. 0 = automatic: 0.9 of the GPU memory free after the model loads, or on a CPU "
        "0.4 of the memory available then (MemAvailable, or a cgroup's limit if lower). The llama-cpp drafter has "
        "none: llama.cpp allocates llama_cpp_n_ctx x llama_cpp_max_num_seqs tokens of KV up front (x its bytes per "
        "token: layers x 2 x KV heads x head size x 2 bytes, f16; SmolLM2: 4096 x 16 x 23 KB = 1.5 GB).",
    )
    transformers_model: str = Field(
        DEFAULT_MODEL, description="Hugging Face id, folder or .gguf for the transformers drafter."
    )
    transformers_dtype: str = Field(
        "auto", description="dtype of the transformers drafter: auto, float32, bfloat16 or float16."
    )
    ngram_min: int = Field(1, description="Shortest suffix n-gram the ngram drafter matches.")
    ngram_max: int = Field(3, description="Longest suffix n-gram the ngram drafter matches (tried first).")
    suffix_max_depth: int = Field(
        24, description="Depth in tokens of the suffix drafter's trees (bounds match plus proposal length)."
    )
    suffix_max_spec_factor: float = Field(
        1.0, description="A suffix match of n tokens proposes at most this times n tokens."
    )
    suffix_min_token_prob: float = Field(
        0.1, description="Lowest estimated probability of a suffix drafter's proposed token (running product)."
    )
    suffix_max_cached_requests: int = Field(
        256,
        description="Outputs the suffix drafter's shared cache holds over all its partitions, the oldest of the "
        "partition holding most evicted first (0: off).",
    )
    suffix_max_cached_tokens: int = Field(
        16384,
        description="Tokens the suffix drafter's shared cache holds over all its partitions, the oldest output of "
        "the partition holding most evicted first.",
    )
    suffix_max_cache_partitions: int = Field(
        64,
        ge=1,
        description="Partitions of the suffix drafter's shared cache (one per cache salt: a tenant's, or one a "
        "request names); a new one drops the least recently used whole. A session drafts only from its own "
        "partition's outputs.",
    )
    grammar_aware_drafting: bool = Field(
        True,
        description="With structured output, the model drafters draft under the request's grammar: their logits "
        "masked as the target's, and the tokens the grammar forces proposed without a forward (jump-forward). "
        "Off: they draft as without it, and the verify service cuts each proposal after its first token the "
        "grammar rejects (vLLM's and SGLang's behaviour); for comparison (specdec bench structured).",
    )
    proactive_drafting: bool = Field(
        True,
        description="After answering a Propose, a model drafter drafts the Propose the coordinator sends next if "
        "the whole proposal is accepted (SpecEdge's proactive drafting), and answers it with that at once: the "
        "draft's forwards leave the round trip that carries the next proposal, which a network between the services "
        "lengthens. A miss costs the drafter the forwards it cancels (they share its batched steps). Off: a Propose "
        "is drafted when it arrives. Not with structured output.",
    )

    @model_validator(mode="after")
    def _default_drafter_hosted(self):
        """Fails the start, before any model loads, when default_drafter is not among drafters: a
        ValueError naming both settings and what to change."""
        if self.default_drafter in self.drafters:
            return self
        fixes = []
        if self.default_drafter in DRAFTERS:
            fixes.append(f"add it (--drafters {','.join([*self.drafters, self.default_drafter])})")
        if self.drafters:
            fixes.append("set --default-drafter to one it lists")
        if not fixes:  # a name that is no drafter, and none listed
            fixes.append(f"list drafters of {', '.join(DRAFTERS)} and set --default-drafter to one of them")
        raise ValueError(
            f"{self.named('default_drafter')} is {self.default_drafter!r}, a drafter {self.named('drafters')} does "
            f"not list (it lists {','.join(self.drafters) or 'none'}): {', or '.join(fixes)}"
        )

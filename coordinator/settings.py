from pydantic import Field, model_validator

from specdec.models import DEFAULT_MODEL
from specdec.ngram import NgramIndex
from specdec.settings import ServiceSettings


class CoordinatorSettings(ServiceSettings):
    """Settings of ``specdec serve coordinator`` (environment prefix ``SPECDEC_COORDINATOR_``)."""

    model_config = ServiceSettings.model_config | {"env_prefix": "SPECDEC_COORDINATOR_"}

    port: int = Field(50051, description="gRPC port of the public Generate API.")
    draft_address: str = Field("127.0.0.1:50052", description="host:port of the draft service.")
    verify_address: str = Field("127.0.0.1:50053", description="host:port of the verify service.")
    tokenizer: str = Field(
        DEFAULT_MODEL,
        description="The target's tokenizer (same spec as the verify service's --model); checked "
        "against the target's vocabulary fingerprint.",
    )
    adaptive: bool = Field(
        True, description="Choose K every round for requests that set no num_speculative_tokens "
        "(0 = plain decode when speculation does not pay); off: they get num_speculative_tokens.",
    )
    max_num_speculative_tokens: int = Field(8, description="Largest K the adaptive choice makes.")
    probe_interval: int = Field(
        16, description="While adaptive K falls back to plain decode, every this many rounds a 2-token "
        "proposal probes whether speculation pays again.",
    )
    hybrid: bool = Field(
        True, description="Under adaptive K, let the coordinator's own n-gram prompt lookup compete "
        "with the request's drafter every round (hybrid drafting); off: the drafter and plain decode only.",
    )
    ngram_min: int = Field(1, description="Shortest suffix n-gram the coordinator's own prompt lookup (hybrid drafting under adaptive K) matches.")
    ngram_max: int = Field(3, description="Longest suffix n-gram the coordinator's own prompt lookup matches (tried first).")
    num_speculative_tokens: int = Field(4, description="K of requests that set none, when adaptive is off.")
    default_max_new_tokens: int = Field(128, description="max_new_tokens when a request sets none.")
    max_new_tokens_limit: int = Field(4096, description="Largest max_new_tokens a request may ask for.")
    rpc_timeout_s: float = Field(30.0, description="Deadline of every other call to the draft and verify services (Propose, Verify, Decode, GetInfo, Release), seconds.")
    prefill_timeout_s: float = Field(120.0, description="Deadline of each Prefill call, seconds.")

    @model_validator(mode="after")
    def _ngram_bounds(self):
        NgramIndex(self.ngram_min, self.ngram_max)  # raises ValueError for bad bounds
        return self

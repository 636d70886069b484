from pydantic import Field

from specdec.models import DEFAULT_MODEL
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
    num_speculative_tokens: int = Field(4, description="Default K, draft tokens per round.")
    default_max_new_tokens: int = Field(128, description="max_new_tokens when a request sets none.")
    max_new_tokens_limit: int = Field(4096, description="Largest max_new_tokens a request may ask for.")
    rpc_timeout_s: float = Field(30.0, description="Deadline of every other call to the draft and verify services (Propose, Verify, Decode, GetInfo, Release), seconds.")
    prefill_timeout_s: float = Field(120.0, description="Deadline of each Prefill call, seconds.")

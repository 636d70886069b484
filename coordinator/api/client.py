"""The public client of the coordinator's Generate API (used by ``specdec generate``, the
benchmark, the HTTP API and the tests). The coordinator's own clients of the draft and verify
services are :mod:`coordinator.speculation.upstream`."""

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.rpc.server import GRPC_OPTIONS
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

FINISH_REASONS = {coordinator_pb2.FINISH_REASON_STOP: "stop", coordinator_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass
class Completion:
    """A finished stream (one choice's): generated ids, their log-probabilities (one per id when
    the request asked for them), text, finish reason ("stop" / "length") and metrics."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    metrics: coordinator_pb2.RequestMetrics | None = None
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)

    def add(self, response: coordinator_pb2.GenerateResponse) -> None:
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.text += response.text
        if response.finish_reason:
            self.finish_reason = FINISH_REASONS[response.finish_reason]
            self.metrics = response.metrics

    def to_json(self) -> dict:
        """The completion as JSON (``specdec generate --json``): ``logprobs`` only when it has them."""
        metrics = MessageToDict(
            self.metrics or coordinator_pb2.RequestMetrics(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        out = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason, "metrics": metrics}
        if self.logprobs:
            out["logprobs"] = [
                MessageToDict(logprobs, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                for logprobs in self.logprobs
            ]
        return out


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to ``address``: over TLS with ``credentials`` (see
    :func:`specdec.rpc.tls.channel_credentials`), else plaintext."""
    if credentials is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)


def stream(
    address: str,
    request: coordinator_pb2.GenerateRequest,
    timeout_s: float | None = None,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[coordinator_pb2.GenerateResponse]:
    """Streams a Generate call, with ``api_key`` when the coordinator requires one, over TLS with
    ``credentials``. Raises grpc.RpcError with the coordinator's status on failure (UNAVAILABLE
    when the TLS handshake fails: plaintext to a TLS port, a certificate the CA did not sign)."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with channel(address, credentials) as channel_:
        yield from coordinator_pb2_grpc.CoordinatorServiceStub(channel_).Generate(
            request, timeout=timeout_s, metadata=metadata
        )


def generate(
    address: str,
    request: coordinator_pb2.GenerateRequest,
    timeout_s: float | None = None,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Completion:
    """Runs a Generate call of one choice to the end and returns the whole completion. Raises
    ValueError for a request with n > 1 (:func:`generate_choices` runs those)."""
    if request.n > 1:
        raise ValueError(f"the request asks for n = {request.n} choices: run it with generate_choices")
    [completion] = generate_choices(address, request, timeout_s, api_key, credentials)
    return completion


def generate_choices(
    address: str,
    request: coordinator_pb2.GenerateRequest,
    timeout_s: float | None = None,
    api_key: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> list[Completion]:
    """Runs a Generate call to the end and returns each choice's completion, by index (one when n
    is unset)."""
    completions: dict[int, Completion] = {}
    for response in stream(address, request, timeout_s, api_key, credentials):
        completions.setdefault(response.index, Completion()).add(response)
    return [completions[index] for index in sorted(completions)]

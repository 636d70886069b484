"""A client of the standard gRPC health service (``grpc.health.v1.Health/Check``) that every
specdec server runs: ``specdec up``'s readiness check and ``specdec health``, the exec probe the
Kubernetes tls component runs (the kubelet's own gRPC probe speaks no TLS)."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_status(
    address: str,
    service: str = "",
    timeout_s: float = 5.0,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str = "",
) -> int:
    """The serving status (``health_pb2.HealthCheckResponse.ServingStatus``) ``address`` reports
    for ``service`` ("": the server as a whole), asked over a new connection: over TLS with
    ``credentials`` (plaintext without), the server's certificate checked against ``server_name``
    when given (else the host of ``address``). Raises grpc.RpcError when no answer came within
    ``timeout_s`` seconds, connecting included (UNAVAILABLE: nothing listening, a TLS handshake that
    failed; DEADLINE_EXCEEDED), or the server does not know ``service`` (NOT_FOUND)."""
    options: list[tuple[str, int | str]] = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if credentials:
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    with channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s).status


def status_name(status: int) -> str:
    """``1`` -> ``"SERVING"``."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

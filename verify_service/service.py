"""The VerifyService gRPC servicer and its entry point (``specdec serve verify``)."""

import time

import torch

from specdec.errors import grpc_errors
from specdec.prom import ServiceMetrics
from specdec.sampling import SamplingParams
from specdec.server import RunningService, start_service
from specdec.timing import ms_since
from specdec.sessions import SessionRegistry
from specdec.v1 import verify_pb2, verify_pb2_grpc
from specdec.wire import decode_distributions
from verify_service.settings import VerifySettings
from verify_service.target import Target, TargetSession


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, target: Target, sessions: SessionRegistry[TargetSession], metrics: ServiceMetrics):
        self.target = target
        self.sessions = sessions
        self.metrics = metrics

    def GetInfo(self, request, context):
        t = self.target
        return verify_pb2.VerifyServiceGetInfoResponse(
            model=t.name,
            vocab_fingerprint=t.vocab_fingerprint,
            vocab_size=t.vocab_size,
            max_context_length=t.max_context_length,
            eos_token_ids=t.eos_token_ids,
            max_num_speculative_tokens=t.max_num_speculative_tokens,
            verify_ms=t.verify_ms,
        )

    @grpc_errors
    def Prefill(self, request, context):
        start = time.perf_counter()
        sampling = SamplingParams.from_proto(request.sampling)
        self.sessions.open(
            request.session_id, lambda: self.target.new_session(request.token_ids, sampling),
            abandoned=lambda: not context.is_active(),
        )
        return verify_pb2.VerifyServicePrefillResponse(compute_ms=ms_since(start))

    @grpc_errors
    def Verify(self, request, context):
        start = time.perf_counter()
        with self.sessions.use(request.session_id) as session:
            draft_probs = None
            if request.draft_distributions:
                draft_probs = decode_distributions(request.draft_distributions, self.target.vocab_size)
            n, token = session.verify(list(request.draft_token_ids), draft_probs)
        return verify_pb2.VerifyResponse(
            num_accepted=n, next_token_id=token, compute_ms=ms_since(start)
        )

    @grpc_errors
    def Decode(self, request, context):
        start = time.perf_counter()
        with self.sessions.use(request.session_id) as session:
            _, token = session.verify([], None)
        return verify_pb2.DecodeResponse(token_id=token, compute_ms=ms_since(start))

    def Release(self, request, context):
        self.sessions.release(request.session_id)
        return verify_pb2.VerifyServiceReleaseResponse()


def build(settings: VerifySettings, target: Target | None = None) -> RunningService:
    """Loads the target (unless given) and starts the server."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    target = target or Target.load(
        settings.model, settings.dtype, settings.device_map, settings.max_num_speculative_tokens
    )
    sessions = SessionRegistry(settings.max_sessions, settings.session_idle_timeout_s)
    servicer = VerifyServicer(target, sessions, ServiceMetrics())

    return start_service(
        servicer,
        verify_pb2_grpc.add_VerifyServiceServicer_to_server,
        verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name,
        sessions,
        settings,
    )


def main(settings: VerifySettings) -> None:
    build(settings).serve_until_signal()

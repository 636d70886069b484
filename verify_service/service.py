"""The VerifyService gRPC servicer and its entry point (``specdec serve verify``)."""

import time

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec.engine import host_memory
from specdec.engine.engine import StepStats
from specdec.engine.ragged_lm import OverBudget
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.delay_hook import delayed_starters, parse_delays
from specdec.rpc.errors import FailedPrecondition, grpc_errors
from specdec.rpc.server import RunningService, start_service
from specdec.rpc.service_load import service_load
from specdec.rpc.sessions import SessionRegistry
from specdec.rpc.step_server import Reply, StepCalls, wait_for_reply
from specdec.rpc.wire import decode_distributions
from specdec.sampling.sampling_params import SamplingParams
from specdec.timing import ms_since
from specdec.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.settings import VerifySettings
from verify_service.target import EngineLimits, Target, TargetSession

SERVICE = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


def step_stats(stats: StepStats) -> common_pb2.StepStats:
    """The proto of a call's :class:`specdec.engine.engine.StepStats`; also set on the call's span."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "specdec.step.num_seqs": stats.num_seqs,
                "specdec.step.num_tokens": stats.num_tokens,
                "specdec.step.step_ms": stats.step_ms,
                "specdec.step.queue_ms": stats.queue_ms,
                "specdec.step.num_running_seqs": stats.num_running_seqs,
                "specdec.step.num_prefill_tokens": stats.num_prefill_tokens,
            }
        )
    return common_pb2.StepStats(
        num_seqs=stats.num_seqs,
        num_tokens=stats.num_tokens,
        step_ms=stats.step_ms,
        queue_ms=stats.queue_ms,
        num_running_seqs=stats.num_running_seqs,
        num_prefill_tokens=stats.num_prefill_tokens,
    )


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    """Serves VerifyService; Verify and Decode as unary RPCs and as calls of Step streams
    (:mod:`specdec.rpc.step_server`, ``max_workers`` of them served at once), by the same handlers."""

    def __init__(
        self,
        target: Target,
        sessions: SessionRegistry[TargetSession],
        metrics: ServiceMetrics,
        max_workers: int,
        rpc_delays_s: dict[str, float] | None = None,
    ):
        self.target = target
        self.sessions = sessions
        self.metrics = metrics
        self.rpc_delays_s = rpc_delays_s or {}  # the fault tests' hook (specdec.rpc.delay_hook): empty in production
        starters = {"verify": self._verify, "decode": self._decode}  # no thread waits per call
        handlers = delayed_starters(starters, self.rpc_delays_s, max_workers)
        self.step_calls = StepCalls(SERVICE, handlers, verify_pb2.VerifyCallResult, metrics)

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
            step_costs=[common_pb2.StepCost(num_tokens=n, num_seqs=b, ms=ms) for n, b, ms in t.step_costs],
            max_num_seqs=t.limits.max_num_seqs,
            max_num_batched_tokens=t.limits.max_num_batched_tokens,
            load=service_load(self.sessions, [t.engine]),
        )

    @grpc_errors
    def Prefill(self, request, context):
        start = time.perf_counter()
        sampling = SamplingParams.from_proto(request.sampling)
        abandoned = lambda: not context.is_active()  # noqa: E731
        try:
            session = self.sessions.open(
                request.session_id,
                lambda: self.target.new_session(
                    request.token_ids,
                    sampling,
                    context.time_remaining(),
                    abandoned,
                    request.decode,
                    request.cache_salt,
                    request.owner,
                ),
                abandoned=abandoned,
                owner=request.owner,
            )
        except OverBudget as err:  # waiting for room would not help
            raise FailedPrecondition(str(err)) from None
        response = verify_pb2.VerifyServicePrefillResponse(
            compute_ms=ms_since(start), num_cached_tokens=session.kv_cache.num_cached_tokens
        )
        if request.decode:
            response.next_token_id = session.committed[-1]
            response.step.CopyFrom(step_stats(session.last_step))
            response.logprobs.extend(session.last_logprobs)
        return response

    @grpc_errors
    def Verify(self, request, context):
        abandoned = lambda: not context.is_active()  # noqa: E731
        return wait_for_reply(lambda reply: self._verify(request, context.time_remaining(), abandoned, reply))

    @grpc_errors
    def Decode(self, request, context):
        abandoned = lambda: not context.is_active()  # noqa: E731
        return wait_for_reply(lambda reply: self._decode(request, context.time_remaining(), abandoned, reply))

    def Step(self, request_iterator, context):
        for results in self.step_calls.serve(request_iterator, context):
            yield verify_pb2.VerifyStepResponse(results=results, load=service_load(self.sessions, [self.target.engine]))

    def _verify(self, request, timeout_s: float | None, abandoned, reply: Reply) -> None:
        """Starts a Verify (a :data:`specdec.rpc.step_server.Starter`): replies from the engine's thread."""
        draft_probs = None
        if request.draft_distributions:
            draft_probs = decode_distributions(request.draft_distributions, self.target.vocab_size)

        def respond(n: int, token: int, **fields) -> verify_pb2.VerifyResponse:
            return verify_pb2.VerifyResponse(num_accepted=n, next_token_id=token, **fields)

        drafts = list(request.draft_token_ids)
        self._submit(
            request.session_id, lambda s: s.verification(drafts, draft_probs), respond, timeout_s, abandoned, reply
        )

    def _decode(self, request, timeout_s: float | None, abandoned, reply: Reply) -> None:
        """Starts a Decode (a :data:`specdec.rpc.step_server.Starter`): replies from the engine's thread."""

        def respond(n: int, token: int, **fields) -> verify_pb2.DecodeResponse:
            return verify_pb2.DecodeResponse(token_id=token, **fields)

        def decoding(session: TargetSession):
            if request.HasField("num_committed_tokens") and request.num_committed_tokens != len(session.committed):
                raise FailedPrecondition(
                    f"session {request.session_id!r} holds {len(session.committed)} committed tokens, the Decode "
                    f"follows {request.num_committed_tokens}: send it after the call before it is answered"
                )
            return session.verification([], None)

        self._submit(request.session_id, decoding, respond, timeout_s, abandoned, reply)

    def _submit(self, session_id: str, work_of, respond, timeout_s: float | None, abandoned, reply: Reply) -> None:
        """Queues the session's verification (``work_of(session)``, holding the session until it
        is done) on the engine once the session's previous call is done, without waiting for it
        (:meth:`specdec.rpc.sessions.SessionRegistry.start_when_free`: a coordinator decoding ahead
        sends a session's next Decode before the last is answered); its outcome is replied as
        ``respond(n, token, compute_ms=, step=, logprobs=)``, and NotFound, or what making the
        work raises (InvalidArgument), as the error. ``compute_ms`` counts from the moment the call
        has its session: the time it waited for the session's previous call is that call's."""
        called_in = otel_context.get_current()

        def run(session: TargetSession, release) -> None:
            start = time.perf_counter()

            def done(outcome, stats: StepStats, error: BaseException | None) -> None:
                release()
                if error is not None:
                    reply(error)
                    return
                n, token = outcome
                reply(respond(n, token, compute_ms=ms_since(start), step=step_stats(stats), logprobs=work.logprobs))

            token = otel_context.attach(called_in)  # may run on the thread of the session's previous call
            try:
                work = work_of(session)
                self.target.engine.submit(work, done, timeout_s, abandoned)
            except Exception as err:  # the call's own error: replied, never raised on another call's thread
                release()
                reply(err)
            finally:
                otel_context.detach(token)

        self.sessions.start_when_free(session_id, run, reply)

    def Release(self, request, context):
        self.sessions.release(request.session_id)
        return verify_pb2.VerifyServiceReleaseResponse()


def build(settings: VerifySettings, target: Target | None = None) -> RunningService:
    """Loads the target (unless given) and starts the server."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    host_memory.keep_freed_memory()
    metrics = ServiceMetrics()
    limits = EngineLimits(
        settings.max_num_seqs,
        settings.max_num_batched_tokens,
        settings.batch_wait_ms,
        settings.max_num_batched_tokens_alone,
        settings.batch_wait_step_share,
        settings.batch_wait_turnaround,
    )
    target = target or Target.load(
        settings.model,
        settings.dtype,
        settings.device_map,
        settings.max_num_speculative_tokens,
        limits,
        settings.prefix_cache_max_tokens if settings.enable_prefix_caching else None,
        settings.pack_linear_weights,
        settings.kv_cache_max_bytes,
    )
    target.engine.metrics = metrics.engine_metrics(
        "verify", target.lm.prefix_cache_tokens, target.lm.kv_usage, target.engine.num_waiting_calls
    )
    sessions: SessionRegistry[TargetSession] = SessionRegistry(
        settings.max_sessions, settings.session_idle_timeout_s, lost=TargetSession.lost
    )
    servicer = VerifyServicer(
        target, sessions, metrics, settings.max_workers, parse_delays(settings.debug_rpc_delay_ms)
    )
    return start_service(
        servicer, verify_pb2_grpc.add_VerifyServiceServicer_to_server, SERVICE, sessions, settings, [target.engine]
    )


def main(settings: VerifySettings) -> None:
    build(settings).serve_until_signal()

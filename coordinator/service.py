"""The CoordinatorService gRPC servicer (public Generate API) and its entry point.

Traced (OpenTelemetry spans, no-ops with tracing off): under the Generate call's span, which gets
the request's metrics as attributes when it finishes, a ``prefill`` span and one ``round`` span per
round (attributes: :func:`coordinator.tracing.round_attributes`), the draft and verify calls in them.
"""

import asyncio
import logging
import signal
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from coordinator import request as request_validation
from coordinator.adaptive import AdaptiveK, AdaptiveState
from coordinator.clients import ServiceClients
from coordinator.metrics import MetricsRecorder
from coordinator.prometheus import CoordinatorMetrics
from coordinator.rounds import SpeculativeSession
from coordinator.settings import CoordinatorSettings
from coordinator.text import IncrementalDetokenizer
from coordinator.tracing import request_attributes, round_attributes
from specdec.errors import SpecdecError, Unavailable
from specdec.ngram import DRAFTER_NAME as NGRAM, NgramIndex
from specdec.models import load_tokenizer
from specdec.server import SHUTDOWN_GRACE_S, start_aio_server
from specdec.timing import ms_since
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.vocab import tokenizer_fingerprint

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
STOP, LENGTH = coordinator_pb2.FINISH_REASON_STOP, coordinator_pb2.FINISH_REASON_LENGTH


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, settings: CoordinatorSettings, tokenizer, clients: ServiceClients, metrics: CoordinatorMetrics):
        self.settings = settings
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.clients = clients
        self.metrics = metrics
        self.adaptive = AdaptiveState(probe_interval=settings.probe_interval)
        self._background: set[asyncio.Task] = set()

    async def Generate(self, request, context):
        self.metrics.num_requests_running.inc()
        try:
            async for response in self._generate(request):
                yield response
        except SpecdecError as err:
            self.metrics.rpc_errors.labels("Generate", err.code.name).inc()
            await context.abort(err.code, str(err))
        except Exception:
            self.metrics.rpc_errors.labels("Generate", grpc.StatusCode.UNKNOWN.name).inc()
            raise
        finally:
            self.metrics.num_requests_running.dec()

    async def _draft_info_or_none(self):
        try:
            return await self.clients.draft_info()
        except Unavailable:
            return None  # plain decode (K = 0) still works

    async def _resolve(self, request) -> tuple[request_validation.ResolvedRequest, list[int], AdaptiveK | None]:
        """The validated request, the target's EOS ids and, under adaptive K, the session's policy."""
        verify_info, draft_info = await asyncio.gather(self.clients.verify_info(), self._draft_info_or_none())
        resolved = request_validation.resolve(
            request, self.settings, self.tokenizer, self.fingerprint, verify_info, draft_info
        )
        policy = None
        if resolved.adaptive:
            drafter = None  # n-gram lookup alone
            if resolved.uses_draft_service:
                drafter = next(d for d in draft_info.drafters if d.name == resolved.drafter)
            policy = self.adaptive.policy(drafter, verify_info, resolved.num_speculative_tokens, self.settings.ngram_max)
        return resolved, verify_info.eos_token_ids, policy

    async def _generate(self, request) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        metrics = MetricsRecorder()
        resolved, eos_ids, policy = await self._resolve(request)
        eos_ids = set(eos_ids)
        metrics.num_prompt_tokens = len(resolved.prompt_ids)
        ngram = None  # hybrid drafting: the coordinator's own n-gram lookup competes every round
        if policy and (self.settings.hybrid or not resolved.uses_draft_service):
            ngram = NgramIndex(self.settings.ngram_min, self.settings.ngram_max)
        session = SpeculativeSession(self.clients, uuid.uuid4().hex, resolved, ngram)
        text = IncrementalDetokenizer(self.tokenizer, resolved.prompt_ids, resolved.stop)
        generated: list[int] = []
        finish = coordinator_pb2.FINISH_REASON_UNSPECIFIED
        try:
            with tracer.start_as_current_span("prefill"):
                await session.prefill()
            metrics.prefill_ms = ms_since(metrics.start)
            while not finish:
                remaining = resolved.max_new_tokens - len(generated)
                with tracer.start_as_current_span("round") as span:
                    new, record = await self._round(session, policy, remaining - 1)
                    kept, finish = self._commit(new, remaining, text, eos_ids)
                    if span.is_recording():
                        span.set_attributes(round_attributes(record, len(kept)))
                metrics.rounds.append(record)
                self.metrics.observe_round(record, len(kept))
                generated.extend(kept)
                metrics.record_first_token()
                response = coordinator_pb2.GenerateResponse(token_ids=kept, text=text.take_delta(final=bool(finish)))
                if finish:
                    response.finish_reason = finish
                    response.metrics.CopyFrom(
                        metrics.to_proto(
                            len(generated),
                            seed=resolved.sampling.seed,
                            drafter=resolved.drafter,
                            num_speculative_tokens=resolved.num_speculative_tokens,
                            adaptive=resolved.adaptive,
                        )
                    )
                    self.metrics.observe_request(response.metrics)
                    request_span = trace.get_current_span()
                    if request_span.is_recording():
                        request_span.set_attributes(request_attributes(response.metrics))
                yield response
        finally:
            self._in_background(session.release())
            if policy:
                self.adaptive.remember(policy)

    @staticmethod
    async def _round(session: SpeculativeSession, policy: AdaptiveK | None, max_k: int):
        """One round of at most ``max_k`` draft tokens (a round commits up to K + 1 tokens: never
        draft past the budget), its drafter and K chosen by ``policy`` or fixed by the request."""
        if policy is None:
            request = session.request
            return await session.round(request.drafter, min(request.num_speculative_tokens, max_k))
        match = session.ngram_match(min(policy.k_max, max_k))
        drafter, k = policy.next_round(match)
        local = match.tokens if drafter == NGRAM else None
        new, record = await session.round(drafter, min(k, max_k), local)
        policy.observe(record, match, new)
        return new, record

    @staticmethod
    def _commit(new, remaining, text, eos_ids) -> tuple[list[int], int]:
        """Applies the stop conditions token by token; returns the tokens to emit and the finish
        reason (UNSPECIFIED while generation goes on). EOS tokens are emitted, not decoded."""
        kept = []
        for token in new[:remaining]:
            kept.append(token)
            if token in eos_ids or text.add(token):
                return kept, STOP
        return kept, LENGTH if len(kept) == remaining else coordinator_pb2.FINISH_REASON_UNSPECIFIED

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def serve(
    settings: CoordinatorSettings, ready: asyncio.Future | None = None, handle_signals: bool = True
) -> None:
    """Runs the coordinator until cancelled, or until SIGTERM / SIGINT (then in-flight requests
    get SHUTDOWN_GRACE_S seconds to finish). ``ready`` receives the bound port."""
    tokenizer = load_tokenizer(settings.tokenizer)
    clients = ServiceClients(
        settings.draft_address, settings.verify_address, settings.rpc_timeout_s, settings.prefill_timeout_s
    )
    metrics = CoordinatorMetrics()
    servicer = CoordinatorServicer(settings, tokenizer, clients, metrics)

    def register(server):
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    server, port = await start_aio_server(register, settings.host, settings.port)
    metrics.serve(settings.host, settings.metrics_port)
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop(SHUTDOWN_GRACE_S)))
    if ready is not None:
        ready.set_result(port)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(SHUTDOWN_GRACE_S)
        await clients.close()
        metrics.close()


def main(settings: CoordinatorSettings) -> None:
    asyncio.run(serve(settings))

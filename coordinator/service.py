"""The CoordinatorService gRPC servicer (public Generate API) and its entry point.

Traced (OpenTelemetry spans, no-ops with tracing off): under the Generate call's span, which gets
the request's metrics as attributes when it finishes, a ``prefill`` span and one ``round`` span per
round (attributes: :func:`coordinator.observability.tracing.round_attributes`), the draft and verify calls in them.
"""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from coordinator.api import choices
from coordinator.api import request as request_validation
from coordinator.api.admission import ClientLimit, FairQueue, Overloaded, owner_tag
from coordinator.api.auth import MIN_KEY_BITS, ApiKeys, Caller, key_bits, peer_host
from coordinator.api.cache_salt import cache_salt
from coordinator.api.grpc_auth import ApiKeyInterceptor, CallsInProgress
from coordinator.api.http_api import HttpLimits, HttpServer, create_app
from coordinator.api.output import StreamOutput, read_within, written
from coordinator.observability.metrics import MetricsRecorder
from coordinator.observability.prometheus import CoordinatorMetrics
from coordinator.observability.tracing import request_attributes, round_attributes
from coordinator.request_store.journal import RequestJournal
from coordinator.request_store.resume import check_request_id, check_resume, check_same_target
from coordinator.request_store.store import (
    CANCELLED,
    FAILED,
    FINISHED,
    RUNNING,
    MemoryStore,
    RedisStore,
    RequestStore,
    StoredRequest,
    StoreUnavailable,
    store_id,
)
from coordinator.settings import CoordinatorSettings
from coordinator.speculation.draft_client import DraftClient
from coordinator.speculation.placement import Placement
from coordinator.speculation.plan import LOOKUPS, ResolvedRequest
from coordinator.speculation.policy.adaptive_state import SUFFIX_LENGTHS, AdaptiveState
from coordinator.speculation.policy.fixed import FixedK
from coordinator.speculation.policy.k_policy import KPolicy, Learnt
from coordinator.speculation.rounds import RequestRounds
from coordinator.speculation.upstream import ProposeDeadline, Service, ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from specdec import startup_heap
from specdec.background import BackgroundTasks
from specdec.engine.model_files import load_tokenizer
from specdec.engine.vocab import tokenizer_fingerprint
from specdec.lookups.ngram import DRAFTER_NAME as NGRAM
from specdec.lookups.ngram import NgramIndex
from specdec.lookups.suffix import DRAFTER_NAME as SUFFIX
from specdec.lookups.suffix import SuffixCache, SuffixIndex
from specdec.observability.telemetry import current_span
from specdec.rpc.errors import AlreadyExists, InvalidArgument, NotFound, SpecdecError
from specdec.rpc.server import SHUTDOWN_GRACE_S, connection_options, server_credentials, start_aio_server
from specdec.rpc.tls import Reloading, ReloadingSSLContext, reloading_channel_credentials
from specdec.timing import ms_since
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
# After the gRPC server stopped: how long the requests it ended get to release their sessions (a
# Release is one round trip; a service that does not answer is retried up to this), seconds.
RELEASE_GRACE_S = 5.0
tracer = trace.get_tracer(__name__)


@dataclass
class RunningRequest:
    """One request while this coordinator runs it. ``target``: the verify service's model name;
    ``resumed``: the tokens a resumed request had generated before, ``resumed_logprobs`` theirs
    (when it asks for them); ``left_behind``: for a resume, the ids of the sessions its previous
    coordinator held (None for a new request); ``final``: the metrics of its last message, once
    sent."""

    resolved: ResolvedRequest
    target: str
    policy: KPolicy
    rounds: RequestRounds
    journal: RequestJournal
    output: StreamOutput
    metrics: MetricsRecorder
    resumed: list[int]
    resumed_logprobs: list[common_pb2.TokenLogprobs]
    left_behind: dict[str, str] | None
    final: coordinator_pb2.RequestMetrics | None = None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(
        self,
        settings: CoordinatorSettings,
        tokenizer,
        clients: ServiceClients,
        metrics: CoordinatorMetrics,
        store: RequestStore,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.clients = clients
        self.verify_client = VerifyClient(clients)
        self.metrics = metrics
        self.store = store
        self.adaptive = AdaptiveState(
            probe_interval=settings.probe_interval,
            step_budget=settings.step_budget,
            service_line=clients.placements["verify"].step_line,
        )
        # the outputs of earlier and running requests, for suffix lookups, partitioned by cache salt
        # (raises ValueError for negative bounds)
        self.suffix_cache = SuffixCache(
            max_requests=settings.suffix_max_cached_requests,
            max_tokens=settings.suffix_max_cached_tokens,
            max_partitions=settings.suffix_max_cache_partitions,
        )
        self.keys = ApiKeys(settings.api_keys, settings.owner_hash_secret)
        self.client_limit = ClientLimit(store, settings.max_streams_per_client, settings.max_coordinator_replicas)
        self.queue = FairQueue(
            settings.max_queued_requests, settings.queue_timeout_s, metrics.num_requests_waiting, metrics.queue_time
        )
        self.draft_client = DraftClient(clients, settings.draft_retry_s)
        self._num_running = 0  # requests in progress (each choice of a request with n > 1 counts)
        self._background = BackgroundTasks()  # releases, journal ends and priors written after a request

    async def Generate(self, request, context) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The gRPC call (one without an accepted key was refused before its message was read:
        :class:`coordinator.api.grpc_auth.ApiKeyInterceptor`): its caller, then :meth:`serve`; each
        message written within ``stream_stall_timeout_s`` or the stream is cut (its request
        cancelled: sessions released).
        An async generator, as interceptors (OpenTelemetry's) expect of a streaming handler, that
        yields nothing: it writes each message itself (``context.write``), so that a write can be
        bounded."""
        authorization = dict(context.invocation_metadata() or ()).get("authorization")
        try:
            caller = self.keys.caller(authorization, peer_host(context.peer()))
            async with contextlib.aclosing(self.serve(request, caller)) as responses:
                async for response in responses:
                    await written(context.write(response), self.settings.stream_stall_timeout_s)
        except SpecdecError as err:
            if isinstance(err, Overloaded):
                context.set_trailing_metadata((("retry-after", err.retry_after),))
            await context.abort(err.code, str(err))
        return
        yield

    def serve(
        self, request: coordinator_pb2.GenerateRequest, caller: Caller
    ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The messages of one request of ``caller``, admitted (:mod:`coordinator.api.admission`):
        counted against the caller's running requests until it ends (Overloaded at the first step
        beyond them), and queued while the verify service is full; cut (StreamStalled) once its
        client has kept it waiting ``max_stream_wait_s`` in all. Both APIs call it."""
        responses = read_within(self.responses(request, caller), self.settings.max_stream_wait_s)
        return self.client_limit.run(caller.client, responses, self.num_choices(request))

    def _check_stored_size(self, request: coordinator_pb2.GenerateRequest) -> None:
        """Drops ``request``'s unknown fields (nothing reads them; the store would keep them) and
        raises InvalidArgument when the rest is larger than the store keeps (max_stored_request_bytes)."""
        request.DiscardUnknownFields()
        size, limit = request.ByteSize(), self.settings.max_stored_request_bytes
        if size > limit:
            raise InvalidArgument(
                f"the request is {size} bytes, more than the request store keeps, {limit} bytes "
                "(max_stored_request_bytes): shorten the prompt, or raise --max-stored-request-bytes"
            )

    def num_choices(self, request: coordinator_pb2.GenerateRequest) -> int:
        """The request's n, or 1 when it is out of range (:meth:`responses` then refuses it)."""
        try:
            return choices.num_choices(request, self.settings.max_n)
        except SpecdecError:
            return 1

    async def responses(
        self, request: coordinator_pb2.GenerateRequest, caller: Caller
    ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The messages of one request of ``caller``: with n > 1 its choices' interleaved
        (:mod:`coordinator.api.choices`), each message naming its choice in ``index``, the first
        of each choice carrying its request id. Raises SpecdecError; closing it early cancels the
        request."""
        self.metrics.num_requests_running.inc()
        requests: list[coordinator_pb2.GenerateRequest] = []
        try:
            check_request_id(request)
            self._check_stored_size(request)
            requests = choices.choice_requests(request, request.request_id or uuid.uuid4().hex, self.settings.max_n)
            self._num_running += len(requests)
            if len(requests) == 1:
                stream = self._generate(requests[0], 0, caller)
            else:
                prefilled = asyncio.Event()  # choice 0's prefill: the other choices start after it
                streams = [self._generate(r, i, caller, prefilled if i == 0 else None) for i, r in enumerate(requests)]
                stream = choices.interleave(streams, prefilled)
            async with contextlib.aclosing(stream):
                async for response in stream:
                    yield response
        except SpecdecError as err:
            self.metrics.rpc_errors.labels("Generate", err.code.name).inc()
            raise
        except Exception:
            self.metrics.rpc_errors.labels("Generate", grpc.StatusCode.UNKNOWN.name).inc()
            raise
        finally:
            self.metrics.num_requests_running.dec()
            self._num_running -= len(requests)

    async def _resolve(self, request, owner: str):
        """The validated request of ``owner``, its cache salt set
        (:func:`coordinator.api.cache_salt.cache_salt`), the target's GetInfo and the request's K
        policy: its fixed K, or adaptive K warm-started from the owner's estimates (every owner's
        with ``shared_caches``)."""
        verify_info, draft_info = await asyncio.gather(
            self.verify_client.info(time.monotonic() + self.settings.failover_timeout_s), self.draft_client.info()
        )
        resolved = await asyncio.to_thread(  # tokenizing and grammar compiling: off the event loop
            request_validation.resolve,
            request,
            self.settings,
            self.tokenizer,
            self.fingerprint,
            verify_info,
            draft_info,
        )
        shared = self.settings.shared_caches
        resolved = dataclasses.replace(resolved, cache_salt=cache_salt(owner, request.cache_salt, shared))
        if not resolved.adaptive:
            return resolved, verify_info, FixedK(resolved.drafter, resolved.num_speculative_tokens)
        estimates_of = "" if shared else owner  # whose acceptance estimates it starts from and adds to
        drafter = None  # the request's lookup alone
        if resolved.uses_draft_service:
            assert draft_info is not None  # resolve() refuses a drafter of a draft service never reached
            drafter = next(d for d in draft_info.drafters if d.name == resolved.drafter)
        with contextlib.suppress(StoreUnavailable):
            priors = await self.store.load_priors(verify_info.model, estimates_of)
            self.adaptive.set_priors(verify_info.model, priors, estimates_of)
        lengths = {NGRAM: self.settings.ngram_max, SUFFIX: SUFFIX_LENGTHS}
        policy = self.adaptive.policy(
            drafter,
            verify_info,
            resolved.num_speculative_tokens,
            {name: lengths[name] for name in self._lookup_names(resolved)},
            self._num_running - 1,
            hidden_behind_verify=resolved.draft.hidden_behind_verify,
            owner=estimates_of,
        )
        return resolved, verify_info, policy

    def _lookup_names(self, resolved) -> list[str]:
        """The coordinator's own lookups an adaptive request drafts with: the request's drafter
        when it is one (ngram, suffix); else ``settings.hybrid_lookups``, beside the model drafter
        with hybrid drafting on, or alone when the draft service was never reached (no drafter)."""
        if resolved.drafter in LOOKUPS:
            return [resolved.drafter]
        return list(self.settings.hybrid_lookups) if self.settings.hybrid or not resolved.drafter else []

    def _new_lookup(self, name: str, resolved):
        """A new request's index of lookup ``name`` (the suffix one shares the coordinator's output
        cache, in the request's partition)."""
        if name == NGRAM:
            return NgramIndex(self.settings.ngram_min, self.settings.ngram_max)
        return SuffixIndex(self.suffix_cache, len(resolved.prompt_ids), cache_salt=resolved.cache_salt)

    async def _stored(self, request, owner: str) -> StoredRequest | None:
        """The stored request a resume continues (None for a new request), looked up among
        ``owner``'s: another key's request of the same id is not found, as an id never used.
        Raises NOT_FOUND, INVALID_ARGUMENT (see :mod:`coordinator.request_store.resume`),
        UNAVAILABLE when a resume cannot reach the request store."""
        if not request.HasField("resume_from"):
            return None
        request_id = request.request_id
        stored = await self.store.load(store_id(owner, request_id))
        if stored is None:
            raise NotFound(
                f"request {request_id!r} is not in the request store (never started, or its last write was "
                f"more than {self.settings.request_ttl_s:g} s ago): send it again without resume_from"
            )
        check_resume(request, stored)
        return stored

    async def _generate(
        self, request, index: int, caller: Caller, prefilled: asyncio.Event | None = None
    ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """One choice of a request, ``request`` its own (:func:`coordinator.api.choices.choice_requests`)
        and ``index`` its number (a resumed choice keeps its stored one): opens it (or replays a
        finished one), streams what its rounds commit, every message with the index and the first
        with the request id, and closes it: its sessions released and its outcome stored, whether
        it finished, failed or was cancelled. ``prefilled`` is set once its sessions are prefilled."""
        stored = await self._stored(request, caller.owner)
        index = index if stored is None else stored.choice
        if stored is not None and stored.status == FINISHED:
            response = await self._replay_finished(stored, request.resume_from)
            response.index, response.request_id = index, request.request_id
            yield response
            return
        running = await self._open(request, stored, index, caller)
        outcome, first = CANCELLED, True
        try:
            async for response in self._stream(running, caller.client, prefilled):
                response.index = index
                if first:
                    response.request_id, first = request.request_id, False
                yield response
            outcome = FINISHED
        except SpecdecError:
            outcome = FAILED
            raise
        finally:
            self._close(running, outcome)

    async def _open(self, request, stored: StoredRequest | None, index: int, caller: Caller) -> RunningRequest:
        """Validates a new request of ``caller`` (choice ``index`` of its request) or a resumed
        ``stored`` one, writes its record to the store and makes its rounds' state. Raises what
        :meth:`_resolve` raises, FAILED_PRECONDITION for a resume on another target,
        ALREADY_EXISTS for a new request whose id the owner already uses, RESOURCE_EXHAUSTED
        (StoreFull) when the store is full. While the store cannot be reached a new request goes
        on unchecked (:meth:`RequestJournal.create`)."""
        request_id = request.request_id
        resolved, verify_info, policy = await self._resolve(stored.request if stored else request, caller.owner)
        resuming = stored is not None
        if stored is not None:
            check_same_target(stored, verify_info)
        else:
            original = coordinator_pb2.GenerateRequest()
            original.CopyFrom(request)
            original.ClearField("request_id")
            original.seed = resolved.sampling.seed  # a resume draws the same numbers
            original.max_new_tokens = resolved.max_new_tokens  # whatever the resuming coordinator's default
            stored = StoredRequest(
                request_id, original, verify_info.model, verify_info.vocab_fingerprint, choice=index, owner=caller.owner
            )
        resumed, resumed_logprobs, left_behind = list(stored.generated), list(stored.logprobs), dict(stored.sessions)
        stored.generated, stored.logprobs, stored.status = [], [], RUNNING
        journal = RequestJournal(self.store, stored, caller.client, claimed=resuming)
        if not resuming and await journal.create() is False:
            raise AlreadyExists(f"request_id {request_id!r} is in use: choose another, or set resume_from to resume it")
        output = StreamOutput(
            self.tokenizer,
            resolved.prompt_ids,
            resolved.stop,
            () if resolved.ignore_eos else verify_info.eos_token_ids,
            resolved.max_new_tokens,
            request.resume_from,
        )
        lookups = {name: self._new_lookup(name, resolved) for name in policy.lookups}
        rounds = RequestRounds(
            self.draft_client,
            self.verify_client,
            uuid.uuid4().hex,
            resolved,
            [*resolved.prompt_ids, *resumed],
            lookups,
            self.settings.draft_retry_s,
            self.settings.failover_timeout_s,
            running_requests=lambda: self._num_running,
            decode_ahead=self.settings.decode_ahead,
            owner=owner_tag(caller.client),
        )
        return RunningRequest(
            resolved,
            verify_info.model,
            policy,
            rounds,
            journal,
            output,
            MetricsRecorder(num_prompt_tokens=len(resolved.prompt_ids)),
            resumed,
            resumed_logprobs,
            left_behind if resuming else None,
        )

    async def _stream(
        self, running: RunningRequest, client: str, prefilled: asyncio.Event | None = None
    ) -> AsyncGenerator[coordinator_pb2.GenerateResponse, None]:
        """The request's messages: the resumed tokens first, then the prefill (``prefilled`` set
        after it; while every verify replica is full the request waits in the fair queue, as one
        of ``client``'s) and one message per round, each round's tokens (and log-probabilities)
        stored before the client has them."""
        rounds, output = running.rounds, running.output
        kept = output.add(running.resumed, running.resumed_logprobs)
        if running.left_behind is not None:
            rounds.release_left_behind(running.left_behind)
            resumed_logprobs = running.resumed_logprobs[: len(kept)]
            await running.journal.commit(kept, {}, resumed_logprobs)  # the resumed request, running here now
        if caught_up := self._message(running, kept):
            yield caught_up
        if not output.finish:  # the first token comes from the target's prefill
            with tracer.start_as_current_span("prefill"):
                admit = functools.partial(self.queue.run, client)
                first, first_logprobs = await rounds.prefill(running.policy, admit)
            running.metrics.prefill_ms = ms_since(running.metrics.start)
            if prefilled is not None:
                prefilled.set()
            kept = output.add(first, first_logprobs)
            self.metrics.generation_tokens.inc(len(kept))
            await running.journal.commit(kept, rounds.open_sessions(), first_logprobs[: len(kept)])
            if response := self._message(running, kept):
                yield response
        while not output.finish:
            with current_span(tracer, "round") as span:
                new, logprobs, record = await rounds.step(running.policy, output.remaining - 1)
                kept = output.add(new, logprobs)
                if span.is_recording():
                    span.set_attributes(round_attributes(record, len(kept)))
            running.metrics.rounds.append(record)
            self.metrics.observe_round(record, len(kept))
            # stored before the client has them
            await running.journal.commit(kept, rounds.open_sessions(), logprobs[: len(kept)])
            if response := self._message(running, kept):
                yield response

    def _message(self, running: RunningRequest, kept: list[int]) -> coordinator_pb2.GenerateResponse | None:
        """The message carrying ``kept`` (None if it carries nothing); the last one carries the
        request's metrics."""
        response = running.output.response(kept)
        if response is None:  # nothing to send: not the end either
            return None
        running.metrics.record_first_token()
        if running.output.finish:
            running.final = self._request_metrics(running)
            response.metrics.CopyFrom(running.final)
        return response

    def _close(self, running: RunningRequest, outcome: str) -> None:
        """Releases the request's sessions and stores its outcome, in the background."""
        rounds = running.rounds
        self._background.run(self._release(rounds))
        self._background.run(running.journal.end(outcome, running.output.finish, running.final))
        self.metrics.observe_faults(rounds.draft.failures, rounds.verify.rebuilds)
        learnt = running.policy.end()  # the warm starts it changed (None: a fixed K, or nothing observed)
        if learnt is not None:
            self._background.run(self._save_priors(running.target, learnt))

    async def drain(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` seconds for what the ended requests left running: their
        sessions' releases and their journals' last writes (so that a stopping coordinator gives
        the services their sessions back before it closes its connections to them, instead of
        leaving them to the services' idle timeout)."""
        if not await self._background.drain(timeout_s):
            log.warning("stopping with requests' releases or store writes unfinished after %g s", timeout_s)

    def close(self) -> None:
        """Stops the admission's background tasks (lease renewals, the queue's retries)."""
        self.client_limit.close()
        self.queue.close()

    async def _release(self, rounds: RequestRounds) -> None:
        """Releases a request's sessions; then a request waiting for room may try again."""
        try:
            await rounds.release()
        finally:
            self.queue.room()

    def _request_metrics(self, running: RunningRequest) -> coordinator_pb2.RequestMetrics:
        """The final message's metrics (also the Prometheus request histograms and span attributes)."""
        resolved, rounds, num_resumed = running.resolved, running.rounds, len(running.resumed)
        final = running.metrics.to_proto(
            len(running.output.generated) - num_resumed,
            seed=resolved.sampling.seed,
            drafter=resolved.drafter,
            num_speculative_tokens=resolved.num_speculative_tokens,
            adaptive=resolved.adaptive,
            num_resumed_tokens=num_resumed,
            num_draft_failures=rounds.draft.failures,
            num_verify_rebuilds=rounds.verify.rebuilds,
            num_cached_prompt_tokens=rounds.verify.num_cached_tokens,
            num_draft_cached_prompt_tokens=rounds.draft.num_cached_tokens or 0,
            verify_replicas=rounds.verify.used,
            draft_replicas=rounds.draft.used,
        )
        self.metrics.observe_request(final)
        request_span = trace.get_current_span()
        if request_span.is_recording():
            request_span.set_attributes(request_attributes(final))
        return final

    async def _replay_finished(self, stored: StoredRequest, resume_from: int) -> coordinator_pb2.GenerateResponse:
        """The rest of a finished request from the store: its tokens after ``resume_from``, their
        text, its finish reason and metrics."""
        prompt = await asyncio.to_thread(request_validation.prompt_ids, stored.request, self.tokenizer)
        output = StreamOutput(self.tokenizer, prompt, stored.request.stop, (), len(stored.generated), resume_from)
        output.add(stored.generated, stored.logprobs)
        output.finish = stored.finish_reason
        response = output.response(stored.generated)
        assert response is not None and stored.metrics is not None  # a finished request has both
        response.metrics.CopyFrom(stored.metrics)
        return response

    async def _save_priors(self, target: str, learnt: Learnt) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self.store.save_priors(target, learnt.priors, learnt.owner)


async def serve(
    settings: CoordinatorSettings, ready: asyncio.Future | None = None, handle_signals: bool = True
) -> None:
    """Runs the coordinator, gRPC and (on ``http_port``) HTTP, until cancelled, or until SIGTERM /
    SIGINT (then in-flight requests get SHUTDOWN_GRACE_S seconds to finish); either way the ended
    requests' sessions are released (up to RELEASE_GRACE_S more) and its connections to the
    services (their Step streams) closed before it returns. ``ready`` receives the
    bound gRPC port."""
    tokenizer = load_tokenizer(settings.tokenizer)
    placements: dict[Service, Placement] = {
        "draft": Placement(settings.placement),
        "verify": Placement(settings.placement),
    }
    clients = ServiceClients(
        settings.draft_addresses,
        settings.verify_addresses,
        settings.rpc_timeout_s,
        settings.prefill_timeout_s,
        tls=_internal_tls(settings),
        max_message_bytes=settings.max_message_bytes,
        propose_deadline=ProposeDeadline(
            settings.propose_timeout_floor_s, settings.propose_timeout_factor, settings.rpc_timeout_s
        ),
        placements=placements,
        nameservers=settings.dns_nameservers,
        refresh_s=settings.discovery_refresh_s,
    )
    await clients.start()
    metrics = CoordinatorMetrics()
    metrics.track_placements(placements)
    store: RequestStore
    if settings.redis_url:
        store = RedisStore(
            settings.redis_url,
            settings.request_ttl_s,
            metrics.store_errors,
            max_finished_per_client=settings.max_finished_requests_per_client,
            cluster=settings.redis_cluster,
            ssl_ca_certs=settings.redis_tls_ca_file,
            ssl_certfile=settings.redis_tls_cert_file,
            ssl_keyfile=settings.redis_tls_key_file,
        )
    else:
        store = MemoryStore(settings.request_ttl_s, settings.max_finished_requests_per_client)
    _warn_of_weak_keys(settings)
    servicer = CoordinatorServicer(settings, tokenizer, clients, metrics, store)

    def register(server):
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    http = None
    if settings.http_port:
        ssl_context = None
        if settings.tls_cert_file:
            files = (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
            ssl_context = ReloadingSSLContext(*files)
        app = create_app(servicer, settings.served_model_name, settings.max_request_bytes)
        http = HttpServer(app, settings.host, settings.http_port, ssl_context, HttpLimits.of(settings))
        await http.start()
        scheme = "https" if ssl_context else "http"
        log.info("serving the OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, settings.host, settings.http_port)
    server, port = await start_aio_server(
        register,
        settings.host,
        settings.port,
        server_credentials(settings),
        settings.max_message_bytes,
        settings.max_request_bytes,
        interceptors=[
            ApiKeyInterceptor(
                servicer.keys,
                CallsInProgress(settings.max_concurrent_rpcs),
                settings.grpc_request_message_timeout_s,
            )
        ],
        connection=connection_options(settings),
    )
    metrics.serve(settings.host, settings.metrics_port)
    stopping = BackgroundTasks()

    def shutdown():
        if http:
            http.stop_accepting()
        stopping.run(server.stop(SHUTDOWN_GRACE_S))

    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown)
    if ready is not None:
        ready.set_result(port)
    try:
        # Shielded: gRPC's wait_for_termination awaits the future that stop() completes, and
        # cancelling it there would make stop() raise CancelledError before anything below ran
        # (the Step streams to the services stayed open, holding their calls in progress).
        await asyncio.shield(server.wait_for_termination())
    finally:
        try:
            await asyncio.gather(server.stop(SHUTDOWN_GRACE_S), *([http.stop()] if http else []))
            await servicer.drain(RELEASE_GRACE_S)
        finally:
            servicer.close()
            await clients.close()
            await store.close()
            metrics.close()


def _warn_of_weak_keys(settings: CoordinatorSettings) -> None:
    """Logs what weakens the API keys a deployment chose to run with (docs/security.md)."""
    if not settings.api_keys:
        return
    if settings.allow_short_api_keys and any(key_bits(key) < MIN_KEY_BITS for key in settings.api_keys):
        log.warning(
            "API keys under %d bits (--allow-short-api-keys): they can be guessed; for tests and demos only",
            MIN_KEY_BITS,
        )
    if not settings.owner_hash_secret:
        log.warning(
            "no --owner-hash-secret: requests are stored under a public hash of their API key, which anyone reading "
            "the request store's key names can test a guessed key against; give every coordinator the same secret"
        )


def _internal_tls(settings: CoordinatorSettings) -> Reloading[grpc.ChannelCredentials] | None:
    """TLS to the draft and verify services from the internal_tls_* files; None: plaintext."""
    if not settings.internal_tls_ca_file:
        return None
    names = ("internal_tls_ca_file", "internal_tls_cert_file", "internal_tls_key_file")
    ca_file, cert_file, key_file = (getattr(settings, name) for name in names)
    return reloading_channel_credentials(ca_file, cert_file, key_file, names)


def main(settings: CoordinatorSettings) -> None:
    """Serves until SIGINT or SIGTERM (:func:`serve`), the start-up heap frozen once the servers
    listen (:mod:`specdec.startup_heap`)."""

    async def serve_frozen() -> None:
        ready = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda _: startup_heap.freeze())
        await serve(settings, ready)

    asyncio.run(serve_frozen())

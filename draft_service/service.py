"""The DraftService gRPC servicer and its entry point (``specdec serve draft``)."""

import dataclasses
import math
import os
import time

import torch
from opentelemetry import trace
from prometheus_client import Counter

from draft_service.drafters.contract import Drafter, DraftSession, Proposal
from draft_service.drafters.model_drafting import ModelDraftSession
from draft_service.settings import DRAFTERS, DraftSettings
from specdec.engine import host_memory
from specdec.observability.prometheus import ServiceMetrics
from specdec.rpc.delay_hook import delayed_starters, parse_delays
from specdec.rpc.errors import InvalidArgument, grpc_errors
from specdec.rpc.server import RunningService, start_service
from specdec.rpc.service_load import service_load
from specdec.rpc.sessions import SessionRegistry
from specdec.rpc.step_server import Reply, StepCalls, wait_for_reply
from specdec.sampling.sampling_params import SamplingParams
from specdec.timing import ms_since
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def load_drafters(settings: DraftSettings) -> dict[str, Drafter]:
    """Instantiates the drafters named in ``settings.drafters``. Raises ValueError for an unknown
    name, before any model loads."""
    unknown = [name for name in settings.drafters if name not in DRAFTERS]
    if unknown:
        raise ValueError(
            f"{DraftSettings.named('drafters')} names {', '.join(map(repr, unknown))}, no drafter of this service: "
            f"list only {', '.join(DRAFTERS)}"
        )
    drafters: dict[str, Drafter] = {}
    for name in settings.drafters:
        if name == "ngram":
            from draft_service.drafters.ngram import NgramDrafter

            drafters[name] = NgramDrafter(settings.ngram_min, settings.ngram_max)
        elif name == "suffix":
            from draft_service.drafters.suffix import SuffixDrafter

            drafters[name] = SuffixDrafter(
                settings.suffix_max_depth,
                settings.suffix_max_spec_factor,
                settings.suffix_min_token_prob,
                settings.suffix_max_cached_requests,
                settings.suffix_max_cached_tokens,
                settings.suffix_max_cache_partitions,
            )
        elif name == "llama-cpp":
            from draft_service.drafters.llama_cpp import LlamaCppDrafter

            drafters[name] = LlamaCppDrafter(
                settings.llama_cpp_model,
                settings.llama_cpp_n_ctx,
                settings.llama_cpp_n_threads,
                settings.llama_cpp_n_gpu_layers,
                max_num_seqs=min(settings.llama_cpp_max_num_seqs, settings.max_sessions),
                max_num_batched_tokens=settings.max_num_batched_tokens,
                requantize=settings.llama_cpp_requantize,
                prefix_caching=settings.enable_prefix_caching,
            )
        else:  # transformers (every name is one of DRAFTERS)
            from draft_service.drafters.transformers_lm import TransformersDrafter

            drafters[name] = TransformersDrafter.load(
                settings.transformers_model,
                settings.transformers_dtype,
                settings.max_num_seqs,
                settings.max_num_batched_tokens,
                settings.prefix_cache_max_tokens if settings.enable_prefix_caching else None,
                settings.kv_cache_max_bytes,
            )
        drafters[name].measure_step_ms()
    return drafters


MAX_BRANCHES = 16  # ProposeRequest.num_branches at most


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Serves DraftService; Propose as a unary RPC and as calls of Step streams
    (:mod:`specdec.rpc.step_server`), by the same starter.
    ``grammar_aware_drafting`` False: sessions are opened without the request's structured output,
    so model drafters draft without the grammar's mask and jump-forward, and only the verify
    service's cut keeps their proposals in the grammar (vLLM's and SGLang's behaviour; for
    comparison, ``specdec bench structured``)."""

    def __init__(
        self,
        drafters: dict[str, Drafter],
        default_drafter: str,
        sessions: SessionRegistry[DraftSession],
        max_k: int,
        metrics: ServiceMetrics,
        max_workers: int,
        grammar_aware_drafting: bool = True,
        proactive_drafting: bool = True,
        rpc_delays_s: dict[str, float] | None = None,
    ):
        if default_drafter not in drafters:
            raise ValueError(f"default drafter {default_drafter!r} is not among {sorted(drafters)}")
        self.drafters = drafters
        # by drafter name: the engine loops of the model drafters (one per model)
        self.engines = {name: d.engine for name, d in drafters.items() if d.engine is not None}
        self.default_drafter = default_drafter
        self.sessions = sessions
        self.max_k = max_k
        self.metrics = metrics
        self.grammar_aware_drafting = grammar_aware_drafting
        self.proactive_drafting = proactive_drafting
        self.proactive_drafts = Counter(
            "specdec_proactive_drafts",
            "Proposals drafted before a Propose asked for them (proactive drafting), by outcome: started, or "
            "used by the Propose that came next (the rest were cancelled by another one, or the session's end).",
            ["outcome"],
            registry=metrics.registry,
        )
        self.rpc_delays_s = rpc_delays_s or {}  # the fault tests' hook (specdec.rpc.delay_hook): empty in production
        starters = {"propose": self._propose}  # no thread waits per call
        handlers = delayed_starters(starters, self.rpc_delays_s, max_workers)
        self.step_calls = StepCalls(SERVICE, handlers, draft_pb2.DraftCallResult, metrics)

    def GetInfo(self, request, context):
        return draft_pb2.DraftServiceGetInfoResponse(
            drafters=[
                draft_pb2.DrafterInfo(
                    name=name, model=d.model, vocab_fingerprint=d.vocab_fingerprint, step_ms=d.step_ms
                )
                for name, d in self.drafters.items()
            ],
            default_drafter=self.default_drafter,
            load=service_load(self.sessions, self.engines.values()),
        )

    def _drafter(self, name: str) -> Drafter:
        drafter = self.drafters.get(name or self.default_drafter)
        if drafter is None:
            raise InvalidArgument(f"unknown drafter {name!r}: this draft service hosts {', '.join(self.drafters)}")
        return drafter

    @grpc_errors
    def Prefill(self, request, context):
        start = time.perf_counter()
        drafter = self._drafter(request.drafter)
        trace.get_current_span().set_attribute("specdec.drafter", drafter.name)
        if not request.token_ids:
            raise InvalidArgument("token_ids is empty: prefill needs at least one token")
        sampling = SamplingParams.from_proto(request.sampling)
        if not self.grammar_aware_drafting:  # the model drafters draft as without structured output
            sampling = dataclasses.replace(sampling, structured_output=None)

        def open_session() -> DraftSession:
            session = drafter.new_session(sampling, request.cache_salt, request.owner)
            try:
                session.prefill(request.token_ids)
            except BaseException:
                session.close()  # frees its KV sequence
                raise
            return session

        session = self.sessions.open(
            request.session_id, open_session, abandoned=lambda: not context.is_active(), owner=request.owner
        )
        return draft_pb2.DraftServicePrefillResponse(
            compute_ms=ms_since(start), num_cached_tokens=session.num_cached_tokens()
        )

    @grpc_errors
    def Propose(self, request, context):
        abandoned = lambda: not context.is_active()  # noqa: E731
        return wait_for_reply(lambda reply: self._propose(request, context.time_remaining(), abandoned, reply))

    def Step(self, request_iterator, context):
        for results in self.step_calls.serve(request_iterator, context):
            yield draft_pb2.DraftStepResponse(results=results, load=service_load(self.sessions, self.engines.values()))

    def _propose(self, request, timeout_s: float | None, abandoned, reply: Reply) -> None:
        """Starts a Propose (a :data:`specdec.rpc.step_server.Starter`): a model drafter's proposal
        replies from its engine's thread, holding the session until then (``timeout_s`` and
        ``abandoned`` are not used: a proposal's steps run on the drafter's own loop to the end).
        Raises InvalidArgument for a K, branch count or budget out of range, NotFound."""
        start = time.perf_counter()
        k = request.num_speculative_tokens
        if not 1 <= k <= self.max_k:
            raise InvalidArgument(
                f"num_speculative_tokens is {k}: it must lie in [1, {self.max_k}] (the draft service's "
                "--max-num-speculative-tokens)"
            )
        predicted = request.predicted_token_ids
        num_branches, budget_ms = request.num_branches, request.branch_budget_ms
        if not 0 <= num_branches <= MAX_BRANCHES:
            raise InvalidArgument(f"num_branches is {num_branches}: it must lie in [0, {MAX_BRANCHES}]")
        if not math.isfinite(budget_ms) or budget_ms < 0:
            raise InvalidArgument(f"branch_budget_ms is {budget_ms}: it must be >= 0 (0: no limit)")
        budget_s = budget_ms / 1000 - (time.perf_counter() - start) if budget_ms else None
        span = trace.get_current_span()
        session, release = self.sessions.acquire(request.session_id)

        def done(proposal: Proposal | BaseException) -> None:
            try:
                # a proactive draft starts while the session is held: no other call comes between
                if (
                    isinstance(proposal, Proposal)
                    and self.proactive_drafting
                    and session.draft_next(k, predicted, proposal)
                ):
                    self.proactive_drafts.labels("started").inc()
            finally:
                release()
            if isinstance(proposal, BaseException):
                reply(proposal)
                return
            if proposal.proactive:
                self.proactive_drafts.labels("used").inc()
            if span.is_recording():
                span.set_attributes(
                    {
                        "specdec.num_speculative_tokens": k,
                        "specdec.num_drafted": len(proposal.tokens),
                        "specdec.draft_ahead": bool(predicted),
                        "specdec.num_branches": len(proposal.branches),
                        "specdec.proactive": proposal.proactive,
                    }
                )
            reply(_response(proposal, session.sampling.greedy, ms_since(start)))

        try:
            session.sync(request.appended_token_ids)
            session.start_proposal(k, predicted, num_branches, budget_s, done)
        except BaseException:
            release()
            raise

    def Release(self, request, context):
        self.sessions.release(request.session_id)
        return draft_pb2.DraftServiceReleaseResponse()


def _response(proposal: Proposal, greedy: bool, compute_ms: float) -> draft_pb2.ProposeResponse:
    """The ProposeResponse of a proposal (draft distributions only under sampling)."""
    return draft_pb2.ProposeResponse(
        token_ids=proposal.tokens,
        distributions=[] if greedy else proposal.distributions(),
        compute_ms=compute_ms,
        predicted_bonus_token_id=proposal.bonus_token_id,
        forced=proposal.forced,
        branches=[
            draft_pb2.DraftBranch(
                num_accepted=branch.num_accepted,
                next_token_id=branch.next_token,
                token_ids=branch.proposal.tokens,
                distributions=[] if greedy else branch.proposal.distributions(),
                forced=branch.proposal.forced,
            )
            for branch in proposal.branches
        ],
    )


def build(settings: DraftSettings, drafters: dict[str, Drafter] | None = None) -> RunningService:
    """Loads the drafters (unless given) and starts the server."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    host_memory.keep_freed_memory()
    drafters = drafters if drafters is not None else load_drafters(settings)
    metrics = ServiceMetrics()
    sessions: SessionRegistry[DraftSession] = SessionRegistry(
        settings.max_sessions, settings.session_idle_timeout_s, lost=_lost
    )
    servicer = DraftServicer(
        drafters,
        settings.default_drafter,
        sessions,
        settings.max_num_speculative_tokens,
        metrics,
        settings.max_workers,
        settings.grammar_aware_drafting,
        settings.proactive_drafting,
        parse_delays(settings.debug_rpc_delay_ms),
    )
    for name, engine in servicer.engines.items():
        lm = engine.lm
        engine.metrics = metrics.engine_metrics(name, lm.prefix_cache_tokens, lm.kv_usage, engine.num_waiting_calls)
    return start_service(
        servicer,
        draft_pb2_grpc.add_DraftServiceServicer_to_server,
        SERVICE,
        sessions,
        settings,
        servicer.engines.values(),
    )


def _lost(session: DraftSession) -> str | None:
    """Why a model drafter's session lost its KV (preempted by the transformers drafter's budget)."""
    return session.kv_cache.lost() if isinstance(session, ModelDraftSession) else None


def main(settings: DraftSettings) -> None:
    """Serves until SIGINT or SIGTERM, at ``settings.nice``; then stops the engines and frees the
    models' native state (:func:`close_engines`), so that the process exits with code 0."""
    if settings.nice:
        lower_priority(settings.nice)
    service = build(settings)
    assert isinstance(service.servicer, DraftServicer)
    service.serve_until_signal()
    close_engines(service.servicer)


def close_engines(servicer: DraftServicer) -> None:
    """Stops the model drafters' engines and frees what their models hold outside Python (the
    llama.cpp drafter's context and model: ``close``), waiting for a step still running. Left to
    the interpreter's exit, llama.cpp's state is torn down by its C++ destructors while the engine
    thread may still be in it, and the process aborts ("terminate called without an active
    exception", exit code 134)."""
    for engine in servicer.engines.values():
        engine.stop()
        close = getattr(engine.lm, "close", None)  # only a model with native state has one
        if close is not None:
            close()


def lower_priority(nice: int) -> None:
    """Sets every thread of this process to niceness ``nice`` (Linux keeps one per thread, and a
    thread started later inherits its starter's): those started before (at import) too."""
    for task in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(task), nice)

"""The target model and its per-session state: prefill, verify, decode, rollback.

Every session's sequence lives in one shared KV store (:class:`specdec.engine.ragged_lm.RaggedLM`) and
every call runs as work of one engine loop (:mod:`specdec.engine.engine`): a Prefill is chunked into the
steps' leftover token budget, a Verify (K + 1 new tokens) or Decode (1) joins the next step, and
one acceptance pass (:mod:`specdec.sampling.acceptance`) tests every verify of the step on its own rows of
the batched logits, each sequence's draws seeded by (request seed, committed length), so a
request's output does not depend on what else was in its batch beyond floating-point rounding
(invariant *batch independence*, docs/architecture.md#invariants).

KV memory is admitted by bytes within ``kv_cache_max_bytes`` (:mod:`specdec.engine.kv_budget`): a Prefill
the budget cannot hold is refused with RESOURCE_EXHAUSTED before it runs, and a session preempted
to give a running one room to grow fails its next calls with NOT_FOUND
(docs/architecture.md#kv-memory-a-budget-in-bytes).

Traced (OpenTelemetry spans, no-ops with tracing off): each verification's ``acceptance`` test
and ``rollback`` (see :mod:`specdec.engine.kv`).
"""

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from opentelemetry import trace

from specdec.engine.batching import SequenceStep
from specdec.engine.cpu_linear import pack_linears
from specdec.engine.engine import Engine, StepStats, Work
from specdec.engine.kv import SequenceKV, prefill
from specdec.engine.kv_budget import SETTING
from specdec.engine.models import context_window, load_causal_lm
from specdec.engine.prefix_cache import DEFAULT_MAX_TOKENS
from specdec.engine.ragged_lm import BLOCK_SIZE, RaggedLM
from specdec.engine.vocab import check_token_ids, tokenizer_fingerprint
from specdec.rpc.errors import InvalidArgument, ResourceExhausted
from specdec.sampling.acceptance import greedy_accept, rejection_sample
from specdec.sampling.grammar import GrammarMatcher
from specdec.sampling.logits_processors import process
from specdec.sampling.logprobs import committed_logprobs
from specdec.sampling.probs import logits_to_probs, round_generator
from specdec.sampling.sampling_params import SamplingParams
from specdec.sampling.structured_output import UNLIMITED, grammar_tokenizer
from specdec.timing import min_ms
from specdec.v1 import common_pb2
from verify_service.settings import VerifySettings

tracer = trace.get_tracer(__name__)
MEASURE_CONTEXT = 64  # tokens of context of the start-up measurements (Target.measure_costs)


@dataclass
class EngineLimits:
    """``max_num_seqs`` sequences and ``max_num_batched_tokens`` new tokens per step
    (``max_num_batched_tokens_alone`` for a sequence alone on the engine); a step waits up to
    ``batch_wait_ms``, ``batch_wait_step_share`` of the previous step's time or (with
    ``batch_wait_turnaround``) the callers' turnaround, whichever is longest, for the sequences of
    the previous one (see :mod:`specdec.engine.engine`)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    batch_wait_ms: float = 5.0
    max_num_batched_tokens_alone: int = 2048
    batch_wait_step_share: float = 0.1
    batch_wait_turnaround: bool = True


class Target:
    """A loaded target model, its KV store and engine loop (whose ``metrics`` the service sets),
    shared by all sessions of the verify service. ``prefix_cache_max_tokens``: the KV store's
    prefix cache (:class:`specdec.engine.ragged_lm.RaggedLM`; None: off); ``kv_cache_max_bytes``: its
    budget (0: automatic, :mod:`specdec.engine.kv_budget`). Raises ValueError, naming the setting, for a
    budget that cannot hold the start-up measurement's sequence (:meth:`measure_costs`)."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        max_num_speculative_tokens: int,
        limits: EngineLimits | None = None,
        prefix_cache_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        kv_cache_max_bytes: int = 0,
    ):
        limits = limits or EngineLimits()
        if limits.max_num_batched_tokens < max_num_speculative_tokens + 1:
            raise ValueError(
                f"max_num_batched_tokens ({limits.max_num_batched_tokens}) must be at least "
                f"max_num_speculative_tokens + 1 ({max_num_speculative_tokens + 1}): a verify of the "
                "largest K fits one step"
            )
        self.name = name
        self.limits = limits
        self.tokenizer = tokenizer
        self.vocab_fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = model.config.vocab_size
        self.max_context_length = context_window(model)
        self.max_num_speculative_tokens = max_num_speculative_tokens
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.lm = RaggedLM(
            model,
            prefix_cache_max_tokens=prefix_cache_max_tokens,
            kv_cache_max_bytes=kv_cache_max_bytes,
            name="verify service",
        )
        smallest = MEASURE_CONTEXT + max_num_speculative_tokens + 1  # a verify of the largest K after the context
        if -(-smallest // BLOCK_SIZE) + self.lm.watermark > self.lm.max_blocks:
            raise ValueError(
                f"{SETTING} ({self.lm.kv_cache_max_bytes} bytes) cannot hold the start-up measurement's sequence of "
                f"{smallest} tokens ({MEASURE_CONTEXT} of context and a verify of max_num_speculative_tokens + 1) "
                f"with its watermark: raise --kv-cache-max-bytes to at least "
                f"{(-(-smallest // BLOCK_SIZE) + self.lm.watermark) * self.lm.block_bytes} bytes"
            )
        self.engine = Engine(
            self.lm,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            limits.batch_wait_ms,
            name="verify",
            max_num_batched_tokens_alone=limits.max_num_batched_tokens_alone,
            batch_wait_step_share=limits.batch_wait_step_share,
            wait_for_turnaround=limits.batch_wait_turnaround,
        )
        self.verify_ms: list[float] = []  # index K: a verify round with K draft tokens, see measure_costs
        self.step_costs: list[tuple[int, int, float]] = []  # (num_tokens, num_seqs, ms), see measure_costs

    @classmethod
    def load(
        cls,
        spec: str,
        dtype: str,
        device_map: str | None,
        max_k: int,
        limits: EngineLimits | None = None,
        prefix_cache_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        pack_linear_weights: bool = True,
        kv_cache_max_bytes: int = 0,
    ) -> "Target":
        """Loads ``spec`` (see :func:`specdec.engine.models.load_causal_lm`), with its linear layers on
        oneDNN on a CPU unless ``pack_linear_weights`` is False (:mod:`specdec.engine.cpu_linear`), and
        measures its step costs."""
        model, tokenizer = load_causal_lm(spec, dtype=dtype, device_map=device_map)
        if pack_linear_weights:
            pack_linears(model)
        target = cls(model, tokenizer, spec, max_k, limits, prefix_cache_max_tokens, kv_cache_max_bytes)
        target.measure_costs()
        target.grammar_tokenizer  # noqa: B018 (built now: building it holds the GIL for about 0.4 s)
        return target

    def measure_costs(self, context_len: int = MEASURE_CONTEXT) -> None:
        """Measures, in ms (the fastest of 3 after ``context_len`` tokens), for the coordinator's
        choice of K: ``verify_ms[K]``, a verify round with K draft tokens alone in its step (K = 0:
        a plain decode step), and ``step_costs``, decode steps of 1, 2, 4, ... sequences up to
        ``max_num_seqs``, or as many as the KV budget admits; with them it seeds the engine's
        step line (:class:`specdec.engine.step_line.StepLine`). It also warms the model up, so the
        first request does not pay for lazy initialisation."""
        context = [i % self.vocab_size for i in range(context_len)]
        with tracer.start_as_current_span("measure_costs"):
            sessions = [self.new_session(context, SamplingParams())]

            def verify(k: int) -> None:
                sessions[0].next_logits([(context_len + i) % self.vocab_size for i in range(k)])
                sessions[0].rollback()

            self.verify_ms = [min_ms(lambda k=k: verify(k)) for k in range(self.max_num_speculative_tokens + 1)]
            self.step_costs = [(1, 1, self.verify_ms[0])]
            num_seqs = 2
            while num_seqs <= self.limits.max_num_seqs:
                try:
                    while len(sessions) < num_seqs:
                        sessions.append(self.new_session(context, SamplingParams()))
                except ResourceExhausted:  # a small KV budget: measured up to the batches it holds
                    break
                self.step_costs.append(
                    (num_seqs, num_seqs, min_ms(lambda sessions=sessions: self._decode_all(sessions)))
                )
                num_seqs *= 2
            for session in sessions:
                session.close()
        # the engine's published step line starts from the fastest of each (see StepLine.seed)
        self.engine.step_line.seed(
            [(k + 1, ms) for k, ms in enumerate(self.verify_ms)] + [(n, ms) for n, _, ms in self.step_costs]
        )

    @functools.cached_property
    def grammar_tokenizer(self):
        """The llguidance view of the tokenizer: built by :meth:`load` (a target made otherwise
        builds it at its first structured-output request)."""
        return grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def grammar_matcher(self, sampling: SamplingParams, committed: Sequence[int]) -> GrammarMatcher | None:
        """The request's grammar state after ``committed`` (its generated part); None without
        structured output. Raises InvalidArgument for a spec that does not compile or a log off it.
        No limits of its own: the coordinator checked the spec against its ``--grammar-*`` limits
        (docs/architecture.md#structured-output)."""
        if sampling.structured_output is None:
            return None
        generated = committed[sampling.num_prompt_tokens :]
        return GrammarMatcher.from_log(sampling.structured_output, self.grammar_tokenizer, UNLIMITED, generated)

    def _decode_all(self, sessions: list["TargetSession"]) -> None:
        """One step with one new token for every session (rolled back after)."""
        steps = [session.kv_cache.step(session.kv_cache.reconcile(session.committed)) for session in sessions]
        self.lm.forward(steps)
        for session, step in zip(sessions, steps, strict=True):
            session.kv_cache.appended(step)
            session.rollback()

    def new_session(
        self,
        committed: Sequence[int],
        sampling: SamplingParams,
        timeout_s: float | None = None,
        abandoned: Callable[[], bool] | None = None,
        decode: bool = False,
        cache_salt: str = "",
        owner: str = "",
    ) -> "TargetSession":
        """Opens a session of ``owner`` (:meth:`specdec.engine.batching.BatchedLM.allocate`: under
        KV pressure the owner holding the most KV gives first) and runs prefill (``timeout_s`` and
        ``abandoned`` as in :meth:`specdec.engine.engine.Engine.run`; ``decode``: and the first decode step, see
        :meth:`TargetSession.prefill`; the tokens found in the prefix cache, in its partition
        ``cache_salt``, are the session's ``kv_cache.num_cached_tokens``). Raises InvalidArgument
        for an empty or too long context or ids out of range or top_logprobs above the vocabulary
        size, Unavailable when the deadline passes first."""
        if not committed:
            raise InvalidArgument("token_ids is empty: prefill needs at least one token")
        if len(committed) >= self.max_context_length:
            raise InvalidArgument(
                f"context of {len(committed)} tokens does not fit the target's window of "
                f"{self.max_context_length} tokens: shorten the prompt"
            )
        check_token_ids(committed, self.vocab_size, "token_ids")
        if sampling.top_logprobs > self.vocab_size:
            raise InvalidArgument(
                f"top_logprobs is {sampling.top_logprobs}: it must not exceed the vocabulary size ({self.vocab_size})"
            )
        session = TargetSession(self, sampling, cache_salt, owner)
        try:
            session.prefill(committed, timeout_s, abandoned, decode)
        except BaseException:
            session.close()
            raise
        return session


class _Score(Work):
    """Scores ``draft_tokens`` after the committed prefix in one step; ``result`` is the ``[K + 1, V]``
    float32 logits. Subclasses test and commit instead."""

    def __init__(self, session: "TargetSession", draft_tokens: Sequence[int]):
        self.session, self.seq_id = session, session.kv_cache.seq_id
        self.draft_tokens = list(draft_tokens)

    def next_step(self, budget: int) -> SequenceStep:
        kv_cache = self.session.kv_cache
        return kv_cache.step(
            [*kv_cache.reconcile(self.session.committed), *self.draft_tokens], num_logits=len(self.draft_tokens) + 1
        )

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        self.session.kv_cache.appended(step)
        self.result = self.take(logits)
        return True

    def take(self, logits: torch.Tensor):
        return logits


class _Verify(_Score):
    """The acceptance test, for every verify of a step at once (:meth:`accept`), then commit:
    ``result`` is ``(n, next_token)``; ``logprobs``, with the session's ``sampling.logprobs``, the
    committed tokens' (:mod:`specdec.sampling.logprobs`)."""

    def __init__(self, session: "TargetSession", draft_tokens: Sequence[int], draft_probs: torch.Tensor | None):
        super().__init__(session, draft_tokens)
        self.draft_probs = draft_probs
        self.outcome = (0, 0)  # (n, next_token), set by accept
        self.logprobs: list[common_pb2.TokenLogprobs] = []  # set by accept when the session asks
        self.accept_ns = (0, 0)  # when the step's acceptance pass ran (ns since the epoch)

    @classmethod
    def accept(cls, works: list[Work], logits: list[torch.Tensor]) -> None:
        """The step's greedy verifies in one :func:`greedy_accept`, its sampled ones in one
        :func:`rejection_sample`, each draw seeded by (request seed, committed length); then the
        raw log-probabilities of what the verifies asking for them commit, in one pass."""
        start = time.time_ns()
        verifies = [cast(_Verify, work) for work in works]
        raw, logits = logits, [work.processed(rows) for work, rows in zip(verifies, logits, strict=True)]
        for greedy in (True, False):
            chosen = [(work, rows) for work, rows in zip(verifies, logits, strict=True) if work.greedy == greedy]
            if not chosen:
                continue
            drafts = [work.draft_tokens for work, _ in chosen]
            if greedy:
                outcomes = greedy_accept(drafts, [rows for _, rows in chosen])
            else:
                target_probs = [logits_to_probs(rows, work.session.sampling) for work, rows in chosen]
                draft_probs = [work.q(rows.shape[-1]) for work, rows in chosen]
                generators = [work.generator() for work, _ in chosen]
                outcomes = rejection_sample(drafts, draft_probs, target_probs, generators)
            for (work, _), outcome in zip(chosen, outcomes, strict=True):
                work.outcome = outcome
        cls._logprobs(
            [(work, rows) for work, rows in zip(verifies, raw, strict=True) if work.session.sampling.logprobs]
        )
        for work in verifies:
            work.accept_ns = (start, time.time_ns())

    @staticmethod
    def _logprobs(asking: list[tuple["_Verify", torch.Tensor]]) -> None:
        """Sets each work's ``logprobs`` from its raw logits (rows 0..n: the positions of draft[:n]
        and the next token)."""
        if not asking:
            return
        committed = [[*work.draft_tokens[: work.outcome[0]], work.outcome[1]] for work, _ in asking]
        rows = [raw[: len(tokens)] for (_, raw), tokens in zip(asking, committed, strict=True)]
        tops = [work.session.sampling.top_logprobs for work, _ in asking]
        for (work, _), logprobs in zip(asking, committed_logprobs(rows, committed, tops), strict=True):
            work.logprobs = logprobs

    @property
    def greedy(self) -> bool:
        return self.session.sampling.greedy

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """``[K + 1, V]``: the step's logits of this verify after the request's logits processors
        and grammar mask (disallowed tokens at -inf), row i's from the committed tokens and the
        first i draft tokens."""
        session = self.session
        logits = process(logits, session.sampling, session.committed, self.draft_tokens)
        if session.grammar is None:
            return logits
        masks = torch.from_numpy(session.grammar.masks_along(self.draft_tokens)).to(logits.device)
        return logits.masked_fill(~masks, float("-inf"))

    def q(self, vocab_size: int) -> torch.Tensor:
        """The draft distributions, ``[K, V]`` float32 (K = 0: none sent)."""
        return torch.empty(0, vocab_size) if self.draft_probs is None else self.draft_probs

    def generator(self) -> torch.Generator:
        session = self.session
        return round_generator(session.sampling.seed, len(session.committed), "verify")

    def take(self, logits: torch.Tensor) -> tuple[int, int]:
        session, drafts, (n, token) = self.session, self.draft_tokens, self.outcome
        attributes = {
            "specdec.num_draft_tokens": len(drafts),
            "specdec.num_accepted": n,
            "specdec.bonus_token": bool(drafts) and n == len(drafts),
        }
        tracer.start_span("acceptance", attributes=attributes, start_time=self.accept_ns[0]).end(
            end_time=self.accept_ns[1]
        )
        session.committed.extend([*drafts[:n], token])
        if session.grammar is not None:
            session.grammar.advance([*drafts[:n], token])
        session.rollback()
        return n, token


class _FirstToken(_Verify):
    """``Prefill(decode=true)``'s work: the prompt's tokens the prefix cache lacks, scheduled as a
    prefill (after the step's decoding work, a chunk of the step's leftover token budget at a
    time), and in the step of the chunk that holds the prompt's last token the decode of the
    token after it, from that chunk's last row, so a prompt takes as many forwards as its chunks
    (docs/architecture.md#one-round)."""

    is_prefill = True

    def __init__(self, session: "TargetSession"):
        super().__init__(session, [], None)

    def next_step(self, budget: int) -> SequenceStep:
        kv_cache = self.session.kv_cache
        pending = kv_cache.reconcile(self.session.committed)
        if len(pending) <= budget:
            return kv_cache.step(pending)
        return kv_cache.step(pending[:budget], num_logits=0)

    @classmethod
    def accept(cls, works: list[Work], logits: list[torch.Tensor]) -> None:
        """The acceptance pass of the works whose last chunk ran (the others have no logits)."""
        last = [i for i, rows in enumerate(logits) if len(rows)]
        super().accept([works[i] for i in last], [logits[i] for i in last])

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        if step.num_logits:
            return super().finish_step(step, logits)
        self.session.kv_cache.appended(step)
        return False


class TargetSession:
    """One request's committed tokens and its sequence in the target's KV store, in the prefix
    cache's partition ``cache_salt``. ``last_step``: the step that served the last call;
    ``last_logprobs``: with ``sampling.logprobs``, the log-probabilities of the tokens the last
    :meth:`verify` committed, one per token."""

    def __init__(self, target: Target, sampling: SamplingParams, cache_salt: str = "", owner: str = ""):
        self.target = target
        self.sampling = sampling
        self.committed: list[int] = []
        self.grammar: GrammarMatcher | None = None  # with structured output: the state after committed
        self.kv_cache = SequenceKV(target.lm, cache_salt, owner)
        self.last_step = StepStats()
        self.last_logprobs: list[common_pb2.TokenLogprobs] = []

    def _run(self, work: Work, timeout_s: float | None, abandoned: Callable[[], bool] | None):
        result, self.last_step = self.target.engine.run(work, timeout_s, abandoned)
        return result

    def prefill(
        self,
        committed: Sequence[int],
        timeout_s: float | None = None,
        abandoned: Callable[[], bool] | None = None,
        decode: bool = False,
    ) -> int | None:
        """Caches ``committed`` but its last token (chunked prefill, after what the prefix cache
        holds of it). With ``decode`` it also decodes the token after ``committed`` and commits it
        (returned; None without): the prefill's last chunk runs as that decode step's work, so the
        first token costs no forward of its own (as in plain decoding, where the prompt's forward
        gives it) and is the token a Decode right after the prefill would give (the same seeded
        draw; its log-probabilities in ``last_logprobs``)."""
        self.committed = list(committed)
        self.grammar = self.target.grammar_matcher(self.sampling, self.committed)
        work = _FirstToken(self) if decode else None
        stats = prefill(self.target.engine, self.kv_cache, self.committed, timeout_s, abandoned, work)
        self.last_step = stats or StepStats()
        if work is None:
            return None
        self.last_logprobs = work.logprobs
        return work.outcome[1]

    def next_logits(self, draft_tokens: Sequence[int] = ()) -> torch.Tensor:
        """``[len(draft_tokens) + 1, V]`` float32 logits after the committed prefix and after each
        draft token, appending their KV (rolled back by :meth:`rollback` or the next call)."""
        return self._run(_Score(self, draft_tokens), None, None)

    def verify(
        self,
        draft_tokens: Sequence[int],
        draft_probs: torch.Tensor | None,
        timeout_s: float | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> tuple[int, int]:
        """Runs the acceptance test on a proposal in the next step and commits its outcome.

        Args:
            draft_tokens: K proposed ids (K may be 0: a plain decode step).
            draft_probs: q, ``[K, V]`` float32, required when sampling; ignored under greedy.
            timeout_s, abandoned: as in :meth:`specdec.engine.engine.Engine.run`.
        Returns:
            ``(n, next_token)``: accepted drafts and the correction or bonus token (their
            log-probabilities, when the session asks for them, in ``last_logprobs``).
        Raises:
            what :meth:`verification` raises; Unavailable: the deadline passed before a step ran it.
        """
        work = self.verification(draft_tokens, draft_probs)
        outcome = self._run(work, timeout_s, abandoned)
        self.last_logprobs = work.logprobs
        return outcome

    def verification(self, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None) -> _Verify:
        """The engine work of :meth:`verify` (same arguments), for a caller that submits it itself
        (:meth:`specdec.engine.engine.Engine.submit`): once done, its ``result`` is ``(n, next_token)``
        and its ``logprobs`` those of the committed tokens (with ``sampling.logprobs``).

        With structured output, the proposal is cut after its first token the grammar rejects
        before it is scored (vLLM's ``validate_tokens``): the tokens after it can never be reached.
        That token itself is kept: its target probability is 0 under the mask, so the acceptance
        test rejects it and draws the recovered token from max(0, p - q), which keeps sampling
        lossless whatever the draft's q (a draft without grammar-aware drafting drew it from
        an unmasked q); under greedy decoding it is the masked argmax, as a cut before it gives.

        Raises:
            InvalidArgument: K above the limit, the window would overflow, ids out of range, or
                missing draft distributions under sampling.
        """
        self._check(draft_tokens, draft_probs)
        if self.grammar is not None:
            k = min(self.grammar.valid_prefix(draft_tokens) + 1, len(draft_tokens))
            draft_tokens, draft_probs = draft_tokens[:k], None if draft_probs is None else draft_probs[:k]
        return _Verify(self, draft_tokens, draft_probs)

    def rollback(self) -> None:
        """Drops cached positions past the committed prefix (rejected drafts)."""
        self.kv_cache.reconcile(self.committed)

    def _check(self, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None) -> None:
        k, target = len(draft_tokens), self.target
        if k > target.max_num_speculative_tokens:
            raise InvalidArgument(
                f"{k} draft tokens exceed the verify service's limit of "
                f"{target.max_num_speculative_tokens} (its --max-num-speculative-tokens, "
                f"{VerifySettings.variable('max_num_speculative_tokens')}): send at most that many"
            )
        if len(self.committed) + k + 1 > target.max_context_length:
            raise InvalidArgument(
                f"{len(self.committed)} committed + {k} draft tokens overflow the window of "
                f"{target.max_context_length}: lower num_speculative_tokens or max_new_tokens"
            )
        check_token_ids(draft_tokens, target.vocab_size, "draft_token_ids")
        if k and not self.sampling.greedy:
            if draft_probs is None or draft_probs.shape[0] != k:
                raise InvalidArgument("sampling needs one draft distribution per draft token")
            drawn = draft_probs[torch.arange(k), torch.tensor(draft_tokens)]
            if not bool((drawn > 0).all()):
                raise InvalidArgument(
                    "a draft token has probability 0 in its draft distribution: send the distribution it was drawn from"
                )

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.cache_bytes()

    def lost(self) -> str | None:
        """Why the session's KV was preempted (its calls then fail with NOT_FOUND), None while it holds it."""
        return self.kv_cache.lost()

    def close(self) -> None:
        self.target.engine.forget(self.kv_cache.seq_id)
        self.kv_cache.close()

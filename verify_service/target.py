"""The target model and its per-session state: prefill, verify, decode, rollback.

Traced (OpenTelemetry spans, no-ops with tracing off): each verification's ``acceptance`` test,
besides the ``prefill``, ``forward`` and ``rollback`` spans of :mod:`specdec.kv`.
"""

import threading
from collections.abc import Sequence

import torch
from opentelemetry import trace

from specdec.acceptance import greedy_accept, rejection_sample
from specdec.errors import InvalidArgument
from specdec.kv import KVCachedLM
from specdec.models import context_window, load_causal_lm
from specdec.sampling import SamplingParams, logits_to_probs, round_generator
from specdec.timing import min_ms
from specdec.vocab import tokenizer_fingerprint

tracer = trace.get_tracer(__name__)


class Target:
    """A loaded target model shared by all sessions of the verify service."""

    def __init__(self, model, tokenizer, name: str, max_num_speculative_tokens: int):
        self.model = model
        self.name = name
        self.lock = threading.Lock()
        self.vocab_fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = model.config.vocab_size
        self.max_context_length = context_window(model)
        self.max_num_speculative_tokens = max_num_speculative_tokens
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.verify_ms: list[float] = []  # index K: a verify round with K draft tokens, see measure_verify_ms

    @classmethod
    def load(cls, spec: str, dtype: str, device_map: str | None, max_k: int) -> "Target":
        model, tokenizer = load_causal_lm(spec, dtype=dtype, device_map=device_map)
        target = cls(model, tokenizer, spec, max_k)
        target.measure_verify_ms()
        return target

    def measure_verify_ms(self, context_len: int = 64) -> list[float]:
        """Measures a verify round's cost for K = 0 (a plain decode step) to the largest K, in ms
        (the fastest of 3 forwards after ``context_len`` tokens), for the coordinator's choice of
        K; stores and returns it. It also warms the model up, so the first request does not pay for
        lazy initialisation."""
        def forward(k: int) -> None:
            session.next_logits([(context_len + i) % self.vocab_size for i in range(k)])[-1].argmax().item()
            session.commit([])  # roll the draft tokens back

        with tracer.start_as_current_span("measure_verify_ms"):
            session = self.new_session([i % self.vocab_size for i in range(context_len)], SamplingParams())
            self.verify_ms = [min_ms(lambda k=k: forward(k)) for k in range(self.max_num_speculative_tokens + 1)]
            session.close()
        return self.verify_ms

    def new_session(self, committed: Sequence[int], sampling: SamplingParams) -> "TargetSession":
        """Opens a session and runs prefill. Raises InvalidArgument for an empty or too long context."""
        if not committed:
            raise InvalidArgument("token_ids is empty: prefill needs at least one token")
        if len(committed) >= self.max_context_length:
            raise InvalidArgument(
                f"context of {len(committed)} tokens does not fit the target's window of "
                f"{self.max_context_length} tokens: shorten the prompt"
            )
        if max(committed) >= self.vocab_size or min(committed) < 0:
            raise InvalidArgument(f"token_ids must lie in [0, {self.vocab_size})")
        session = TargetSession(self, sampling)
        session.prefill(committed)
        return session


class TargetSession:
    """One request's committed tokens and target KV cache."""

    def __init__(self, target: Target, sampling: SamplingParams):
        self.target = target
        self.sampling = sampling
        self.committed: list[int] = []
        self.lm = KVCachedLM(target.model, target.lock)

    def prefill(self, committed: Sequence[int]) -> None:
        self.committed = list(committed)
        self.lm.prefill(self.committed)

    def next_logits(self, draft_tokens: Sequence[int] = ()) -> torch.Tensor:
        """``[len(draft_tokens) + 1, V]`` float32 logits after the committed prefix and after each
        draft token, appending their KV (rolled back by :meth:`commit`)."""
        pending = self.lm.reconcile(self.committed)
        return self.lm.extend([*pending, *draft_tokens], num_logits=len(draft_tokens) + 1)

    def verify(
        self, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None
    ) -> tuple[int, int]:
        """Runs the acceptance test on a proposal and commits its outcome.

        Args:
            draft_tokens: K proposed ids (K may be 0: a plain decode step).
            draft_probs: q, ``[K, V]`` float32, required when sampling; ignored under greedy.
        Returns:
            ``(n, next_token)``: accepted drafts and the correction or bonus token.
        Raises:
            InvalidArgument: K above the limit, the window would overflow, ids out of range, or
                missing draft distributions under sampling.
        """
        self._check(draft_tokens, draft_probs)
        logits = self.next_logits(draft_tokens)
        with tracer.start_as_current_span("acceptance", attributes={"specdec.num_draft_tokens": len(draft_tokens)}) as span:
            if self.sampling.greedy:
                n, token = greedy_accept(draft_tokens, logits)
            else:
                generator = round_generator(self.sampling.seed, len(self.committed), "verify")
                target_probs = logits_to_probs(logits, self.sampling)
                n, token = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
            span.set_attributes({"specdec.num_accepted": n, "specdec.bonus_token": bool(draft_tokens) and n == len(draft_tokens)})
        self.commit([*draft_tokens[:n], token])
        return n, token

    def commit(self, tokens: Sequence[int]) -> None:
        """Appends committed tokens and rolls the KV cache back to the committed prefix."""
        self.committed.extend(tokens)
        self.lm.reconcile(self.committed)

    def _check(self, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None) -> None:
        k, target = len(draft_tokens), self.target
        if k > target.max_num_speculative_tokens:
            raise InvalidArgument(
                f"{k} draft tokens exceed the verify service's limit of "
                f"{target.max_num_speculative_tokens}: lower num_speculative_tokens"
            )
        if len(self.committed) + k + 1 > target.max_context_length:
            raise InvalidArgument(
                f"{len(self.committed)} committed + {k} draft tokens overflow the window of "
                f"{target.max_context_length}: lower num_speculative_tokens or max_new_tokens"
            )
        if draft_tokens and (max(draft_tokens) >= target.vocab_size or min(draft_tokens) < 0):
            raise InvalidArgument(f"draft_token_ids must lie in [0, {target.vocab_size})")
        if k and not self.sampling.greedy and (draft_probs is None or draft_probs.shape[0] != k):
            raise InvalidArgument("sampling needs one draft distribution per draft token")

    def kv_cache_bytes(self) -> int:
        lm = self.lm  # None once closed
        return lm.cache_bytes() if lm is not None else 0

    def close(self) -> None:
        self.lm = None  # drop the KV cache now, not when the registry entry is collected

"""The engine loop: every pending call of every session joins the next batched forward.

One thread per model runs steps (continuous batching, as in vLLM and Orca): a step takes the
pending work in arrival order, at most ``max_num_seqs`` sequences and ``max_num_batched_tokens``
new tokens, runs one :meth:`specdec.batching.BatchedLM.forward` over all of it, and hands each
sequence its slice of the logits: first to one pass per kind of work over all of that kind in the
step (:meth:`Work.accept`: the verify's acceptance test for every sequence at once), then to each
work's :meth:`Work.finish_step`. Sessions join and leave between steps; a step never waits for a
full batch, only (up to ``batch_wait_ms``) for the sequences of the previous step whose callers
are about to send their next call, so that clients share steps instead of alternating.

Scheduling (vLLM's chunked prefill): work that decodes (a verify of K + 1 tokens, a decode step,
a proposal's next token) goes first; a prefill takes what the token budget leaves, a chunk at a
time, so one long prompt does not stall every other session's decode. A call that waits longer
than its deadline gives up (its work is dropped unless a step already runs it); bounded sessions
(the registry's ``max_sessions``) bound the queue.

Traced: a work's steps run in the OpenTelemetry context of the call that queued it, so the spans
they open (acceptance, rollback) sit under that call's span, and each step adds a ``forward`` span
there (attributes: the call's ``specdec.num_tokens``, the step's ``specdec.batch_size`` and
``specdec.num_batched_tokens``).
"""

import abc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec.batching import BatchedLM, SequenceStep
from specdec.errors import Unavailable
from specdec.prom import EngineMetrics

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass
class StepStats:
    """The last step that ran a call's work: sequences and batched tokens in it, its forward time
    (ms), the time the call waited before its first step began (ms), and the running sequences
    (served in the last two steps or queued: the batch a step would hold if every session kept
    in step, also those away drafting)."""

    num_seqs: int = 0
    num_tokens: int = 0
    step_ms: float = 0.0
    queue_ms: float = 0.0
    num_running_seqs: int = 0


class Work(abc.ABC):
    """One call's work on one sequence, run over one or more steps.

    ``is_prefill``: scheduled after decoding work, chunked to the leftover token budget.
    """

    seq_id: int  # the sequence it runs on
    is_prefill: bool = False
    result: object = None

    @abc.abstractmethod
    def next_step(self, budget: int) -> SequenceStep:
        """This step's share: new tokens (at most ``budget`` when the work can be chunked; a
        decoding step may exceed it and then waits for a step with room) and how many logits it
        needs. Must not change state: a step that cannot fit it asks again next time."""

    @classmethod  # noqa: B027 (a no-op unless a kind of work has a batched pass)
    def accept(cls, works: list["Work"], logits: list[torch.Tensor]) -> None:
        """Runs once per step, before :meth:`finish_step`, over every work of this class in the
        step and their logits (each ``[num_logits, V]`` float32), for what costs less done for all
        sequences at once (the acceptance test). Does nothing here."""

    @abc.abstractmethod
    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        """Takes the step's logits (``[step.num_logits, V]`` float32); True when the work is done
        (``result`` set), False when it needs another step."""


@dataclass
class _Entry:
    work: Work
    arrival: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)
    stats: StepStats = field(default_factory=StepStats)
    started: bool = False
    abandoned: bool = False
    context: otel_context.Context = field(default_factory=otel_context.get_current)

    def call(self, method, *args):
        """``method(*args)`` in the OpenTelemetry context of the call that queued this entry."""
        token = otel_context.attach(self.context)
        try:
            return method(*args)
        finally:
            otel_context.detach(token)


class Engine:
    """The engine loop over ``lm`` (see the module docstring); ``name`` labels its thread and
    metrics. Raises ValueError for limits below 1."""

    def __init__(
        self,
        lm: BatchedLM,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batch_wait_ms: float = 0.0,
        metrics: EngineMetrics | None = None,
        name: str = "engine",
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.lm = lm
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.batch_wait_s = batch_wait_ms / 1000
        self.metrics = metrics or EngineMetrics()
        self.name = name
        self._queue: list[_Entry] = []
        self._cond = threading.Condition()
        self._recent: list[set[int]] = [set(), set()]  # sequences whose work finished in the last two steps
        self._step_end = 0.0
        self._thread: threading.Thread | None = None
        self._stopped = False

    def run(self, work: Work, timeout_s: float | None = None, on_wait: Callable[[], bool] | None = None):
        """Queues ``work``, waits for it and returns ``(work.result, StepStats)``.

        Args:
            timeout_s: seconds to wait at most (the call's deadline); None waits indefinitely.
            on_wait: asked every second while waiting; True (the caller went away) abandons the work.
        Raises:
            Unavailable: the deadline passed first, or the engine stopped.
            what the work's steps raise (the whole step fails: every call in it gets the error).
        """
        entry = _Entry(work)
        with self._cond:
            if self._stopped:
                raise Unavailable(f"the {self.name} engine is stopping: retry on another replica")
            self._ensure_thread()
            self._queue.append(entry)
            self._cond.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                return entry.future.result(wait), entry.stats
            except FutureTimeout:
                expired = deadline is not None and time.monotonic() >= deadline
                if expired or (on_wait is not None and on_wait()):
                    self._abandon(entry)
                    raise Unavailable(
                        f"the {self.name} engine did not run the call before its deadline: the service is "
                        "overloaded; retry later, or lower max_num_seqs load by adding replicas"
                    ) from None

    def forget(self, seq_id: int) -> None:
        """The sequence is gone (its session closed): no step waits for its next call."""
        with self._cond:
            for recent in self._recent:
                recent.discard(seq_id)
            self._cond.notify_all()

    def stop(self) -> None:
        """Stops the loop after the running step; queued calls fail with Unavailable."""
        with self._cond:
            self._stopped = True
            for entry in self._queue:
                entry.future.set_exception(Unavailable(f"the {self.name} engine stopped"))
            self._queue.clear()
            self._cond.notify_all()

    # --- the loop ------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"{self.name}-engine", daemon=True)
            self._thread.start()

    def _abandon(self, entry: _Entry) -> None:
        with self._cond:
            entry.abandoned = True
            if entry in self._queue and not entry.started:
                self._queue.remove(entry)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._wait_for_previous()
                batch = self._schedule()
                running = len(self._recent[0] | self._recent[1] | {e.work.seq_id for e in self._queue})
            if batch:
                self._step(batch, running)

    def _wait_for_previous(self) -> None:
        """Waits (holding the condition) up to ``batch_wait_ms`` after the last step for the
        sequences served in the last two steps to queue their next call, so that sessions which
        alternated between steps come together; with one sequence about there is no batch to
        keep together, and nothing waits."""
        recent = self._recent[0] | self._recent[1]
        if len(recent) < 2:
            return
        deadline = self._step_end + self.batch_wait_s
        while recent - {e.work.seq_id for e in self._queue} and not self._stopped:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._cond.wait(remaining)

    def _schedule(self) -> list[tuple[_Entry, SequenceStep]]:
        """This step's entries and their steps: decoding work first, then prefill chunks, in
        arrival order, within the limits."""
        self._queue = [e for e in self._queue if not e.abandoned]
        batch: list[tuple[_Entry, SequenceStep]] = []
        budget, seqs = self.max_num_batched_tokens, set()
        for prefill in (False, True):
            for entry in self._queue:
                work = entry.work
                if work.is_prefill != prefill or work.seq_id in seqs or len(batch) >= self.max_num_seqs or budget <= 0:
                    continue
                step = entry.call(work.next_step, budget)
                if len(step.token_ids) > budget and batch:
                    continue  # does not fit this step's budget: the next one
                batch.append((entry, step))
                seqs.add(work.seq_id)
                budget -= len(step.token_ids)
        return batch

    def _step(self, batch: list[tuple[_Entry, SequenceStep]], running: int) -> None:
        start, start_ns = time.perf_counter(), time.time_ns()
        for entry, _ in batch:
            if not entry.started:
                entry.started = True
                entry.stats.queue_ms = (start - entry.arrival) * 1000
                self.metrics.observe_queue(entry.stats.queue_ms)
        steps = [step for _, step in batch]
        try:
            logits = self.lm.forward(steps)
        except Exception as err:  # the step's calls fail; the engine goes on
            log.exception("%s engine: a step of %d sequences failed", self.name, len(batch))
            self._finish([(entry, err) for entry, _ in batch])
            return
        step_ms, end_ns = (time.perf_counter() - start) * 1000, time.time_ns()
        num_tokens = sum(len(step.token_ids) for step in steps)
        self.metrics.observe_step(len(batch), num_tokens, step_ms)
        failed = self._accept(batch, logits)
        outcomes: list[tuple[_Entry, Exception | None]] = []
        for i, ((entry, step), rows) in enumerate(zip(batch, logits, strict=True)):
            entry.stats.num_seqs, entry.stats.num_tokens, entry.stats.step_ms = len(batch), num_tokens, step_ms
            entry.stats.num_running_seqs = max(running, len(batch))
            attributes = {
                "specdec.num_tokens": len(step.token_ids),
                "specdec.batch_size": len(batch),
                "specdec.num_batched_tokens": num_tokens,
            }
            tracer.start_span("forward", context=entry.context, attributes=attributes, start_time=start_ns).end(
                end_time=end_ns
            )
            if i in failed:
                outcomes.append((entry, failed[i]))
                continue
            try:
                done = entry.call(entry.work.finish_step, step, rows)
            except Exception as err:  # any failure is handed to the caller
                outcomes.append((entry, err))
                continue
            if done:
                outcomes.append((entry, None))
        self._finish(outcomes)

    def _accept(self, batch: list[tuple[_Entry, SequenceStep]], logits: list[torch.Tensor]) -> dict[int, Exception]:
        """Runs :meth:`Work.accept` once per kind of work in the step; returns the batch indices of
        the entries whose kind's pass failed, with the error (they fail, the others go on)."""
        kinds: dict[type[Work], list[int]] = {}
        for i, (entry, _) in enumerate(batch):
            kinds.setdefault(type(entry.work), []).append(i)
        failed: dict[int, Exception] = {}
        for kind, indices in kinds.items():
            try:
                kind.accept([batch[i][0].work for i in indices], [logits[i] for i in indices])
            except Exception as err:  # handed to the callers of that kind of work
                failed.update((i, err) for i in indices)
        return failed

    def _finish(self, outcomes: list[tuple[_Entry, Exception | None]]) -> None:
        with self._cond:
            self._recent = [set(), self._recent[0]]
            for entry, err in outcomes:
                if entry in self._queue:
                    self._queue.remove(entry)
                self._recent[0].add(entry.work.seq_id)
                if err is None:
                    entry.future.set_result(entry.work.result)
                else:
                    entry.future.set_exception(err)
            self._step_end = time.perf_counter()

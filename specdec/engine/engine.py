"""The engine loop: every pending call of every session joins the next batched forward.

One thread per model runs steps (continuous batching, as in vLLM and Orca): a step takes the
pending work in arrival order, at most ``max_num_seqs`` sequences and ``max_num_batched_tokens``
new tokens, runs one :meth:`specdec.engine.batching.BatchedLM.forward` over all of it, and hands each
sequence its slice of the logits: first to one pass per kind of work over all of that kind in the
step (:meth:`Work.accept`: the verify's acceptance test for every sequence at once), then to each
work's :meth:`Work.finish_step`. Sessions join and leave between steps; a step never waits for a
full batch, only (up to ``batch_wait_ms``, or ``batch_wait_step_share`` of the last step's
forward time where longer) for the sequences of the previous step whose callers are about to send
their next call, so that clients share steps instead of alternating. The share, because a call
that misses a step waits a whole one, and the callers' turnaround grows with the batch. With
``wait_for_turnaround``, the wait also stretches to the callers' turnaround as measured (from a
step's end to the next call of a sequence it served: within which three quarters of the last 64
came back, times 1.25), never past one step's forward time: a network between the callers and the
service adds its round trip to every turnaround, and a fixed wait below it lets every step miss
the calls that would have joined it. Why both: docs/profiles.md#the-engine-loop-and-adaptive-k-under-load.
No wait where the sequences already queued outweigh those still to come (their wait times their
number against a step each for the late ones): most of the batch decodes ahead and a few turn
around, and those few join the next step.

Scheduling (vLLM's chunked prefill): work that decodes (a verify of K + 1 tokens, a decode step,
a proposal's next token) goes first; a prefill takes what the token budget leaves, a chunk at a
time, so one long prompt does not stall every other session's decode. A sequence alone on the
engine (nothing else queued, no other open sequence served in the last two steps) has nobody to
stall: its step may take up to ``max_num_batched_tokens_alone`` tokens, so that a prompt that fits
is prefilled in one forward, as plain decoding does (one forward is faster than its chunks). A call that waits longer
than its deadline gives up (its work is dropped unless a step already runs it); bounded sessions
(the registry's ``max_sessions``) bound the queue.

A call is queued by :meth:`Engine.submit`, which returns at once and hands the outcome to the
caller's callback from the engine's thread when the work is done; :meth:`Engine.run` waits for it
instead. So a service can take many sessions' calls without a thread waiting for each (the Step
streams, :mod:`specdec.rpc.step_server`; why:
docs/profiles.md#thread-hand-offs-and-padded-contexts). The engine
itself drops a queued call whose deadline passed or whose caller went away.

KV memory (docs/architecture.md#kv-memory-a-budget-in-bytes): a model's KV store may preempt a
sequence to give another room (:meth:`specdec.engine.batching.BatchedLM.lost`); its calls, queued or in
the step, then fail: NOT_FOUND (the session is gone: prefill it again), or RESOURCE_EXHAUSTED for
a prefill (refused, as at admission). The step's other calls go on.

A call's failure fails that call: its work's ``next_step`` or ``finish_step`` raising, its kind's
acceptance pass, the step's forward (every call in that step). The loop itself failing (its
scheduling or bookkeeping: a bug) is fatal: it is logged at CRITICAL with its traceback, every
queued call fails with UNAVAILABLE, later ones at once, and the handler given to
:meth:`Engine.watch` is called (the service reports NOT_SERVING and exits, so that its supervisor
restarts it: :class:`specdec.rpc.server.Liveness`), rather than the daemon thread dying
unseen while the service still reports SERVING. A step that does not end (a forward hung in the
model's library, a deadlock) is as fatal: given a step timeout, :meth:`Engine.watch` starts a
watchdog thread that finds a step running longer than it, and the engine gives up the same way
(its queued calls fail with UNAVAILABLE, the handler is called), though its thread cannot be
stopped.

Priced: every step of decoding work (no prefill chunk in it) teaches the engine's
:class:`specdec.engine.step_line.StepLine` what a step of that many batched tokens costs; its
service publishes the line with its load reports (:mod:`specdec.rpc.service_load`).

Traced: a work's steps run in the OpenTelemetry context of the call that queued it, so the spans
they open (acceptance, rollback) sit under that call's span, and each step adds a ``forward`` span
there (attributes: the call's ``specdec.num_tokens``, the step's ``specdec.batch_size`` and
``specdec.num_batched_tokens``).
"""

import abc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.step_line import StepLine
from specdec.handoff import together
from specdec.observability.prometheus import EngineMetrics
from specdec.rpc.errors import NotFound, ResourceExhausted, SpecdecError, Unavailable

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)
TURNAROUND_MARGIN = 1.25  # the wait for the previous step's calls: the callers' turnaround times this,
TURNAROUND_QUANTILE = 0.75  # the turnaround within which this share of the callers came back,
TURNAROUND_WINDOW = 64  # over the last this many calls


@dataclass
class StepStats:
    """The last step that ran a call's work: sequences and batched tokens in it, its forward time
    (ms), the time the call waited before its first step began (ms), the running sequences
    (served in the last two steps or queued: the batch a step would hold if every session kept
    in step, also those away drafting), and the batched tokens of prefill work."""

    num_seqs: int = 0
    num_tokens: int = 0
    step_ms: float = 0.0
    queue_ms: float = 0.0
    num_running_seqs: int = 0
    num_prefill_tokens: int = 0


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


# Called once with a call's outcome: (work.result, its StepStats, None), or (None, StepStats, the error).
Done = Callable[[object, "StepStats", BaseException | None], None]
# Called once if an engine's loop dies: (what died, for the log: "the verify engine loop"; the error).
Fatal = Callable[[str, BaseException], None]


class StepTimeout(RuntimeError):
    """A step of an engine ran longer than its step timeout: the engine is taken for dead."""


@dataclass(eq=False)  # compared by identity: entries are looked up in the queue
class _Entry:
    work: Work
    done: Done
    deadline: float | None = None  # time.perf_counter() after which a queued call gives up
    abandoned: Callable[[], bool] | None = None  # True once the caller went away
    arrival: float = field(default_factory=time.perf_counter)
    stats: StepStats = field(default_factory=StepStats)
    started: bool = False
    context: otel_context.Context = field(default_factory=otel_context.get_current)

    def call(self, method, *args):
        """``method(*args)`` in the OpenTelemetry context of the call that queued this entry."""
        if not self.context:  # nothing to attach (tracing off): the engine thread's is empty too
            return method(*args)
        token = otel_context.attach(self.context)
        try:
            return method(*args)
        finally:
            otel_context.detach(token)

    def given_up(self, now: float) -> bool:
        """Whether a call not yet started should be dropped: past its deadline, or its caller gone."""
        return (self.deadline is not None and now >= self.deadline) or (self.abandoned is not None and self.abandoned())


class Engine:
    """The engine loop over ``lm`` (see the module docstring); ``name`` labels its thread and
    metrics; ``max_num_batched_tokens_alone`` (tokens; None or less than
    ``max_num_batched_tokens``: the same) is the step budget of a sequence alone on the engine;
    ``batch_wait_ms``, ``batch_wait_step_share`` and ``wait_for_turnaround`` bound the wait for
    the previous step's sequences (see the module docstring). Raises ValueError for limits below 1."""

    def __init__(
        self,
        lm: BatchedLM,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batch_wait_ms: float = 0.0,
        metrics: EngineMetrics | None = None,
        name: str = "engine",
        max_num_batched_tokens_alone: int | None = None,
        batch_wait_step_share: float = 0.0,
        wait_for_turnaround: bool = False,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.lm = lm
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_num_batched_tokens_alone = max(max_num_batched_tokens, max_num_batched_tokens_alone or 0)
        self.batch_wait_s, self.batch_wait_step_share = batch_wait_ms / 1000, batch_wait_step_share
        self.wait_for_turnaround = wait_for_turnaround
        self._turnarounds: deque[float] = deque(maxlen=TURNAROUND_WINDOW)  # the last calls', s
        self.metrics = metrics or EngineMetrics()
        self.name = name
        self._queue: list[_Entry] = []
        self._num_waiting = 0  # queued calls no step has started (written holding the condition)
        self._num_running = 0  # the running sequences when the loop last counted them (idem)
        self._cond = threading.Condition()
        self._recent: list[set[int]] = [set(), set()]  # sequences whose work finished in the last two steps
        self._awaited: set[int] = set()  # recent sequences whose next call the loop waits for
        self._step_end = 0.0
        self._step_s = 0.0  # the last step's forward time
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._stop_reason = f"the {name} engine is stopping: retry on another replica"
        self._died: BaseException | None = None  # what killed the loop
        self._on_fatal: Fatal | None = None
        self._step_start: float | None = None  # time.perf_counter() when the running step began
        self.step_line = StepLine()  # what its decode steps cost, published in its service's load reports

    def submit(
        self,
        work: Work,
        done: Done,
        timeout_s: float | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> None:
        """Queues ``work`` and returns at once; ``done(result, stats, error)`` is called once, from
        the engine's thread (or this one, when the engine is stopping) in the OpenTelemetry
        context current here, with ``work.result`` and
        its :class:`StepStats`, or with the error: Unavailable when the call was not started before
        ``timeout_s`` seconds passed (None: no deadline) or ``abandoned()`` turned True (checked
        before each step), or the engine stopped or its loop died; NotFound (ResourceExhausted for
        a prefill) when the model's KV store preempted the work's sequence; what the work's steps
        raise (a failed forward fails the whole step: every call in it gets the error). ``done``
        must not block: it runs on the engine's thread (an error it raises is logged, and the loop
        goes on)."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        entry = _Entry(work, done, deadline, abandoned)
        with self._cond:
            stopped = self._stopped
            if not stopped:
                self._ensure_thread()
                self._queue.append(entry)
                self._num_waiting += 1
                if work.seq_id in self._recent[0] and threading.current_thread() is not self._thread:
                    # served by the last step: its caller's turnaround (not a call that waited here,
                    # queued by the engine's thread as the one before it finished: decode ahead)
                    self._turnarounds.append(time.perf_counter() - self._step_end)
                self._wake_for(work.seq_id)
        if stopped:
            done(None, entry.stats, Unavailable(self._stop_reason))

    def run(self, work: Work, timeout_s: float | None = None, on_wait: Callable[[], bool] | None = None):
        """:meth:`submit`, waiting for the outcome: returns ``(work.result, StepStats)`` or raises
        the error (``on_wait``: :meth:`submit`'s ``abandoned``)."""
        outcome: Future = Future()

        def done(result, stats: StepStats, error: BaseException | None) -> None:
            if error is None:
                outcome.set_result((result, stats))
            else:
                outcome.set_exception(error)

        self.submit(work, done, timeout_s, on_wait)
        return outcome.result()

    def forget(self, seq_id: int) -> None:
        """The sequence is gone (its session closed): no step waits for its next call."""
        with self._cond:
            for recent in self._recent:
                recent.discard(seq_id)
            self._count_running()
            self._wake_for(seq_id)

    def num_waiting_calls(self) -> int:
        """Calls queued that no step has started yet (those a step runs, or ran a part of, are not
        counted). A counter kept as calls come and go: reading it takes no lock and costs O(1), so a
        service can report it with every message (:mod:`specdec.rpc.service_load`)."""
        return self._num_waiting

    def num_running_seqs(self) -> int:
        """Running sequences as :class:`StepStats` counts them (served in the last two steps or
        queued), as the loop last counted them: before each step, and when a session closes. O(1),
        no lock."""
        return self._num_running

    def _wake_for(self, seq_id: int) -> None:
        """Wakes the loop (holding the condition) when it waits for this sequence's call, the last
        one it waits for (:meth:`_wait_for_previous`), or for any call (an empty queue); not for
        every call, which would wake it once per call of a step."""
        if self._awaited:
            self._awaited.discard(seq_id)
            if not self._awaited:
                self._cond.notify()
        elif len(self._queue) <= 1:
            self._cond.notify()

    def watch(self, on_fatal: Fatal, step_timeout_s: float = 0.0) -> None:
        """Has ``on_fatal(what, error)`` called if the loop dies (see the module docstring); at
        once when it died already. With ``step_timeout_s`` (seconds; 0: none), also when a step
        runs longer than that (the error a :class:`StepTimeout` naming ``engine_step_timeout_s``),
        found by a watchdog thread that looks a few times per timeout (at least once a second)."""
        with self._cond:
            self._on_fatal, died = on_fatal, self._died
        if died is not None:
            on_fatal(f"the {self.name} engine loop", died)
        elif step_timeout_s > 0:
            watchdog = threading.Thread(
                target=self._watch_steps, args=(step_timeout_s,), name=f"{self.name}-watchdog", daemon=True
            )
            watchdog.start()

    def stop(self) -> None:
        """Stops the loop after the running step; queued calls fail with Unavailable."""
        with self._cond:
            self._stopped = True
            queued, self._queue, self._num_waiting = self._queue, [], 0
            self._cond.notify_all()
        for entry in queued:
            entry.done(None, entry.stats, Unavailable(f"the {self.name} engine stopped"))

    # --- the loop ------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"{self.name}-engine", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # the loop itself failed: fatal (see the module docstring)
            self._die(err)

    def _watch_steps(self, timeout_s: float) -> None:
        """The watchdog (its own thread): gives the engine up (:meth:`_give_up`) once a step has
        run longer than ``timeout_s`` seconds; returns when the engine stops."""
        interval_s = min(1.0, timeout_s / 4)
        while True:
            time.sleep(interval_s)
            with self._cond:
                if self._stopped:
                    return
                start = self._step_start
            if start is not None and (ran_s := time.perf_counter() - start) > timeout_s:
                log.critical(
                    "a step of the %s engine has run for %.1f s, past its bound of %g s (engine_step_timeout_s): "
                    "its calls fail with UNAVAILABLE and the service must be restarted",
                    self.name,
                    ran_s,
                    timeout_s,
                )
                error = StepTimeout(
                    f"a step ran longer than {timeout_s:g} s (engine_step_timeout_s): the engine is hung"
                )
                self._give_up(error, f"the {self.name} engine")
                return

    def _die(self, err: BaseException) -> None:
        log.critical(
            "the %s engine loop died: its calls fail with UNAVAILABLE and the service must be restarted",
            self.name,
            exc_info=err,
        )
        self._give_up(err, f"the {self.name} engine loop")

    def _give_up(self, err: BaseException, what: str) -> None:
        """Stops the engine for good after ``what`` failed with ``err``: the handler of
        :meth:`watch` is called (the service reports NOT_SERVING), then its queued calls fail with
        UNAVAILABLE, later ones at once; so a queued caller that sees UNAVAILABLE finds the
        service already not serving (one arriving while the handler runs may not)."""
        with self._cond:
            if self._died is not None:  # given up already (the loop died while hung, or the reverse)
                return
            self._stopped, self._died, on_fatal = True, err, self._on_fatal
            self._stop_reason = f"{what} died ({err!r}): the service is restarting; retry later"
            queued, self._queue, self._num_waiting = self._queue, [], 0
        if on_fatal is not None:
            on_fatal(what, err)
        for entry in queued:
            self._hand(entry, Unavailable(self._stop_reason))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._wait_for_previous()
                given_up = self._drop_given_up()
                running = self._count_running()
                batch, failed = self._schedule(alone=running == 1)
                self._num_waiting -= sum(not entry.started for entry, _ in (*batch, *failed))
            for entry in given_up:
                self._hand(entry, self._late_error())
            for entry, err in failed:
                self._hand(entry, err)
            if batch:
                self._step(batch, running)

    def _drop_given_up(self) -> list[_Entry]:
        """Takes the calls not yet started whose deadline passed or whose caller went away out of
        the queue (holding the condition); returns them."""
        now = time.perf_counter()
        given_up = [entry for entry in self._queue if not entry.started and entry.given_up(now)]
        if given_up:
            dropped = set(map(id, given_up))
            self._queue = [entry for entry in self._queue if id(entry) not in dropped]
            self._num_waiting -= len(given_up)
        return given_up

    def _count_running(self) -> int:
        """Counts the running sequences (holding the condition): those served in the last two steps
        or queued; kept for :meth:`num_running_seqs`."""
        self._num_running = len(self._recent[0] | self._recent[1] | {e.work.seq_id for e in self._queue})
        return self._num_running

    def _late_error(self) -> Unavailable:
        return Unavailable(
            f"the {self.name} engine did not run the call before its deadline: the service is "
            "overloaded; retry later, or lower max_num_seqs load by adding replicas"
        )

    def _wait_for_previous(self) -> None:
        """Waits (holding the condition) after the last step for the sequences served in the last
        two steps to queue their next call, so that sessions which alternated between steps come
        together: up to ``batch_wait_ms``, ``batch_wait_step_share`` of the last step's forward
        time, or (``wait_for_turnaround``) 1.25 times the callers' turnaround
        (:meth:`_turnaround_s`) capped at that forward time, whichever is longest; with one
        sequence about there is no batch to keep together, and nothing waits. Nor where the
        sequences already queued would lose more, waiting that long each, than those still to
        come lose missing a step (a forward time each): most of the batch queued its next call
        before the step ended (Decodes sent ahead) and a few turn around (a speculative round),
        so they join the next step instead of holding every other."""
        recent = self._recent[0] | self._recent[1]
        if len(recent) < 2:
            return
        wait_s = max(self.batch_wait_s, self.batch_wait_step_share * self._step_s)
        if self.wait_for_turnaround:
            wait_s = max(wait_s, min(TURNAROUND_MARGIN * self._turnaround_s(), self._step_s))
        awaited = recent - {e.work.seq_id for e in self._queue}
        if (len(recent) - len(awaited)) * wait_s > len(awaited) * self._step_s:
            return
        deadline = self._step_end + wait_s
        self._awaited = awaited  # emptied by the calls as they come
        while self._awaited and not self._stopped:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        self._awaited = set()

    def _schedule(self, alone: bool) -> tuple[list[tuple[_Entry, SequenceStep]], list[tuple[_Entry, Exception]]]:
        """This step's entries and their steps: decoding work first, then prefill chunks, in
        arrival order, within the limits (``alone``, the queue's only sequence and no other served
        in the last two steps: ``max_num_batched_tokens_alone``); and the calls that fail instead,
        taken out of the queue (holding the condition) with their errors: a preempted sequence's,
        and those whose work's ``next_step`` raised."""
        batch: list[tuple[_Entry, SequenceStep]] = []
        failed: list[tuple[_Entry, Exception]] = []
        budget, seqs = self.max_num_batched_tokens_alone if alone else self.max_num_batched_tokens, set()
        for prefill in (False, True):
            for entry in self._queue:
                work = entry.work
                if work.is_prefill != prefill:
                    continue
                error: Exception | None = self._lost(work)
                if error is None:
                    if work.seq_id in seqs or len(batch) >= self.max_num_seqs or budget <= 0:
                        continue
                    try:
                        step = entry.call(work.next_step, budget)
                    except Exception as err:  # this call's failure: the others go on
                        error = err
                if error is not None:
                    failed.append((entry, error))
                    continue
                if len(step.token_ids) > budget and batch:
                    continue  # does not fit this step's budget: the next one
                batch.append((entry, step))
                seqs.add(work.seq_id)
                budget -= len(step.token_ids)
        if failed:
            gone = set(map(id, (entry for entry, _ in failed)))
            self._queue = [entry for entry in self._queue if id(entry) not in gone]
        return batch, failed

    def _lost(self, work: Work) -> SpecdecError | None:
        """The error of a call whose sequence the model's KV store preempted (None: not preempted):
        RESOURCE_EXHAUSTED for a prefill (its session never opened), else NOT_FOUND."""
        reason = self.lm.lost(work.seq_id)
        if reason is None:
            return None
        return ResourceExhausted(reason) if work.is_prefill else NotFound(reason)

    def _step(self, batch: list[tuple[_Entry, SequenceStep]], running: int) -> None:
        """Runs one step over ``batch`` (timed for the watchdog: :meth:`_watch_steps`)."""
        self._step_start = time.perf_counter()
        try:
            self._run_step(batch, running)
        finally:
            self._step_start = None

    def _run_step(self, batch: list[tuple[_Entry, SequenceStep]], running: int) -> None:
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
        self._step_s = step_ms / 1000
        num_tokens = sum(len(step.token_ids) for step in steps)
        num_prefill_tokens = sum(len(step.token_ids) for entry, step in batch if entry.work.is_prefill)
        self.metrics.observe_step(len(batch), num_tokens, step_ms)
        if not num_prefill_tokens:
            self.step_line.observe(num_tokens, step_ms)
        failed = self._accept(batch, logits)  # and the calls of sequences preempted in the step
        outcomes: list[tuple[_Entry, Exception | None]] = []
        for i, ((entry, step), rows) in enumerate(zip(batch, logits, strict=True)):
            entry.stats.num_seqs, entry.stats.num_tokens, entry.stats.step_ms = len(batch), num_tokens, step_ms
            entry.stats.num_running_seqs = max(running, len(batch))
            entry.stats.num_prefill_tokens = num_prefill_tokens
            if trace.get_current_span(entry.context).is_recording():
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
        """Runs :meth:`Work.accept` once per kind of work in the step, over the calls whose
        sequence the step did not preempt; returns the batch indices of the entries that fail,
        with the error: those preempted (:meth:`_lost`), and those whose kind's pass failed (the
        others go on)."""
        failed: dict[int, Exception] = {}
        kinds: dict[type[Work], list[int]] = {}
        for i, (entry, _) in enumerate(batch):
            if (lost := self._lost(entry.work)) is not None:
                failed[i] = lost
            else:
                kinds.setdefault(type(entry.work), []).append(i)
        for kind, indices in kinds.items():
            try:
                kind.accept([batch[i][0].work for i in indices], [logits[i] for i in indices])
            except Exception as err:  # handed to the callers of that kind of work
                failed.update((i, err) for i in indices)
        return failed

    def _finish(self, outcomes: list[tuple[_Entry, Exception | None]]) -> None:
        """Takes the step's finished calls out of the queue, then hands each its outcome, together
        (:func:`specdec.handoff.together`: a Step stream sends one step's results in one message);
        not those the engine failed meanwhile, giving up on a step that ran too long."""
        with self._cond:
            queued = set(map(id, self._queue))
            outcomes = [(entry, err) for entry, err in outcomes if id(entry) in queued]
            self._recent = [set(), self._recent[0]]
            finished = set(map(id, (entry for entry, _ in outcomes)))
            self._queue = [entry for entry in self._queue if id(entry) not in finished]
            self._recent[0].update(entry.work.seq_id for entry, _ in outcomes)
            self._step_end = time.perf_counter()
        with together():
            for entry, err in outcomes:
                self._hand(entry, err)

    def _turnaround_s(self) -> float:
        """The callers' turnaround (holding the condition), s: the time within which three
        quarters of the last ``TURNAROUND_WINDOW`` calls of sequences the step before had served
        came back (0: none yet). Not the slowest: a session that went to its draft between two
        verify calls comes back a Propose later, and waiting for it would hold every other
        session's step that long."""
        if not self._turnarounds:
            return 0.0
        turnarounds = sorted(self._turnarounds)
        return turnarounds[min(len(turnarounds) - 1, int(TURNAROUND_QUANTILE * len(turnarounds)))]

    def _hand(self, entry: _Entry, err: BaseException | None) -> None:
        """Calls the entry's ``done`` with its outcome (its work's result, or ``err``), in the
        call's OpenTelemetry context as its steps; an error ``done`` raises is logged: a caller's
        bug must not stop the loop that serves every other call."""
        try:
            entry.call(entry.done, entry.work.result if err is None else None, entry.stats, err)
        except Exception:
            log.exception("%s engine: a call's done callback failed", self.name)

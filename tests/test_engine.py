"""specdec.engine.engine alone, over a fake BatchedLM that records its steps: the step's limits
(max_num_seqs, max_num_batched_tokens), decoding work before prefill, chunked prefill into the
leftover budget, a sequence alone prefilling in larger chunks, a decode that does not fit waiting
for the next step, the per-step acceptance pass (one call per kind of work, its failure failing
only that kind's calls), the wait for the last step's sequences, a caller's callback that
raises, a work whose next step raises, the calls of a sequence the KV store preempted (queued or in
the step), and a loop that dies (its fatal handler called, its calls failed)."""

import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.engine import Engine, StepStats, Work
from specdec.engine.kv import PrefillWork, SequenceKV
from specdec.rpc.errors import NotFound, ResourceExhausted, Unavailable

VOCAB = 4


class RecordingLM(BatchedLM):
    """Records every step as ``[(seq_id, new tokens), ...]``; its first step waits for ``gate``,
    so that the test can queue work behind it."""

    vocab_size = VOCAB

    def __init__(self):
        self.steps: list[list[tuple[int, int]]] = []
        self.gate = threading.Event()
        self._next = 0
        self.preempted: dict[int, str] = {}  # sequences as a KV store's preemption leaves them
        self.preempt_in_step: dict[int, int] = {}  # preempt the second during the step holding the first

    def lost(self, seq_id: int) -> str | None:
        return self.preempted.get(seq_id)

    def allocate(self, owner: str = "") -> int:
        self._next += 1
        return self._next

    def free(self, seq_id: int) -> None:
        pass

    def truncate(self, seq_id: int, length: int) -> None:
        pass

    def cache_bytes(self, seq_id: int) -> int:
        return 0

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        assert self.gate.wait(10)
        self.steps.append([(step.seq_id, len(step.token_ids)) for step in steps])
        for step in steps:
            if (victim := self.preempt_in_step.get(step.seq_id)) is not None:
                self.preempted[victim] = "preempted: the KV budget was full"
        return [torch.zeros(step.num_logits, VOCAB) for step in steps]


class Decode(Work):
    """``count`` new tokens in one step (a verify of K + 1, or a decode of 1)."""

    def __init__(self, seq_id: int, count: int):
        self.seq_id, self.count = seq_id, count

    def next_step(self, budget: int) -> SequenceStep:
        return SequenceStep(self.seq_id, [0] * self.count, self.count)

    def finish_step(self, step: SequenceStep, logits: torch.Tensor) -> bool:
        self.result = logits.shape
        return True


class Accepted(Decode):
    """A decode whose kind has a per-step pass: it records the seq_ids each pass got."""

    passes: ClassVar[list[list[int]]] = []
    fail = False

    @classmethod
    def accept(cls, works: list[Work], logits: list[torch.Tensor]) -> None:
        cls.passes.append([work.seq_id for work in works])
        if cls.fail:
            raise RuntimeError("acceptance failed")


class Queued:
    """Runs ``engine.run(work)`` on a thread once the engine's queue holds ``ahead`` calls, so that
    calls arrive in the order they are made."""

    def __init__(self, engine: Engine, work: Work):
        self.result: object = None
        self.stats: StepStats | None = None
        self.error: BaseException | None = None
        ahead = len(engine._queue)
        self.thread = threading.Thread(target=self._run, args=(engine, work), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 5
        while len(engine._queue) <= ahead and time.monotonic() < deadline:
            time.sleep(0.001)

    def _run(self, engine: Engine, work: Work) -> None:
        try:
            self.result, self.stats = engine.run(work, timeout_s=10)
        except Exception as err:
            self.error = err


def run_behind_a_blocker(engine: Engine, works: list[Work]) -> list[Queued]:
    """Queues ``works`` while a first step (seq 0) holds the engine, then lets every step run."""
    lm = engine.lm
    assert isinstance(lm, RecordingLM)
    blocker = threading.Thread(target=engine.run, args=(Decode(0, 1),), daemon=True)
    blocker.start()
    while not engine._queue or not engine._queue[0].started:  # until the blocker's step has begun
        time.sleep(0.001)
    queued = [Queued(engine, work) for work in works]
    lm.gate.set()
    for call in queued:
        call.thread.join(10)
    blocker.join(10)
    return queued


@pytest.fixture
def lm() -> RecordingLM:
    return RecordingLM()


def test_decoding_goes_first_and_a_prefill_fills_what_is_left_a_chunk_a_step(lm):
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=16)
    prefill = PrefillWork(SequenceKV(lm), list(range(30)))  # caches 29 tokens
    chunks, *decodes = run_behind_a_blocker(engine, [prefill, Decode(10, 5), Decode(11, 5)])
    assert lm.steps[1:] == [[(10, 5), (11, 5), (prefill.seq_id, 6)], [(prefill.seq_id, 16)], [(prefill.seq_id, 7)]]
    # each call's stats are its last step's, telling the prefill chunk's tokens apart
    assert [(c.stats.num_seqs, c.stats.num_tokens, c.stats.num_prefill_tokens) for c in decodes] == [(3, 16, 6)] * 2
    assert (chunks.stats.num_seqs, chunks.stats.num_tokens, chunks.stats.num_prefill_tokens) == (1, 7, 7)
    engine.stop()


def test_a_step_takes_at_most_max_num_seqs(lm):
    engine = Engine(lm, max_num_seqs=2, max_num_batched_tokens=64)
    calls = run_behind_a_blocker(engine, [Decode(10 + i, 1) for i in range(5)])
    assert [len(step) for step in lm.steps[1:]] == [2, 2, 1]
    assert [call.result for call in calls] == [torch.Size([1, VOCAB])] * 5
    engine.stop()


def test_a_decode_beyond_the_leftover_budget_waits_for_the_next_step(lm):
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=8)
    run_behind_a_blocker(engine, [Decode(10, 5), Decode(11, 5), Decode(12, 3)])
    assert lm.steps[1:] == [[(10, 5), (12, 3)], [(11, 5)]]
    engine.stop()


def test_one_acceptance_pass_per_kind_of_work_per_step(lm):
    Accepted.passes, Accepted.fail = [], False
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64)
    calls = run_behind_a_blocker(engine, [Accepted(10, 3), Decode(11, 1), Accepted(12, 5)])
    assert all(call.error is None for call in calls)
    assert lm.steps[1:] == [[(10, 3), (11, 1), (12, 5)]]
    assert Accepted.passes == [[10, 12]]
    engine.stop()


def test_a_failed_acceptance_pass_fails_only_its_kinds_calls(lm):
    Accepted.passes, Accepted.fail = [], True
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64)
    failed, decoded = run_behind_a_blocker(engine, [Accepted(10, 3), Decode(11, 1)])
    assert lm.steps[1:] == [[(10, 3), (11, 1)]]
    assert isinstance(failed.error, RuntimeError) and failed.result is None
    assert decoded.error is None and decoded.result == torch.Size([1, VOCAB])
    Accepted.fail = False
    engine.stop()


def test_a_callback_that_raises_leaves_the_loop_serving_the_others(lm):
    """A caller's ``done`` that raises (a bug) is logged; the engine goes on with every other call,
    those of the same step and later ones."""
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64)
    answered = [threading.Event(), threading.Event()]

    def broken(result, stats, error):
        raise RuntimeError("a bug in a caller")

    engine.submit(Decode(10, 1), broken)
    engine.submit(Decode(11, 1), lambda result, stats, error: answered[0].set())
    lm.gate.set()  # both in one step
    assert answered[0].wait(10)
    engine.submit(Decode(12, 1), lambda result, stats, error: answered[1].set())
    assert answered[1].wait(10)
    engine.stop()


def test_a_sequence_alone_prefills_up_to_its_own_budget(lm):
    """Alone on the engine, a prefill takes up to ``max_num_batched_tokens_alone`` tokens a step;
    while another open sequence was served in the last two steps, the step budget applies."""
    lm.gate.set()
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=16, max_num_batched_tokens_alone=24)
    first = PrefillWork(SequenceKV(lm), list(range(50)))  # caches 49 tokens
    engine.run(first)
    assert lm.steps == [[(first.seq_id, 24)], [(first.seq_id, 24)], [(first.seq_id, 1)]]
    engine.forget(first.seq_id)  # its session closed
    engine.run(Decode(10, 1))  # another sequence, open
    second = PrefillWork(SequenceKV(lm), list(range(60)))  # caches 59 tokens
    engine.run(second)
    assert lm.steps[3:] == [
        [(10, 1)],
        [(second.seq_id, 16)],
        [(second.seq_id, 16)],
        [(second.seq_id, 24)],
        [(second.seq_id, 3)],
    ]
    engine.stop()


class SlowLM(RecordingLM):
    """Each step takes ``step_s`` more."""

    def __init__(self, step_s: float):
        super().__init__()
        self.step_s = step_s

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        time.sleep(self.step_s)
        return super().forward(steps)


@pytest.mark.parametrize(("share", "together"), [(0.1, True), (0.0, False)])
def test_a_step_waits_for_its_last_sequences_a_share_of_its_time(share, together):
    """Two sequences stepped together in a 300 ms step send their next calls 5 ms apart: with a
    share of 0.1 the engine waits up to 30 ms for the second, and the two share the next step;
    with none (batch_wait_ms 0) the first steps alone and the second waits for another step."""
    lm = SlowLM(0.3)
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64, batch_wait_step_share=share)
    finished = [threading.Event(), threading.Event()]

    def next_call(seq_id: int, delay_s: float):
        def done(result, stats, error) -> None:
            then = finished[seq_id - 1]
            threading.Timer(delay_s, engine.submit, (Decode(seq_id, 1), lambda *_: then.set())).start()

        return done

    blocker = threading.Thread(target=engine.run, args=(Decode(0, 1),), daemon=True)
    blocker.start()
    while not engine._queue or not engine._queue[0].started:  # the blocker's step has begun
        time.sleep(0.001)
    engine.submit(Decode(1, 1), next_call(1, 0.0))
    engine.submit(Decode(2, 1), next_call(2, 0.005))
    lm.gate.set()
    assert all(event.wait(10) for event in finished)
    assert lm.steps[:2] == [[(0, 1)], [(1, 1), (2, 1)]]
    assert (lm.steps[2] == [(1, 1), (2, 1)]) == together
    engine.stop()


@pytest.mark.parametrize(("queued", "together"), [(1, True), (3, False)])
def test_a_step_does_not_hold_the_many_queued_for_a_few_to_come(queued, together):
    """A 100 ms step, a wait of half of it: ``queued`` sequences queue their next call as their
    step ends (Decodes sent ahead), one comes back 30 ms later. One queued against one to come
    waits for it (50 ms of one against a step of the other); three do not (150 ms against 100):
    the late one joins the step after."""
    lm = SlowLM(0.1)
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64, batch_wait_step_share=0.5)
    late = queued + 1
    finished = threading.Event()

    def next_call(seq_id: int):
        def done(result, stats, error) -> None:
            then = (lambda *_: finished.set()) if seq_id == late else (lambda *_: None)
            if seq_id == late:
                threading.Timer(0.03, engine.submit, (Decode(seq_id, 1), then)).start()
            else:
                engine.submit(Decode(seq_id, 1), then)

        return done

    blocker = threading.Thread(target=engine.run, args=(Decode(0, 1),), daemon=True)
    blocker.start()
    while not engine._queue or not engine._queue[0].started:  # the blocker's step has begun
        time.sleep(0.001)
    for seq_id in range(1, late + 1):
        engine.submit(Decode(seq_id, 1), next_call(seq_id))
    lm.gate.set()
    blocker.join(10)
    engine.forget(0)  # its session closed: no step waits for it
    assert finished.wait(10)
    engine.stop()
    everyone = [(seq_id, 1) for seq_id in range(1, late + 1)]
    assert lm.steps[1] == everyone
    assert (lm.steps[2] == everyone) == together, lm.steps


@pytest.mark.parametrize("turnaround", [True, False])
def test_a_step_waits_for_its_callers_measured_turnaround(turnaround):
    """Two sequences whose callers send each next call 30 and 60 ms after their step ends (a
    network between them and the service), no fixed wait: the first time they split, and then,
    with ``wait_for_turnaround``, the engine waits the turnaround it measured and they share steps
    again; without it they keep alternating."""
    lm = SlowLM(0.15)
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64, wait_for_turnaround=turnaround)
    rounds = {1: 6, 2: 6}
    finished = threading.Event()

    def done(seq_id: int):
        def resubmit(result, stats, error) -> None:
            rounds[seq_id] -= 1
            if rounds[seq_id]:
                threading.Timer(0.03 * seq_id, engine.submit, (Decode(seq_id, 1), done(seq_id))).start()
            elif not any(rounds.values()):
                finished.set()

        return resubmit

    blocker = threading.Thread(target=engine.run, args=(Decode(0, 1),), daemon=True)
    blocker.start()
    while not engine._queue or not engine._queue[0].started:  # the blocker's step has begun
        time.sleep(0.001)
    engine.submit(Decode(1, 1), done(1))
    engine.submit(Decode(2, 1), done(2))
    lm.gate.set()
    assert finished.wait(10)
    shared = [len(step) == 2 for step in lm.steps[1:]]
    assert shared[0] and not shared[1]  # the first turnaround is not known yet
    if turnaround:  # together from the third step on, but for the last: the second's sixth call
        assert shared[2:-1] == [True] * 4 and len(shared) == 7, lm.steps
    else:
        assert not any(shared[1:]), lm.steps
    engine.stop()


def test_a_call_queued_by_the_engines_thread_is_no_turnaround(lm):
    """A call queued from a finished call's callback, on the engine's thread (a session's Decode
    sent ahead, started as the one before it finished), did not turn around: it leaves the
    measured turnaround alone, which only callers coming back count."""
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64, wait_for_turnaround=True)
    finished = threading.Event()
    lm.gate.set()
    engine.submit(Decode(1, 1), lambda *_: engine.submit(Decode(1, 1), lambda *_: finished.set()))
    assert finished.wait(10)
    assert not engine._turnarounds and len(lm.steps) == 2
    engine.submit(Decode(1, 1), lambda *_: None)  # a caller's next call: a turnaround
    assert len(engine._turnarounds) == 1
    engine.stop()


class Unschedulable(Decode):
    """A work whose next step raises (a bug in it, say)."""

    def next_step(self, budget: int) -> SequenceStep:
        raise ValueError("no step")


def test_a_work_whose_next_step_raises_fails_alone(lm):
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64)
    broken, decoded = run_behind_a_blocker(engine, [Unschedulable(10, 1), Decode(11, 1)])
    assert isinstance(broken.error, ValueError) and decoded.error is None
    assert lm.steps[1:] == [[(11, 1)]]
    engine.run(Decode(12, 1), timeout_s=10)  # the loop serves on
    engine.stop()


class PrefillChunk(Decode):
    is_prefill = True


def test_the_calls_of_a_preempted_sequence_fail_and_the_others_run(lm):
    """A queued call of a sequence the KV store preempted fails before any step (NOT_FOUND; a
    prefill: RESOURCE_EXHAUSTED, it never opened); one preempted during its step fails after it,
    without its acceptance pass or its finish; the step's other calls go on."""
    Accepted.passes, Accepted.fail = [], False
    lm.preempted = {10: "preempted: the KV budget was full", 11: "preempted: the KV budget was full"}
    lm.preempt_in_step = {13: 14}  # 13's step needs room: 14 is preempted while in the same step
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64)
    queued, prefill, running, in_step = run_behind_a_blocker(
        engine, [Decode(10, 1), PrefillChunk(11, 4), Accepted(13, 2), Accepted(14, 2)]
    )
    assert isinstance(queued.error, NotFound) and "KV budget was full" in str(queued.error)
    assert isinstance(prefill.error, ResourceExhausted)
    assert lm.steps[1:] == [[(13, 2), (14, 2)]]
    assert running.error is None and running.result == torch.Size([2, VOCAB])
    assert isinstance(in_step.error, NotFound) and in_step.result is None
    assert Accepted.passes == [[13]]
    engine.stop()


def test_a_loop_that_dies_fails_its_calls_and_calls_the_fatal_handler(lm, monkeypatch, caplog):
    """Its scheduling raises (a bug): the queued call fails with UNAVAILABLE, the handler hears what
    died and why, the traceback is logged at CRITICAL, and a later call fails at once."""
    lm.gate.set()
    engine = Engine(lm, max_num_seqs=8, max_num_batched_tokens=64, name="verify")
    engine.run(Decode(10, 1), timeout_s=10)
    deaths: list[tuple[str, BaseException]] = []
    engine.watch(lambda what, err: deaths.append((what, err)))

    def broken_schedule(alone: bool):
        raise RuntimeError("a bug in the scheduler")

    monkeypatch.setattr(engine, "_schedule", broken_schedule)
    with pytest.raises(Unavailable, match="the verify engine loop died"):
        engine.run(Decode(11, 1), timeout_s=10)
    assert [(what, str(err)) for what, err in deaths] == [("the verify engine loop", "a bug in the scheduler")]
    critical = [record for record in caplog.records if record.levelname == "CRITICAL"]
    assert critical and critical[0].exc_info is not None and "broken_schedule" in caplog.text
    with pytest.raises(Unavailable, match="died"):
        engine.run(Decode(12, 1), timeout_s=10)
    late: list[str] = []
    engine.watch(lambda what, err: late.append(what))  # a handler set after the death hears of it at once
    assert late == ["the verify engine loop"]


def test_the_calls_waiting_and_the_running_sequences_are_counted_as_they_come_and_go(lm):
    """Behind a step in progress, three calls wait; one gives up at its deadline, the other two run
    a step each (one sequence a step): each answer sees the count of the calls still waiting, and
    the running sequences as its StepStats has them; closing the sessions empties the count."""
    engine = Engine(lm, max_num_seqs=1, max_num_batched_tokens=64)
    blocker = threading.Thread(target=engine.run, args=(Decode(0, 1),), daemon=True)
    blocker.start()
    while not engine._queue or not engine._queue[0].started:  # the blocker's step has begun
        time.sleep(0.001)
    assert engine.num_waiting_calls() == 0  # a call in its step no longer waits
    seen: dict[int, tuple] = {}
    answered = threading.Semaphore(0)

    def done(seq_id: int):
        def record(result, stats: StepStats, error) -> None:
            seen[seq_id] = (engine.num_waiting_calls(), engine.num_running_seqs(), stats.num_running_seqs, error)
            answered.release()

        return record

    engine.submit(Decode(10, 1), done(10))
    engine.submit(Decode(11, 1), done(11), timeout_s=0.05)
    engine.submit(Decode(12, 1), done(12))
    assert engine.num_waiting_calls() == 3
    time.sleep(0.1)  # past 11's deadline
    lm.gate.set()
    for _ in range(3):
        assert answered.acquire(timeout=10)
    blocker.join(10)
    assert isinstance(seen[11][3], Unavailable) and seen[11][0] == 1  # dropped, 10 in its step, 12 waiting
    assert seen[10] == (1, 3, 3, None)  # 12 waits; running: 0 (last step), 10 and 12 (queued)
    assert seen[12] == (0, 3, 3, None)  # running: 10 and 0 (the last two steps), 12
    for seq_id in (0, 10, 12):
        engine.forget(seq_id)
    assert (engine.num_waiting_calls(), engine.num_running_seqs()) == (0, 0)
    engine.stop()


class Prefill(Decode):
    """A prefill chunk of ``count`` tokens."""

    is_prefill = True


def test_the_steps_of_decoding_work_teach_the_step_line_and_a_prefill_chunk_does_not(lm):
    """Every step without a prefill chunk gives the engine's StepLine its batched tokens and ms
    (specdec/engine/step_line.py: what the service publishes for the coordinators' prices)."""
    engine = Engine(lm, max_num_seqs=4, max_num_batched_tokens=64)
    observed: list[tuple[int, float]] = []
    engine.step_line.observe = lambda num_tokens, ms: observed.append((num_tokens, ms))  # type: ignore[method-assign]
    run_behind_a_blocker(engine, [Decode(1, 3), Decode(2, 2)])
    lm.gate.clear()
    run_behind_a_blocker(engine, [Decode(3, 4), Prefill(4, 6)])
    engine.stop()
    assert lm.steps == [[(0, 1)], [(1, 3), (2, 2)], [(0, 1)], [(3, 4), (4, 6)]]
    assert [n for n, _ in observed] == [1, 5, 1]  # the step with the prefill chunk left out
    assert all(ms >= 0 for _, ms in observed)

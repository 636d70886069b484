"""The services' session registry (:mod:`specdec.rpc.sessions`)."""

import threading
import time

import pytest

from specdec.rpc.errors import AlreadyExists, NotFound, ResourceExhausted
from specdec.rpc.sessions import FAIR_SHARE_WINDOW_S, SessionRegistry


class _Closable:
    closed = False
    lost: str | None = None  # set: its KV was preempted

    def close(self) -> None:
        self.closed = True

    def kv_cache_bytes(self) -> int:
        return 0 if self.closed else 100


def test_a_session_whose_prefill_was_abandoned_is_released_at_once():
    """A Prefill the caller cancelled while it ran (its Release may have come first) leaves no session."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    kept, abandoned = _Closable(), _Closable()
    sessions.open("kept", lambda: kept)
    sessions.open("abandoned", lambda: abandoned, abandoned=lambda: True)
    assert len(sessions) == 1 and abandoned.closed and not kept.closed
    assert sessions.kv_cache_bytes() == 100


def test_a_session_released_before_its_prefill_finished_is_released_once_open():
    """The caller cancelled a Prefill and sent its Release, which came before the session existed
    (the cancel too late to be seen): the session is released as soon as it opens."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    late = _Closable()
    assert not sessions.release("late")
    sessions.open("late", lambda: late)
    assert len(sessions) == 0 and late.closed
    sessions.open("late-2", _Closable)  # other ids are not affected
    assert len(sessions) == 1


def test_other_sessions_are_used_while_one_prefills():
    """A Prefill (the factory) runs outside the registry's lock: other sessions' calls and other
    Prefills go on meanwhile; the session being opened counts against max_sessions."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    sessions.open("open", _Closable)
    prefilling, finish = threading.Event(), threading.Event()

    def slow_prefill() -> _Closable:
        prefilling.set()
        assert finish.wait(10)
        return _Closable()

    opener = threading.Thread(target=sessions.open, args=("slow", slow_prefill))
    opener.start()
    assert prefilling.wait(10)
    with sessions.use("open") as session:  # not blocked by the Prefill under way
        assert not session.closed
    with pytest.raises(
        ResourceExhausted, match=r"2 sessions are open.*retry later, or raise the service's --max-sessions"
    ):
        sessions.open("third", _Closable)
    with pytest.raises(AlreadyExists):
        sessions.open("slow", _Closable)
    finish.set()
    opener.join(10)
    assert len(sessions) == 2


def lost(session: _Closable) -> str | None:
    return session.lost


def test_a_lost_session_fails_its_next_call_with_not_found_and_is_released():
    """Its KV was preempted: the next call gets NOT_FOUND with the reason and the session is gone
    (closed, its slot free); a lost session no call comes for is released by the sweep that runs at
    every open, so that it does not hold a slot until it is idle long enough to be evicted."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60, lost=lost)
    called, left = _Closable(), _Closable()
    sessions.open("called", lambda: called)
    sessions.open("left", lambda: left)
    called.lost = left.lost = "preempted: the KV budget is full"
    with pytest.raises(NotFound, match="session 'called' preempted: the KV budget is full"):
        sessions.acquire("called")
    assert called.closed and len(sessions) == 1
    sessions.open("new", _Closable)  # the sweep released the other lost session: room for this one
    assert left.closed and len(sessions) == 1


def test_a_janitor_that_dies_says_so(caplog):
    """The janitor's loop raising is logged at CRITICAL with its traceback and handed to its fatal
    handler (the service then reports NOT_SERVING and exits: tests/test_liveness.py)."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    died = threading.Event()
    deaths: list[str] = []

    def evict_idle() -> list[str]:
        raise RuntimeError("a bug in the janitor")

    sessions.evict_idle = evict_idle  # type: ignore[method-assign]
    stop = sessions.start_janitor(0.01, lambda what, err: (deaths.append(f"{what}: {err}"), died.set()))
    assert died.wait(10)
    stop.set()
    assert deaths == ["the idle-session janitor: a bug in the janitor"]
    assert any(r.levelname == "CRITICAL" and r.exc_info for r in caplog.records)


def test_calls_that_find_their_session_busy_wait_without_a_thread_and_start_in_order():
    """start_when_free: a call that finds its session held is started by the release of the one
    before it (on that thread), calls in the order they came; the caller's thread never waits."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    sessions.open("s", _Closable)
    started: list[tuple[str, str]] = []
    releases = []

    def start(name: str):
        def run(session, release) -> None:
            started.append((name, threading.current_thread().name))
            releases.append(release)

        return run

    for name in ("first", "second", "third"):
        sessions.start_when_free("s", start(name), lambda err: pytest.fail(str(err)))
    assert [name for name, _ in started] == ["first"]  # the others queued; this thread went on
    releaser = threading.Thread(target=releases[0], name="engine")
    releaser.start()
    releaser.join(10)
    assert started[1] == ("second", "engine")
    releases[1]()
    releases[2]()
    with sessions.use("s") as session:  # free again once the last call gave it back
        assert not session.closed


def test_a_call_waiting_for_its_session_gets_not_found_when_it_is_released_or_lost():
    """A session released (or found lost) while calls waited for it: each waiting call gets
    NOT_FOUND through its ``fail``, none starts on the closed session; an unknown id fails at once."""
    sessions = SessionRegistry(max_sessions=2, idle_timeout_s=60, lost=lost)
    held = _Closable()
    sessions.open("s", lambda: held)
    failures: list[NotFound] = []
    _, release = sessions.acquire("s")
    sessions.start_when_free("s", lambda s, r: pytest.fail("started on a released session"), failures.append)
    releasing = threading.Thread(target=sessions.release, args=("s",))
    releasing.start()  # takes the id out, then waits for the lock, which the waiting call is handed first
    deadline = time.monotonic() + 10
    while len(sessions) and time.monotonic() < deadline:
        time.sleep(0.001)
    release()
    releasing.join(10)
    assert held.closed and len(failures) == 1 and "released or lost while the call waited" in str(failures[0])
    sessions.start_when_free("gone", lambda s, r: pytest.fail("started"), failures.append)
    assert isinstance(failures[1], NotFound) and "not found" in str(failures[1])
    lost_one = _Closable()
    sessions.open("l", lambda: lost_one)
    _, release = sessions.acquire("l")
    sessions.start_when_free("l", lambda s, r: pytest.fail("started on a lost session"), failures.append)
    lost_one.lost = "preempted: the KV budget is full"
    release()
    assert "preempted" in str(failures[2]) and lost_one.closed


def test_room_goes_to_the_owner_holding_fewer_sessions():
    """Four sessions of room, owner A holding three and B one: B's Prefill refused for want of room
    marks B waiting, so when one of A's ends A's next Prefill is refused (room kept for B) and B's
    gets in; once B no longer waits, or its mark is older than the window, A is not held back."""
    sessions = SessionRegistry(max_sessions=4, idle_timeout_s=60)
    for i in range(3):
        sessions.open(f"a{i}", _Closable, owner="a")
    sessions.open("b0", _Closable, owner="b")
    with pytest.raises(ResourceExhausted, match="limit is 4"):
        sessions.open("b1", _Closable, owner="b")
    sessions.release("a0")
    with pytest.raises(ResourceExhausted, match=r"room is kept for another caller .* holds 1 sessions"):
        sessions.open("a3", _Closable, owner="a")
    sessions.open("b1", _Closable, owner="b")  # B got the room
    sessions.release("b1")
    sessions.open("a3", _Closable, owner="a")  # B holds fewer, but no longer waits
    with pytest.raises(ResourceExhausted, match="limit is 4"):
        sessions.open("b2", _Closable, owner="b")  # B waits again
    sessions.release("a3")
    time.sleep(FAIR_SHARE_WINDOW_S + 0.1)
    sessions.open("a4", _Closable, owner="a")  # B's mark expired: A is not held back

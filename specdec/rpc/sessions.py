"""Per-session state on a service: bounded in number, evicted when idle, dropped when its KV was
preempted, used one call at a time (a session's calls in the order they came; a caller may send
its next call before the last one is answered, :meth:`SessionRegistry.start_when_free`).

Fair by owner: each session serves an owner (the coordinator's client, an opaque tag in its
Prefill). A Prefill refused for want of room (sessions, or the KV budget) marks its owner as
waiting for :data:`FAIR_SHARE_WINDOW_S`; meanwhile an owner that holds more sessions than a waiting
one is refused too, so that the room that appears goes to the owner holding fewer (max-min fair
shares of the sessions). The service sees the Prefills of every coordinator replica, so this holds
across them: a key that reaches many coordinators gets no more of the service than one that
reaches one."""

import collections
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from specdec.rpc.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)

# Released ids of sessions that did not exist, remembered in case their Prefill is still running
# (session ids are never reused, so remembering one cannot harm a later session). Such a Prefill
# runs in one of the service's few handler threads: far fewer than this are ever pending.
MAX_RELEASED_UNKNOWN = 4096
# How long an owner refused for want of room counts as waiting, seconds: longer than the coordinator's
# retries of a waiting request (every 0.25 s), short enough that room kept for an owner that gave up
# is soon given to others.
FAIR_SHARE_WINDOW_S = 1.0
# the setting that bounds a service's sessions, as its refusals name it
MAX_SESSIONS = "the service's --max-sessions"


class Session(Protocol):
    def close(self) -> None:
        """Frees the session's KV cache."""

    def kv_cache_bytes(self) -> int:
        """Bytes its KV cache holds."""


S = TypeVar("S", bound=Session)


@dataclass
class _Entry(Generic[S]):
    session: S
    owner: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    # calls waiting for the lock without a thread (start_when_free), in arrival order; written
    # holding the registry's lock: the lock is handed to the first of them instead of given back
    waiting: deque[Callable[[], None]] = field(default_factory=deque)


class SessionRegistry(Generic[S]):
    """Thread-safe map from session id to session.

    Args:
        max_sessions: open sessions allowed at once; one more gets RESOURCE_EXHAUSTED.
        idle_timeout_s: a session unused this long (seconds) is released by :meth:`evict_idle`.
        lost: why a session is lost (its KV preempted by the model's store, see
            :meth:`specdec.engine.kv.SequenceKV.lost`), None while it is not; a lost session is released
            by its next call, which fails with NOT_FOUND, or by :meth:`release_lost`.
    """

    def __init__(self, max_sessions: int, idle_timeout_s: float, lost: Callable[[S], str | None] | None = None):
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.lost = lost or (lambda session: None)
        self._entries: dict[str, _Entry[S]] = {}
        self._released_unknown: OrderedDict[str, bool] = OrderedDict()  # released before they were open
        self._opening: dict[str, str] = {}  # sessions whose Prefill (the factory) is running -> their owner
        self._waiting: dict[str, float] = {}  # owners refused for want of room -> when (time.monotonic())
        self._lock = threading.Lock()
        self.num_evicted = 0  # sessions released for being idle, not by a Release

    def __len__(self) -> int:
        return len(self._entries)

    def num_in_use(self) -> int:
        """Sessions that count against ``max_sessions``: those open and those being opened (their
        Prefill running). Two ``len`` calls, no lock: a service reports it with every message."""
        return len(self._entries) + len(self._opening)

    def kv_cache_bytes(self) -> int:
        """Bytes the KV caches of the open sessions hold (read without waiting for their locks)."""
        with self._lock:
            sessions = [entry.session for entry in self._entries.values()]
        return sum(session.kv_cache_bytes() for session in sessions)

    def open(
        self, session_id: str, factory: Callable[[], S], abandoned: Callable[[], bool] = lambda: False, owner: str = ""
    ) -> S:
        """Creates a session of ``owner`` and returns it (fairly by owner: see the module docstring).
        No session outlives a Prefill its caller gave up on: ``abandoned``
        is asked once it exists (after the prefill in ``factory``), and True (the caller cancelled
        meanwhile) releases it at once; so does a Release of ``session_id`` that came before the
        session existed (the caller's cancel was not seen, or came too late to fail the call).
        A session being opened counts against ``max_sessions``; ``factory`` runs outside the
        registry's lock, so that the other sessions' calls, and other Prefills (batched together by
        the engine), go on meanwhile instead of waiting for each Prefill to finish.
        Raises AlreadyExists, ResourceExhausted, or what ``factory`` raises."""
        if not session_id:
            raise InvalidArgument("session_id is empty: pass the id the coordinator assigned")
        self.evict_idle()
        self.release_lost()
        with self._lock:
            if session_id in self._entries or session_id in self._opening:
                raise AlreadyExists(f"session {session_id!r} already exists: release it first")
            if len(self._entries) + len(self._opening) >= self.max_sessions:
                self._waiting[owner] = time.monotonic()
                raise ResourceExhausted(
                    f"{len(self._entries) + len(self._opening)} sessions are open, the limit is "
                    f"{self.max_sessions}: retry later, or raise {MAX_SESSIONS}"
                )
            if (fewer := self._waiting_with_fewer(owner)) is not None:
                self._waiting[owner] = time.monotonic()
                raise ResourceExhausted(
                    f"room is kept for another caller that was refused for want of it and holds {fewer} sessions, "
                    f"fewer than this one's (fair shares by owner): retry later, or raise {MAX_SESSIONS}"
                )
            self._opening[session_id] = owner
        try:
            session = factory()
        except BaseException as err:
            with self._lock:
                del self._opening[session_id]
                if isinstance(err, ResourceExhausted):  # the KV budget is full: waiting for room too
                    self._waiting[owner] = time.monotonic()
            raise
        with self._lock:  # from opening to open in one step: no moment where the id is free
            del self._opening[session_id]
            self._waiting.pop(owner, None)  # it got room
            entry = self._entries[session_id] = _Entry(session, owner)
            released_early = self._released_unknown.pop(session_id, False)
        if released_early or abandoned():
            self.release(session_id)
        return entry.session

    def _waiting_with_fewer(self, owner: str) -> int | None:
        """The fewest sessions held by another owner refused for want of room in the last
        FAIR_SHARE_WINDOW_S, when that is fewer than ``owner`` holds; else None (holding the lock)."""
        now = time.monotonic()
        for gone in [o for o, at in self._waiting.items() if now - at > FAIR_SHARE_WINDOW_S]:
            del self._waiting[gone]
        others = [o for o in self._waiting if o != owner]
        if not others:
            return None
        held = collections.Counter(entry.owner for entry in self._entries.values())
        held.update(self._opening.values())
        fewest = min(held[o] for o in others)
        return fewest if fewest < held[owner] else None

    @contextlib.contextmanager
    def use(self, session_id: str) -> Iterator[S]:
        """Yields the session, holding its lock. Raises NotFound for an unknown id."""
        session, release = self.acquire(session_id)
        try:
            yield session
        finally:
            release()

    def acquire(self, session_id: str) -> tuple[S, Callable[[], None]]:
        """The session and the function that gives its lock back, held until then: a call served
        on another thread (an engine's, :meth:`specdec.engine.engine.Engine.submit`) gives it back there.
        Waits while another call holds it. Raises NotFound for an unknown id, and for a lost one
        (which it releases) or one released while the call waited."""
        entry = self._entry(session_id)
        entry.lock.acquire()
        return self._held(session_id, entry), lambda: self._give_back(entry)

    def start_when_free(
        self, session_id: str, start: Callable[[S, Callable[[], None]], None], fail: Callable[[NotFound], None]
    ) -> None:
        """:meth:`acquire` without a thread waiting: calls ``start(session, release)`` holding the
        session's lock, at once when no call holds it, else on the thread whose ``release`` gives
        it up, so that a service reading many sessions' calls from one stream never waits for one
        (a caller may send a session's next Decode before the last is answered: Decode ahead,
        docs/architecture.md#one-round). A session's calls start in the order they came.
        ``start`` must not raise (it runs on another call's thread) and must call ``release``
        once. NotFound (an unknown id, a lost session, one released while the call waited) goes
        to ``fail`` instead, at once or then."""
        try:
            entry = self._entry(session_id)
        except NotFound as err:
            fail(err)
            return

        def run() -> None:
            try:
                session = self._held(session_id, entry)
            except NotFound as err:
                fail(err)
                return
            start(session, lambda: self._give_back(entry))

        with self._lock:
            if entry.waiting or not entry.lock.acquire(blocking=False):
                entry.waiting.append(run)
                return
        run()

    def _entry(self, session_id: str) -> _Entry[S]:
        with self._lock:
            entry = self._entries.get(session_id)
        if entry is None:
            raise NotFound(
                f"session {session_id!r} not found (released, or idle longer than "
                f"{self.idle_timeout_s:g} s): prefill it again"
            )
        return entry

    def _held(self, session_id: str, entry: _Entry[S]) -> S:
        """The session of ``entry``, whose lock the caller now holds; raises NotFound (the lock
        given back) for a lost session (released here) or one released while the call waited."""
        entry.last_used = time.monotonic()
        if (reason := self.lost(entry.session)) is not None:
            self._drop(session_id, entry)
            self._give_back(entry)
            raise NotFound(f"session {session_id!r} {reason}")
        with self._lock:
            released = self._entries.get(session_id) is not entry
        if released:
            self._give_back(entry)
            raise NotFound(
                f"session {session_id!r} was released or lost while the call waited for the one before "
                "it: prefill it again"
            )
        return entry.session

    @contextlib.contextmanager
    def _holding(self, entry: _Entry[S]) -> Iterator[None]:
        """Holds a session's lock, waiting for it, and gives it up as :meth:`_give_back` does."""
        entry.lock.acquire()
        try:
            yield
        finally:
            self._give_back(entry)

    def _give_back(self, entry: _Entry[S]) -> None:
        """Gives a session's lock up: to the first call waiting for it (:meth:`start_when_free`),
        started here, or back."""
        entry.last_used = time.monotonic()
        with self._lock:
            waiter = entry.waiting.popleft() if entry.waiting else None
            if waiter is None:
                entry.lock.release()
        if waiter is not None:
            waiter()

    def release(self, session_id: str) -> bool:
        """Closes and removes a session; False if it did not exist (its id is then remembered, in
        case its Prefill is still running: see :meth:`open`)."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is None:
                self._released_unknown[session_id] = True
                while len(self._released_unknown) > MAX_RELEASED_UNKNOWN:
                    self._released_unknown.popitem(last=False)  # the oldest
        if entry is None:
            return False
        with self._holding(entry):  # calls that waited for it then fail with NotFound
            entry.session.close()
        return True

    def release_lost(self) -> list[str]:
        """Releases the lost sessions no call holds; returns their ids."""
        with self._lock:
            lost = [
                (sid, e) for sid, e in self._entries.items() if not e.lock.locked() and self.lost(e.session) is not None
            ]
        for sid, entry in lost:
            with self._holding(entry):
                self._drop(sid, entry)
        return [sid for sid, _ in lost]

    def _drop(self, session_id: str, entry: _Entry[S]) -> None:
        """Removes a lost session (its lock held by the caller) and closes it, unless a call that
        held its lock did already."""
        with self._lock:
            if self._entries.get(session_id) is not entry:
                return
            del self._entries[session_id]
        entry.session.close()

    def evict_idle(self) -> list[str]:
        """Releases sessions idle longer than the timeout; returns their ids."""
        deadline = time.monotonic() - self.idle_timeout_s
        with self._lock:
            idle = [sid for sid, e in self._entries.items() if e.last_used < deadline and not e.lock.locked()]
        evicted = [sid for sid in idle if self.release(sid)]
        if evicted:
            self.num_evicted += len(evicted)
            log.info("evicted %d idle sessions", len(evicted))
        return evicted

    def start_janitor(
        self, interval_s: float, on_fatal: Callable[[str, BaseException], None] | None = None
    ) -> threading.Event:
        """Evicts idle sessions and releases lost ones every ``interval_s`` seconds in a daemon
        thread until the returned event is set. Should it fail, it logs why at CRITICAL (with the
        traceback) and calls ``on_fatal(what, error)``: the service must not go on without it,
        reporting SERVING while its abandoned sessions pile up to ``max_sessions``."""
        stop = threading.Event()

        def loop() -> None:
            try:
                while not stop.wait(interval_s):
                    self.evict_idle()
                    self.release_lost()
            except BaseException as err:
                log.critical("the idle-session janitor died: idle sessions are no longer released", exc_info=err)
                if on_fatal is not None:
                    on_fatal("the idle-session janitor", err)

        threading.Thread(target=loop, name="session-janitor", daemon=True).start()
        return stop

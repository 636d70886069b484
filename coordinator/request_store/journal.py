"""A running request's record in the request store (:mod:`coordinator.request_store.store`): the
journal the coordinator keeps of it, round by round, so that any coordinator replica can resume it."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from coordinator.request_store.store import RequestStore, StoredRequest, StoreFull, StoreUnavailable
from specdec.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
# A running request's record gets the store's TTL again once this share of it has passed since it
# was last set (not every round: three EXPIREs a round were most of Redis's commands), so it lives
# at least 7/8 of ttl_s after its last write.
KEEP_ALIVE_EVERY = 1 / 8
# A request that ends while the store cannot be reached tries to write its outcome this long, every
# END_RETRY_INTERVAL_S (seconds): longer than a Redis Cluster takes to promote a replica (about 3 s
# with a 1 s node timeout, about 20 s with Redis's default 15 s).
END_RETRY_S = 30.0
END_RETRY_INTERVAL_S = 0.5


@dataclass
class RequestJournal:
    """Keeps one running request's record in the store: written whole at the start, its tokens
    appended every round before the client receives them (so the stored log is never behind the
    client; in Redis, with the appends of the other requests of that turn of the event loop, and
    the record's TTL set again every ``KEEP_ALIVE_EVERY`` of it), and written whole at the end,
    then counted among ``client``'s ended requests (:meth:`RequestStore.retire`). A store failure
    after the start is never raised (RedisStore logs and counts it): the request goes on from
    memory, and the first write after the store answers again writes the whole record, so a
    restarted, empty Redis gets it back. A record whose id the store could not check at the start
    (:meth:`create` answered None) is claimed then instead, never written over another request's
    of the same id."""

    store: RequestStore
    record: StoredRequest
    client: str = ""
    _stored: int | None = None  # tokens the store holds; None: the whole record must be written
    claimed: bool = False  # the store holds (or held) this request's record under its id: True for a resume
    _taken: bool = False  # another request had claimed the id: nothing of this one is written
    _kept_alive_at: float = field(default_factory=time.monotonic)  # the record's TTL last set (time.monotonic())

    async def create(self) -> bool | None:
        """Writes the new request's record: True, or False (nothing written) when its id is already
        stored. None while the store is unreachable: the id is unchecked, and the record is
        claimed (written only where the id is still free) when the store answers again. Raises
        StoreFull when the store is full."""
        try:
            if not await self.store.create(self.record):
                return False
        except StoreFull:
            raise
        except StoreUnavailable:
            return None
        self._stored, self.claimed, self._kept_alive_at = len(self.record.generated), True, time.monotonic()
        return True

    async def commit(
        self,
        tokens: list[int],
        sessions: dict[str, str] | None = None,
        logprobs: list[common_pb2.TokenLogprobs] | None = None,
    ) -> None:
        """Stores the newly committed ``tokens`` (with their ``logprobs``, when the request asks for
        them) and, when they changed, the ids of the sessions the request holds (``sessions``, by
        service)."""
        self.record.generated.extend(tokens)
        self.record.logprobs.extend(logprobs or [])
        if sessions is None or sessions == self.record.sessions:
            sessions = None  # unchanged: not written again
        else:
            self.record.sessions = dict(sessions)
        await self._sync(sessions)

    async def end(
        self,
        status: str,
        finish_reason: coordinator_pb2.FinishReason = coordinator_pb2.FINISH_REASON_UNSPECIFIED,
        metrics: coordinator_pb2.RequestMetrics | None = None,
    ) -> None:
        """Stores the outcome; the request's sessions are released by then, so none are kept.
        While the store cannot be reached the whole record is tried again every
        END_RETRY_INTERVAL_S for up to END_RETRY_S (a Redis restarting, a cluster promoting a
        master's replica: the record may have been lost with the master, and the end is the last
        write that would put it back)."""
        self.record.status, self.record.finish_reason, self.record.metrics = status, finish_reason, metrics
        self.record.sessions = {}
        self._stored = None
        deadline = time.monotonic() + END_RETRY_S
        while not await self._sync() and time.monotonic() < deadline:
            await asyncio.sleep(END_RETRY_INTERVAL_S)
        if self.claimed and not self._taken:
            with contextlib.suppress(StoreUnavailable):  # unretired, it expires with its TTL
                await self.store.retire(self.client, self.record.store_id)

    async def _sync(self, sessions: dict[str, str] | None = None) -> bool:
        """Writes what the store lacks of the record; False when the store could not be reached
        (the next write then writes it whole)."""
        record = self.record
        record.updated_at = time.time()
        if self._taken:
            return True
        try:
            if self._stored is not None:
                new_logprobs = record.logprobs[self._stored :]  # none when the request asks for none
                keep_alive = time.monotonic() - self._kept_alive_at >= self.store.ttl_s * KEEP_ALIVE_EVERY
                new_tokens = record.generated[self._stored :]
                held = await self.store.append(
                    record.store_id, new_tokens, sessions, new_logprobs, stored=self._stored, keep_alive=keep_alive
                )
                if held == len(record.generated):
                    self._stored = held
                    if keep_alive:
                        self._kept_alive_at = time.monotonic()
                    return True
            if self.claimed:
                await self.store.put(record)
            elif not await self.store.create(record):
                self._taken = True
                log.warning(
                    "request %s: its id was taken while the request store was unreachable; this request is not "
                    "stored (it cannot be resumed)",
                    record.request_id,
                )
                return True
            self._stored, self.claimed, self._kept_alive_at = len(record.generated), True, time.monotonic()
            return True
        except StoreUnavailable:
            self._stored = None
            return False

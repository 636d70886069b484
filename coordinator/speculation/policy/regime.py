"""Speculation under load, chosen for a coordinator's requests together, by the goodput each way of
choosing reads: per request (:class:`coordinator.speculation.policy.adaptive.AdaptiveK` priced at
the load its rounds see, today's default) or together (every request priced as if alone, so that
all draft where a request alone would).

Why (docs/profiles.md#on-the-avx2-epyc-a-gain-the-requests-make-only-together): where the draft
shares the target's cores, speculation at a few requests pays only when the requests draft
together (the verify's steps then wait for their drafts and the draft batches them), and the costs
one request measures drafting beside the others' plain rounds are those of that mixed state, 2-10x
the shared ones. A price per request then keeps every request plain. Which way wins is read, not
modelled: at each load (the coordinator's running requests on the target, in buckets of about a
factor of 2) the two ways run in turn for a window of ``window_s`` seconds each until both were
measured, then the better one runs, its figure kept current by its own windows; the other is tried
again once its figure is ``stale_s`` old. A window's figure is the tokens the coordinator's
requests committed during it per second (their goodput), the whole window at one load, counting
the decode steps alone: its clock stops while any request's prefill runs.
"""

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

PER_REQUEST, TOGETHER = "per-request", "together"
log = logging.getLogger(__name__)


def load_bucket(running: int) -> int:
    """The load bucket of ``running`` requests: log2 rounded (2; 3-5; 6-11; 12-22; 23-45; ...), so
    that a closed loop of N, N - 1 between a request's end and the next one's start, stays in one."""
    return round(math.log2(running))


@dataclass
class RegimeTrials:
    """The choice between :data:`PER_REQUEST` and :data:`TOGETHER` for one target (module
    docstring). :meth:`regime` answers for the current load; :meth:`committed` counts the tokens of
    every round. Times in seconds on ``clock``."""

    window_s: float = 2.0
    windows_per_trial: int = 2
    stale_s: float = 300.0
    weight: float = 0.5  # of a new window's goodput in the figure of its way and load
    clock: Callable[[], float] = time.monotonic
    goodput: dict[tuple[int, str], tuple[float, float, int]] = field(default_factory=dict)  # (bucket, way): (tokens/s, at, windows)
    _bucket: int | None = None
    _way: str = PER_REQUEST
    _counted_s: float = 0.0  # the window's time so far with no prefill running
    _since: float | None = None  # when the window's stretch of counted time began; None: not counting
    _last: float = 0.0  # the last call of regime
    _tokens: int = 0
    _settling: bool = False  # the window runs unmeasured: the way changed at its start
    prefills: int = 0  # the coordinator's requests on the target whose prefill runs now

    def regime(self, running: int) -> str:
        """The way to choose K now, with ``running`` requests of the coordinator on the target: per
        request alone (1 or fewer: the per-request price is exact there) and until both ways were
        measured at this load; then the better, or a trial of the other when its figure is stale."""
        if running <= 1:
            self._bucket = None
            return PER_REQUEST
        bucket, now = load_bucket(running), self.clock()
        paused, self._last = now - self._last > self.window_s, now  # no round asked for a while
        if bucket != self._bucket:
            self._begin(bucket)
        elif paused:
            self._restart()
        elif self._elapsed(now) >= self.window_s:
            if self._settling:  # the window after a change: the requests were switching (opening drafts)
                self._settling = False
                self._restart()
            else:
                self._record(now)
                self._begin(bucket)
        return self._way

    def committed(self, num_tokens: int) -> None:
        """Counts ``num_tokens`` committed by a round of any of the coordinator's requests on the
        target, unless a prefill runs; the first round counted starts the window's clock again."""
        if self._bucket is None or self.prefills:
            return
        if self._since is None:
            self._since = self.clock()
        self._tokens += num_tokens

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """Around one request's prefill: the window's clock stops while any runs, and the rounds
        committed meanwhile are not counted, so that a window reads the decode steps' goodput
        whatever prefills fell in it (a closed loop's new requests prefill long prompts)."""
        self._stop_clock()
        self.prefills += 1
        try:
            yield
        finally:
            self.prefills -= 1

    def _stop_clock(self) -> None:
        if self._since is not None:
            self._counted_s += self.clock() - self._since
            self._since = None

    def _elapsed(self, now: float) -> float:
        return self._counted_s + (now - self._since if self._since is not None else 0.0)

    def _restart(self) -> None:
        """Discards what the window counted."""
        self._counted_s, self._since, self._tokens = 0.0, None, 0

    def _begin(self, bucket: int) -> None:
        way = self._next_way(bucket, self.clock())
        self._settling = way != self._way
        self._bucket, self._way = bucket, way
        self._restart()

    def _record(self, now: float) -> None:
        assert self._bucket is not None
        measured = self._tokens / self._elapsed(now)
        key = (self._bucket, self._way)
        old = self.goodput.get(key)
        if old is None or old[2] >= self.windows_per_trial and now - old[1] >= self.stale_s:  # a new trial
            self.goodput[key] = (measured, now, 1)
        else:
            figure = measured if old[2] == 0 else old[0] + (measured - old[0]) * max(self.weight, 1 / (old[2] + 1))
            self.goodput[key] = (figure, now, old[2] + 1)
        log.info(
            "choosing K under load, %d running requests (bucket %d): %s read %.1f tokens/s; figures %s",
            2 ** self._bucket, self._bucket, self._way, measured,
            {way: round(figure[0], 1) for (bucket, way), figure in self.goodput.items() if bucket == self._bucket},
        )

    def _next_way(self, bucket: int, now: float) -> str:
        """The way the next window at ``bucket`` runs: one not measured yet (per request first), a
        stale loser, else the better."""
        figures = {way: self.goodput.get((bucket, way)) for way in (PER_REQUEST, TOGETHER)}
        for way, figure in figures.items():
            if figure is None or figure[2] < self.windows_per_trial:
                return way
        best = max(figures, key=lambda way: figures[way][0])  # type: ignore[index]
        other = TOGETHER if best == PER_REQUEST else PER_REQUEST
        return other if now - figures[other][1] >= self.stale_s else best  # type: ignore[index]

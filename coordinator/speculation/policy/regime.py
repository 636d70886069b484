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
requests committed during it per second (their goodput), the whole window at one load.
"""

import logging
import math
import time
from collections.abc import Callable
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
    _started: float | None = None  # the window's first committed round; None: not begun
    _tokens: int = 0
    _settling: bool = False  # the window runs unmeasured: the way changed at its start

    def regime(self, running: int) -> str:
        """The way to choose K now, with ``running`` requests of the coordinator on the target: per
        request alone (1 or fewer: the per-request price is exact there) and until both ways were
        measured at this load; then the better, or a trial of the other when its figure is stale."""
        if running <= 1:
            self._bucket = None
            return PER_REQUEST
        bucket, now = load_bucket(running), self.clock()
        if bucket != self._bucket:
            self._begin(bucket, now)
        elif self._started is not None and now - self._started >= self.window_s:
            if now - self._started > 2 * self.window_s:  # no round asked for a while: the load paused
                self._started, self._tokens = None, 0
            elif self._settling:  # the window after a change: the requests were switching (opening drafts)
                self._settling, self._started, self._tokens = False, None, 0
            else:
                self._record(now)
                self._begin(bucket, now)
        return self._way

    def committed(self, num_tokens: int) -> None:
        """Counts ``num_tokens`` committed by a round of any of the coordinator's requests on the
        target; the first round after a window began starts its clock."""
        if self._bucket is None:
            return
        if self._started is None:
            self._started = self.clock()
        self._tokens += num_tokens

    def _begin(self, bucket: int, now: float) -> None:
        way = self._next_way(bucket, now)
        self._settling = way != self._way
        self._bucket, self._way, self._started, self._tokens = bucket, way, None, 0

    def _record(self, now: float) -> None:
        assert self._bucket is not None and self._started is not None
        measured = self._tokens / (now - self._started)
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

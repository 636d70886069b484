"""How a cell's requests arrive: the arrival patterns of ``specdec bench concurrency --arrivals``.

A pattern is a strategy that schedules a cell's requests; the cell runner
(:func:`specdec_app.bench.concurrency.run_cell`) sends them as scheduled, whatever the pattern. A
schedule is one list of :class:`ScheduledRequest` per client: a client sends its requests in
order, each at its ``send_at_s`` (seconds after the cell starts) or, where that is None, as soon
as its previous request has finished. The patterns, for a cell of N at ``requests_per_client``:

- ``closed`` (:class:`ClosedLoop`): N clients, each sends its next request when the previous one
  finished: the steady state of N users, requests never arrive together;
- ``burst`` (:class:`Burst`): N requests sent at once at t = 0, one per client; the cell ends
  when the last finishes (the cold-start spike of vLLM's and guidellm's "throughput" runs);
- ``poisson`` (:class:`PoissonArrivals`): N x ``requests_per_client`` requests, each its own
  client (open loop: an arrival never waits for a completion), arriving as a Poisson process
  of rate N x ``rate_per_client_hz`` requests/s, as ``vllm bench serve --request-rate`` and
  guidellm's ``poisson`` profile do. The first arrives at t = 0, the gaps between arrivals are
  exponential with mean 1 / rate, drawn by numpy's generator seeded with (seed, N): every method
  gets the same arrival times in a cell of N, and a run with the same seed the same as before.

Request ``index`` numbers a cell's requests in arrival order (closed loop: request j of client
c is ``j * N + c``); the runner gives it prompt ``index mod len(prompts)``.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

CLOSED, BURST, POISSON = "closed", "burst", "poisson"
ARRIVALS = (CLOSED, BURST, POISSON)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a cell: ``index`` (arrival order, picks the prompt), the ``client`` that
    sends it, and ``send_at_s``, seconds after the cell starts (None: when the client's previous
    request finished)."""

    index: int
    client: int
    send_at_s: float | None


Schedule = list[list[ScheduledRequest]]  # per client, its requests in the order it sends them


class ArrivalPattern(Protocol):
    """Schedules the requests of a cell of ``concurrency`` (N) at ``requests_per_client``."""

    @property
    def name(self) -> str: ...

    def schedule(self, concurrency: int, requests_per_client: int) -> Schedule: ...


@dataclass(frozen=True)
class ClosedLoop:
    """N clients, ``requests_per_client`` each, each request sent when the client's previous one
    finished (the first at t = 0)."""

    name: str = CLOSED

    def schedule(self, concurrency: int, requests_per_client: int) -> Schedule:
        return [
            [ScheduledRequest(j * concurrency + c, c, 0.0 if j == 0 else None) for j in range(requests_per_client)]
            for c in range(concurrency)
        ]


@dataclass(frozen=True)
class Burst:
    """N requests sent together at t = 0 (``requests_per_client`` does not apply)."""

    name: str = BURST

    def schedule(self, concurrency: int, requests_per_client: int) -> Schedule:
        return [[ScheduledRequest(c, c, 0.0)] for c in range(concurrency)]


@dataclass(frozen=True)
class PoissonArrivals:
    """N x ``requests_per_client`` requests at a Poisson rate of N x ``rate_per_client_hz``
    requests/s, seeded with (``seed``, N); see the module docstring."""

    rate_per_client_hz: float
    seed: int = 0
    name: str = POISSON

    def arrival_times_s(self, concurrency: int, num_requests: int) -> list[float]:
        """Seconds after the cell starts: 0, then exponential gaps of mean 1 / (N x rate)."""
        rng = np.random.default_rng([self.seed, concurrency])
        gaps = rng.exponential(1.0 / (concurrency * self.rate_per_client_hz), size=max(num_requests - 1, 0))
        return [0.0, *np.cumsum(gaps).tolist()][:num_requests]

    def schedule(self, concurrency: int, requests_per_client: int) -> Schedule:
        times = self.arrival_times_s(concurrency, concurrency * requests_per_client)
        return [[ScheduledRequest(i, i, at)] for i, at in enumerate(times)]


def parse_arrivals(spec: str) -> list[str]:
    """``burst,closed`` as a list in the order of :data:`ARRIVALS`. Raises ValueError."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names or any(name not in ARRIVALS for name in names):
        raise ValueError(f"--arrivals {spec!r}: use a comma-separated subset of {', '.join(ARRIVALS)}")
    return [name for name in ARRIVALS if name in names]


def arrival_pattern(name: str, rate_per_client_hz: float | None = None, seed: int = 0) -> ArrivalPattern:
    """The pattern called ``name``; ``poisson`` needs ``rate_per_client_hz`` (requests/s per
    client, > 0). Raises ValueError."""
    if name == CLOSED:
        return ClosedLoop()
    if name == BURST:
        return Burst()
    if name == POISSON:
        if not rate_per_client_hz or rate_per_client_hz <= 0:
            raise ValueError("poisson arrivals need a request rate per client above 0 (--request-rate)")
        return PoissonArrivals(rate_per_client_hz, seed)
    raise ValueError(f"unknown arrival pattern {name!r}: use {', '.join(ARRIVALS)}")


def prompt_slices(num_prompts: int, arrivals: list[str]) -> dict[str, range]:
    """Which prompts (indices into the run's prompt sequence) each arrival pattern draws from:
    disjoint, contiguous, as equal as they can be, so no prompt is sent in two patterns and the
    drafters' lookups meet each pattern's prompts fresh. Raises ValueError when there are fewer
    prompts than patterns."""
    if num_prompts < len(arrivals):
        raise ValueError(
            f"{len(arrivals)} arrival patterns need at least {len(arrivals)} prompts, one of their own each; "
            f"there are {num_prompts} (raise --limit or name fewer --arrivals)"
        )
    bounds = [round(i * num_prompts / len(arrivals)) for i in range(len(arrivals) + 1)]
    return {name: range(bounds[i], bounds[i + 1]) for i, name in enumerate(arrivals)}

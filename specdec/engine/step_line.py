"""A model's decode step cost as a line in the step's batched tokens, kept by the engine that runs
the steps (:class:`specdec.engine.engine.Engine`) and published with every reply of its service
(``ServiceLoad.step_intercept_ms`` and ``step_ms_per_token``, :mod:`specdec.rpc.service_load`), so
that every coordinator, a fresh one included, prices its rounds from the service's own
measurements over every caller's steps (:class:`coordinator.speculation.policy.step_costs.StepCosts`), not
only from the rounds it ran itself.

The line is fitted through one point per number of batched tokens: the start-up profile's
(:meth:`verify_service.target.Target.measure_costs`) to begin with, each then moved by every step
of decoding work of that many tokens (an EMA, ``weight`` on the newest). Steps that run a prefill
chunk stay out: a chunk's tokens cost less than decode tokens (no logits; one matrix product per
chunk), and the line prices what a draft token adds to a step. vLLM profiles its forward at start
the same way (``profile_run``), to size its KV cache; here the profile also seeds the prices.
"""

import statistics
import threading
from collections.abc import Iterable, Mapping

EMA_WEIGHT = 0.1


def fit_line(points: Mapping[int, float]) -> tuple[float, float]:
    """The least-squares line through ``points`` ({batched tokens: ms}) as (intercept ms, slope ms
    per batched token), its slope at least 0. A line rather than an interpolation: on a shared CPU
    one measurement varies by up to 2x, and a dip between two points would make the tokens up to
    the next look free. The 1-token step stays out where two points remain without it: on a CPU it
    runs a matrix-vector product, cheaper per token than any step of several tokens
    (docs/profiles.md#the-engine-loop-and-adaptive-k-under-load). One point: a flat line at its
    ms. Raises ValueError for no points."""
    if not points:
        raise ValueError("fit_line needs at least one measured step")
    if len(points) > 2:
        points = {n: ms for n, ms in points.items() if n != 1}
    if len(points) < 2:
        return next(iter(points.values())), 0.0
    slope, intercept = statistics.linear_regression(list(points), list(points.values()))
    return intercept, max(0.0, slope)


class StepLine:
    """The decode step line of one engine (module docstring). :meth:`observe` runs in the engine's
    thread and refits (about 20 µs a step at 100 points, 5 µs at 20, on this project's 2-core
    host); :meth:`line` reads the last fit from any thread at O(1) cost (a load report goes with
    every Step stream message)."""

    def __init__(self, weight: float = EMA_WEIGHT):
        self.weight = weight
        self._ms: dict[int, float] = {}  # by batched tokens
        self._line: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def seed(self, points: Iterable[tuple[int, float]]) -> None:
        """Sets the points ``(batched tokens, ms)`` measured at start (replacing what the profile's
        own steps taught)."""
        with self._lock:
            self._ms.update(points)
            self._line = fit_line(self._ms) if self._ms else None

    def observe(self, num_tokens: int, ms: float) -> None:
        """Learns from a step of decoding work of ``num_tokens`` batched tokens that took ``ms``."""
        with self._lock:
            old = self._ms.get(num_tokens)
            self._ms[num_tokens] = ms if old is None else old + self.weight * (ms - old)
            self._line = fit_line(self._ms)

    def line(self) -> tuple[float, float] | None:
        """(intercept ms, slope ms per batched token); None before any step was measured."""
        return self._line

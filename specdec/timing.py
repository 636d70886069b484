import time


def ms_since(start: float) -> float:
    """Milliseconds elapsed since ``start``, a ``time.perf_counter()`` reading."""
    return (time.perf_counter() - start) * 1000.0


def min_ms(step, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``step()``, in ms: start-up step-cost measurements
    take the minimum, the figure least disturbed by other work on the machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, ms_since(start))
    return best

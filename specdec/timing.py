import time


def ms_since(start: float) -> float:
    """Milliseconds elapsed since ``start``, a ``time.perf_counter()`` reading."""
    return (time.perf_counter() - start) * 1000.0

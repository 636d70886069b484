"""Timing helpers: elapsed milliseconds and the fastest of repeated calls."""

import time

from specdec.timing import min_ms, ms_since


def test_ms_since_counts_milliseconds():
    start = time.perf_counter()
    time.sleep(0.02)
    assert 15.0 <= ms_since(start) < 2000.0


def test_min_ms_takes_the_fastest_call():
    pauses = iter([0.03, 0.0, 0.03])
    calls = []

    def step():
        calls.append(1)
        time.sleep(next(pauses))

    assert min_ms(step, repeats=3) < 20.0 and len(calls) == 3

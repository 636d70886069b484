"""CPU time per process around a benchmark cell: /proc/<pid>/stat parsing, the before/after clock
and the per-token division."""

import os
import time

import pytest

from specdec_app.bench.cpu_time import CLOCK_TICKS_PER_S, CpuClock, cpu_seconds, ms_per_token, stat_cpu_seconds


def test_stat_fields_after_a_command_name_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 10 0 0 0 250 50 7 3 20 0 1 0 100 0 0\n"
    assert stat_cpu_seconds(stat) == pytest.approx(300 / CLOCK_TICKS_PER_S)  # utime + stime, children excluded


def test_cpu_seconds_of_a_process():
    assert cpu_seconds(os.getpid()) is not None
    assert cpu_seconds(2**22 + 12345) is None  # above the kernel's pid limit: no such process


def test_clock_measures_the_cpu_time_spent_between_start_and_stop():
    clock = CpuClock({"bench": os.getpid(), "gone": 2**22 + 12345})
    clock.start()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # busy: 0.3 s of CPU
        pass
    used = clock.stop()
    assert used["gone"] is None
    assert 0.25 <= used["bench"] <= 1.0


def test_ms_per_token():
    assert ms_per_token({"coordinator": 0.5, "verify": None}, 250) == {"coordinator": 2.0, "verify": None}
    assert ms_per_token({"coordinator": 0.5}, 0) == {"coordinator": None}

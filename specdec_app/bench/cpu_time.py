"""CPU time per process around a benchmark cell: what the serving path costs per generated token.

:func:`cpu_seconds` reads a process's user + system CPU time (every thread, not its children)
from ``/proc/<pid>/stat`` (fields 14 and 15, ``utime`` and ``stime``, in clock ticks of
``SC_CLK_TCK``); :class:`CpuClock` snapshots a set of named processes before and after a cell
and :func:`ms_per_token` divides each process's CPU time by the cell's generated tokens. Linux
only: elsewhere a process has no reading (None), and so no figure.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process ``pid`` has used so far (all its threads); None when
    /proc has no such process."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a ``/proc/<pid>/stat`` file."""
    # the command name (field 2) is in parentheses and may hold spaces and parentheses: count from the last ")"
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5); fields[0] is field 3
    return (utime + stime) / CLOCK_TICKS_PER_S


@dataclass
class CpuClock:
    """CPU seconds of named processes (``pids``: name -> pid) between :meth:`start` and
    :meth:`stop`."""

    pids: dict[str, int]
    _started: dict[str, float | None] = field(default_factory=dict)

    def start(self) -> None:
        self._started = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float | None]:
        """CPU seconds each process used since :meth:`start` (None where it had no reading)."""
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return {name: _difference(now[name], self._started.get(name)) for name in self.pids}


def _difference(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def ms_per_token(cpu_s: dict[str, float | None], num_tokens: int) -> dict[str, float | None]:
    """CPU ms per generated token, per process: CPU seconds x 1000 / ``num_tokens`` (None without
    a reading or without tokens)."""
    return {
        name: None if seconds is None or num_tokens <= 0 else seconds * 1000.0 / num_tokens
        for name, seconds in cpu_s.items()
    }

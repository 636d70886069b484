"""CPU pinning: where the batch-1 benchmark's processes run (``specdec bench --placement``; not the
coordinator's replica placement, :mod:`coordinator.speculation.placement`).

- ``shared``: every process on every core, each with its libraries' default thread counts (one
  machine running everything, as ``specdec up`` does).
- ``split``: the draft service pinned to one CPU and the verify service to another, each with one
  thread (torch's and llama.cpp's), emulating a draft on its own device, as the mission deploys it;
  the coordinator stays on every core (it tokenizes and routes). The plain baseline then runs
  twice: on every core as usual (``plain``) and pinned to the verify service's CPU with one thread
  (``plain/verify-cpu``), so that the split pipeline is read against a target on the same
  hardware as well as against one with all of it.

Pinning uses ``os.sched_setaffinity`` (Linux).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PLACEMENTS = ("shared", "split")
PINNED_PLAIN = "plain/verify-cpu"


@dataclass(frozen=True)
class CpuPinning:
    """``cpus``: the CPU set per service (``draft``, ``verify``); empty for ``shared``."""

    name: str
    cpus: dict[str, frozenset[int]]

    @property
    def service_args(self) -> dict[str, list[str]]:
        """Flags that match each pinned service's thread counts to its one CPU; on shared cores,
        the coordinator's ``--draft-shares-target-cores`` (the draft prefills after the first
        token and drafts ahead the main branch alone, docs/architecture.md#one-round)."""
        if not self.cpus:
            return {"coordinator": ["--draft-shares-target-cores"]}
        return {"verify": ["--num-threads", "1"], "draft": ["--num-threads", "1", "--llama-cpp-n-threads", "1"]}


SHARED = CpuPinning("shared", {})


def cpu_pinning(name: str) -> CpuPinning:
    """The CPU pinning of ``--placement name`` on this machine. Raises ValueError for an unknown
    name, or ``split`` with fewer than 2 CPUs available to this process."""
    if name not in PLACEMENTS:
        raise ValueError(f"--placement {name!r}: use one of {', '.join(PLACEMENTS)}")
    if name == "shared":
        return SHARED
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--placement split needs 2 CPUs; this process may run on {len(cpus)}: use --placement shared")
    return CpuPinning(name, {"draft": frozenset(cpus[:1]), "verify": frozenset(cpus[1:2])})


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Runs the block on ``cpus`` with one torch thread (None: as it is), then restores both."""
    if not cpus:
        yield
        return
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)

"""A draft or verify service's load (``specdec.v1.ServiceLoad``), sent with every GetInfo answer and
every Step stream message: what the coordinator's placement scores replicas by and what an
autoscaler scales on (docs/architecture.md#load-reports).

Every figure is a read that costs O(1), so that the load can go with every message under load: the
session registry's counts (:meth:`specdec.rpc.sessions.SessionRegistry.num_in_use`), each engine's
counters (:meth:`specdec.engine.engine.Engine.num_waiting_calls`,
:meth:`specdec.engine.engine.Engine.num_running_seqs`, no lock) and each model's KV usage
(:meth:`specdec.engine.batching.BatchedLM.kv_usage`: the store's lock for a sum over the sequences still
prefilling only); its cost is in docs/profiles.md#what-a-load-report-costs.
"""

from collections.abc import Iterable

from specdec.engine.engine import Engine
from specdec.rpc.sessions import SessionRegistry
from specdec.v1 import common_pb2


def service_load(sessions: SessionRegistry, engines: Iterable[Engine]) -> common_pb2.ServiceLoad:
    """The service's load now: its sessions (open or being opened) and ``max_sessions``; summed
    over ``engines`` (the verify service's target, the draft service's model drafters), the calls
    waiting for their first step, the running sequences, and the KV blocks (of ``kv_block_size``
    tokens) in the budget and free for a new session of the engines whose model keeps its KV in a
    budget of blocks (none: 0, 0 and 0); and the step line (:class:`specdec.engine.step_line.StepLine`)
    of the first engine that measured one (the verify service runs one engine; 0 and 0: none)."""
    waiting = running = total = free = block_size = 0
    line: tuple[float, float] | None = None
    for engine in engines:
        waiting += engine.num_waiting_calls()
        running += engine.num_running_seqs()
        if (kv := engine.lm.kv_usage()) is not None:
            total, free, block_size = total + kv.budget, free + kv.free, kv.block_size
        line = line or engine.step_line.line()
    intercept_ms, ms_per_token = line or (0.0, 0.0)
    return common_pb2.ServiceLoad(
        num_sessions=sessions.num_in_use(),
        max_sessions=sessions.max_sessions,
        num_waiting_calls=waiting,
        num_running_seqs=running,
        kv_blocks_total=total,
        kv_blocks_free=free,
        kv_block_size=block_size,
        step_intercept_ms=intercept_ms,
        step_ms_per_token=ms_per_token,
    )

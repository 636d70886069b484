"""Placement: which replica of the draft or the verify service a new session opens on.

A session lives on one replica for its life (its KV cache is there), so the choice is made once,
when it opens (or is rebuilt after its replica failed), from what the coordinator knows of each
replica:

- **Prefix affinity.** Each replica's prefix cache holds the KV of what it prefilled recently; a
  prompt that begins with that (a shared system prompt, a chat's earlier turns) skips computing
  it there, and only there. The coordinator remembers, per replica, the block chains of the
  prompts it placed there (blocks of :data:`BLOCK_SIZE` tokens, each named by the hash of the
  whole prefix it ends, so a chain matches only from the start: the key the services' prefix
  caches use; keyed with the request's cache salt, as the services' caches are partitioned by it,
  so a tenant's prompts follow only its own), at most ``memory_blocks`` per replica, least recently
  placed forgotten first. A prompt's match on a replica is its leading blocks found there. The services' own caches may
  have evicted what this remembers, or hold what another coordinator placed: a guess, as SGLang's
  cache-aware router's radix trees and llm-d's prefix scorer are, which only costs a prefill that
  might have been skipped.
- **Load.** A replica's load is its sessions (this coordinator's own there now, counted from the
  moment a Prefill is sent so that a burst spreads before any report comes back, plus the other
  coordinators' as its last report counted them: each message of its Step stream to this
  coordinator reports them, ``common.ServiceLoad``). This coordinator's own count by their length
  (the prompt and the most tokens the request may generate: the tokens the replica will prefill
  and decode for it, what its compute and KV grow with) over the mean length of all its sessions,
  so that sessions of equal length count one each and a burst of prompts of 30 to 1,000 tokens
  spreads its work, not only its sessions (by count alone one replica of three took 41% of the
  verify CPU); the others' count one each. The load is weighted by how slow its calls
  are besides their compute: each call's round trip less the compute the replica reports for it
  (the network between coordinator and replica, anything that holds the call before the engine),
  an average over the recent calls, added to the replicas' common compute time and compared with
  the fastest replica's. So a replica behind a slow link, or held up, weighs more, while one that
  is only busier now (its compute longer) is weighed by its load alone, not twice. A replica whose KV budget cannot
  hold the prompt now is avoided. A report older than REPORT_TTL_S is not used: it comes from a
  replica this coordinator no longer calls.

The policy is SGLang's cache-aware routing: while the replicas are balanced, the one that holds
the most of the prompt wins if that is at least ``min_match`` of it, else the least loaded; when
they are not (the busiest's weighted load is more than ``balance_abs`` above the idlest's and more
than ``balance_rel`` times it), the least loaded, whatever it holds. Ties go round robin. So a
shared prefix keeps its requests together until its replica is clearly busier than the others,
then they spill over, while prompts that share little (a chat template's default system prompt)
spread by load alone. Between replicas whose weighted loads are within
one session of the least (:data:`TIE`), the choice goes to the one rendezvous hashing (Thaler &
Ravishankar 1998) ranks first for the prompt's first half, so that every coordinator, each with its
own memory and a slightly different view of the load, sends a new shared prefix to the same
replica, while a burst of different prompts still spreads within a session or two of even.
``policy="round-robin"`` ignores both (the comparison the bench makes).
Replicas marked down go last, in any policy, for failover to try them only when nothing else
answers; replicas whose KV cannot hold the prompt go after those that can.
"""

import collections
import hashlib
import itertools
import logging
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
BLOCK_SIZE = 16  # tokens per remembered block, as the services' KV blocks
Policy = Literal["prefix-load", "round-robin"]
POLICIES: tuple[Policy, ...] = ("prefix-load", "round-robin")
LATENCY_WEIGHT = 0.2  # the weight of a new call's overhead and compute in a replica's averages
TIE = 1.0  # weighted loads this close to the least are a tie, broken by rendezvous hashing
# A load report older than this is not used (seconds): a replica reports with every Step message it
# sends this coordinator, so an old one is from a replica this coordinator no longer calls, and says
# nothing of its load now.
REPORT_TTL_S = 1.0
# A replica's call times are compared with the others' only while recent (seconds): an average from
# calls made long ago says little of it now, and one that no call refreshes (a replica weighed out of
# placement gets no calls) must not keep it out.
LATENCY_TTL_S = 2.0
# Prompts of at least this many blocks name their tie-breaking hash by the block at their middle
# (a long shared prefix, a system prompt, is in it); shorter ones by their last (their own text,
# not the chat template's default system prompt every short prompt begins with).
HASH_MIDDLE_FROM_BLOCKS = 8


def block_chain(tokens: Sequence[int], block_size: int = BLOCK_SIZE, cache_salt: str = "") -> list[bytes]:
    """The names of ``tokens``' whole leading blocks: entry i hashes blocks 0..i (so equal names
    mean equal prefixes of the same ``cache_salt``, the hash's key), 16 bytes each."""
    chain, digest = [], hashlib.blake2b(digest_size=16, key=cache_salt.encode())
    for end in range(block_size, len(tokens) + 1, block_size):
        digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[end - block_size : end]))
        chain.append(digest.copy().digest())
    return chain


def _hash_key(chain: list[bytes], prompt: Sequence[int]) -> bytes:
    """What rendezvous hashing ranks the replicas by for ``prompt`` (see HASH_MIDDLE_FROM_BLOCKS)."""
    if len(chain) >= HASH_MIDDLE_FROM_BLOCKS:
        return chain[(len(chain) - 1) // 2]
    return block_chain(prompt, max(1, len(prompt)))[-1] if prompt else b""


@dataclass
class ReplicaState:
    """What placement knows of one replica: its last load report, the sessions this coordinator
    holds there, its calls' recent overhead and compute (ms, averages), the block
    chains placed there (an LRU); and, for the metrics, the sessions placed there and the prompt
    tokens they found in its prefix cache, counted since it was found."""

    load: common_pb2.ServiceLoad | None = None
    load_at: float = 0.0  # time.monotonic() of the report
    sessions_at_report: int = 0  # this coordinator's sessions there when the report came
    sessions: int = 0
    tokens: int = 0  # the lengths of this coordinator's sessions there (see Placement.opening), tokens
    overhead_ms: float = 0.0  # its calls' round trip less their compute, an average
    compute_ms: float = 0.0  # its calls' compute, an average
    latency_at: float = 0.0  # time.monotonic() of the last call measured
    blocks: collections.OrderedDict[bytes, None] = field(default_factory=collections.OrderedDict)
    placed: int = 0
    cached_tokens: int = 0

    def matched_blocks(self, chain: list[bytes]) -> int:
        """How many of ``chain``'s leading blocks were placed here (a chain's entries are placed
        together, so the longest one found says it)."""
        return next((i + 1 for i in range(len(chain) - 1, -1, -1) if chain[i] in self.blocks), 0)

    def recent(self) -> bool:
        """Whether a call of it was measured in the last LATENCY_TTL_S."""
        return time.monotonic() - self.latency_at <= LATENCY_TTL_S

    def report(self) -> common_pb2.ServiceLoad | None:
        """Its last load report, unless older than REPORT_TTL_S."""
        return self.load if time.monotonic() - self.load_at <= REPORT_TTL_S else None

    def others(self) -> int:
        """The other coordinators' sessions there, as its last report counted them (the report's
        sessions less this coordinator's then, so that one of ours that ended since does not
        count). Not its waiting calls: a Step message reports them just after a step took the
        queue in, a GetInfo at any moment, so the replica every request's GetInfo asks looked
        busier than the others (the sessions it has would wait in a queue anyway)."""
        report = self.report()
        return max(0, report.num_sessions - self.sessions_at_report) if report is not None else 0

    def has_room(self, num_blocks: int) -> bool:
        """Whether its KV budget could take ``num_blocks`` blocks now, as far as its report says."""
        report = self.report()
        return report is None or not report.kv_blocks_total or report.kv_blocks_free >= num_blocks


class Placement:
    """The placement of one service's sessions (see the module docstring) over the replicas the
    caller names at each choice (they come and go with discovery). ``memory_blocks``: blocks
    remembered per replica; ``balance_abs`` (sessions), ``balance_rel`` and ``min_match`` as the
    module docstring says.
    One event loop uses it: no lock."""

    def __init__(
        self,
        policy: Policy = "prefix-load",
        memory_blocks: int = 4096,
        balance_abs: float = 8.0,
        balance_rel: float = 1.5,
        min_match: float = 0.5,
    ):
        if policy not in POLICIES:
            raise ValueError(f"placement policy {policy!r}: choose among {', '.join(POLICIES)}")
        self.policy, self.memory_blocks = policy, memory_blocks
        self.balance_abs, self.balance_rel, self.min_match = balance_abs, balance_rel, min_match
        self._replicas: dict[str, ReplicaState] = {}
        self._turn = itertools.count()
        self._step_line: tuple[float, float] | None = None  # the newest report's, see step_line

    def step_line(self) -> tuple[float, float] | None:
        """The step line (intercept ms, ms per batched token: ``ServiceLoad.step_intercept_ms`` and
        ``step_ms_per_token``) of the newest load report that had one, any replica's (the replicas
        run one model; no age limit: a step's cost does not go stale as a load does); None before
        one came. Adaptive K prices every option of every round by it: a read of one field."""
        return self._step_line

    def state(self, replica: str) -> ReplicaState:
        return self._replicas.setdefault(replica, ReplicaState())

    def replicas(self) -> list[tuple[str, ReplicaState]]:
        """Every replica known, with its state (a copy of the list: safe to read from another
        thread, as a Prometheus scrape does)."""
        return list(self._replicas.items())

    def forget(self, keep: Iterable[str]) -> None:
        """Drops what is known of every replica but ``keep`` (those discovery still finds)."""
        kept = set(keep)
        for gone in [r for r in self._replicas if r not in kept]:
            del self._replicas[gone]

    def rank(
        self, replicas: Sequence[str], prompt: Sequence[int], down: Iterable[str] = (), cache_salt: str = ""
    ) -> list[str]:
        """``replicas`` in the order to try them for a new session over ``prompt`` of ``cache_salt``:
        the choice first, the rest by weighted load, those in ``down`` last."""
        down = set(down)
        if self.policy == "round-robin":
            start = next(self._turn) % max(1, len(replicas))
            rotated = [*replicas[start:], *replicas[:start]]
            return [*(r for r in rotated if r not in down), *(r for r in rotated if r in down)]
        chain = block_chain(prompt, cache_salt=cache_salt)
        key = _hash_key(chain, prompt)
        by_hash = sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest())
        up = [r for r in by_hash if r not in down]
        if len(up) < 2:
            return [*up, *(r for r in by_hash if r in down)]
        costs = self._costs(up)
        room = [r for r in up if self.state(r).has_room(len(prompt) // BLOCK_SIZE + 1)] or up
        ranked = sorted(up, key=lambda r: (r not in room, costs[r]))
        idlest, busiest = min(costs[r] for r in room), max(costs[r] for r in room)
        best = next(r for r in up if r in room and costs[r] <= idlest + TIE)  # the hash's first of the least loaded
        balanced = busiest - idlest <= self.balance_abs or busiest <= self.balance_rel * idlest
        if balanced:
            matches = {r: self.state(r).matched_blocks(chain) for r in room}
            held = max(room, key=lambda r: (matches[r], -costs[r]))
            if matches[held] * BLOCK_SIZE >= self.min_match * len(prompt):
                best = held
        ranked.remove(best)
        if log.isEnabledFor(logging.DEBUG):  # --log-level debug: why each session went where it went
            log.debug(
                "placed on %s: %s; balanced %s",
                best,
                ", ".join(self._explain(r, costs[r], chain) for r in up),
                balanced,
            )
        return [best, *ranked, *(r for r in by_hash if r in down)]

    def _explain(self, replica: str, cost: float, chain: list[bytes]) -> str:
        """One replica's part in a choice: its cost, its sessions (this coordinator's, the
        others' as reported), its calls' overhead and compute, the prompt's blocks placed there."""
        state = self.state(replica)
        return (
            f"{replica} cost {cost:.2f} (sessions {state.sessions} of {state.tokens} tokens + {state.others()} "
            "reported, "
            f"overhead {state.overhead_ms:.1f} ms, compute {state.compute_ms:.1f} ms, "
            f"{'recent' if state.recent() else 'stale'}, matched {state.matched_blocks(chain)} blocks)"
        )

    def _costs(self, replicas: list[str]) -> dict[str, float]:
        """Each replica's load times its slowness, plus one (the session to place): idle
        replicas tie whatever their speed, and a slow one's load weighs more. Slowness: (its
        calls' overhead + the replicas' mean compute) over (the least overhead + that mean),
        among the replicas measured recently; 1 for the others."""
        measured = [self.state(r) for r in replicas if self.state(r).recent()]
        mean_length = self._mean_length()
        if len(measured) < 2:
            return {r: self._load(self.state(r), mean_length) + 1.0 for r in replicas}
        compute = statistics.fmean(state.compute_ms for state in measured)
        least = min(state.overhead_ms for state in measured) + compute
        costs = {}
        for r in replicas:
            state = self.state(r)
            slowness = (state.overhead_ms + compute) / least if state.recent() and least > 0 else 1.0
            costs[r] = self._load(state, mean_length) * slowness + 1
        return costs

    def load(self, replica: str) -> float:
        """The replica's sessions, this coordinator's counted by their length over the mean length
        of all its sessions, the others' one each (see the module docstring)."""
        return self._load(self.state(replica), self._mean_length())

    def _mean_length(self) -> float:
        """The mean length of this coordinator's sessions on every replica, tokens (0: none)."""
        sessions = sum(s.sessions for s in self._replicas.values())
        return sum(s.tokens for s in self._replicas.values()) / sessions if sessions else 0.0

    @staticmethod
    def _load(state: ReplicaState, mean_length: float) -> float:
        own = state.tokens / mean_length if mean_length > 0 else state.sessions
        return own + state.others()

    def opening(self, replica: str, prompt: Sequence[int], length: int, cache_salt: str = "") -> None:
        """A session over ``prompt`` of ``cache_salt`` is being opened on ``replica`` (its Prefill
        sent): it counts there from now on, by its ``length`` (tokens: the prompt's and the most the
        request may generate, its committed ones included), so the next choices of a burst see it,
        and its blocks are remembered there, so the burst's requests with the same prefix follow
        it. :meth:`closed` with the same length if the Prefill fails or the session ends,
        :meth:`opened` when it succeeds."""
        state = self.state(replica)
        state.sessions += 1
        state.tokens += length
        for name in block_chain(prompt, cache_salt=cache_salt):
            state.blocks[name] = None
            state.blocks.move_to_end(name)
        while len(state.blocks) > self.memory_blocks:
            state.blocks.popitem(last=False)

    def opened(self, replica: str, cached_tokens: int) -> None:
        """The session being opened on ``replica`` is open, ``cached_tokens`` of its prompt found
        in the replica's prefix cache (the metrics' counts)."""
        state = self.state(replica)
        state.placed += 1
        state.cached_tokens += cached_tokens

    def closed(self, replica: str, length: int) -> None:
        """A session of ``length`` tokens (as :meth:`opening` counted it) this coordinator held on
        ``replica`` was released."""
        state = self._replicas.get(replica)
        if state is not None and state.sessions:
            state.sessions -= 1
            state.tokens = max(0, state.tokens - length)

    def observe(
        self,
        replica: str,
        load: common_pb2.ServiceLoad | None = None,
        round_trip_ms: float | None = None,
        compute_ms: float = 0.0,
    ) -> None:
        """A call to ``replica`` answered: its load report; the call's round trip and the compute
        the replica reported for it (ms)."""
        state = self.state(replica)
        if load is not None:
            state.load, state.load_at, state.sessions_at_report = load, time.monotonic(), state.sessions
            if load.step_intercept_ms or load.step_ms_per_token:
                self._step_line = (load.step_intercept_ms, load.step_ms_per_token)
        if round_trip_ms is not None:
            weight = LATENCY_WEIGHT if state.recent() else 1.0
            state.overhead_ms += weight * (max(0.0, round_trip_ms - compute_ms) - state.overhead_ms)
            state.compute_ms += weight * (compute_ms - state.compute_ms)
            state.latency_at = time.monotonic()

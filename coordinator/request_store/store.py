"""The coordinator's request store: every request's parameters, model identities, committed token
ids, status and timestamps, so that any coordinator replica can resume it; and the acceptance
estimates per (drafter, target) that warm-start adaptive K on every replica.

:class:`RedisStore` (redis-py asyncio) when ``SPECDEC_REDIS_URL`` is set (one Redis, or a Redis
Cluster with ``--redis-cluster``), :class:`MemoryStore` in the process otherwise
(single-machine use: a resume must then reach the same coordinator). Both keep a request
``ttl_s`` seconds after its last write (in Redis, at least 7/8 of that for a running request,
whose appends set the TTL again only every ttl_s / 8: :mod:`coordinator.request_store.journal`).

A request belongs to the API key that started it: its record is stored under the key's owner hash
and its id, ``<owner>/<id>`` (:func:`store_id`; the id alone when the coordinator has no keys), so
another key's request with the same id is another record, and a key can neither load nor
overwrite a record of another key's. Layout in Redis (the hash tag keeps a request's keys in one
cluster slot; ``<id>`` is the store id):

    specdec:request:{<id>}           hash: request (GenerateRequest bytes, seed filled in), target,
                                     vocab_fingerprint, status, finish_reason, metrics
                                     (RequestMetrics bytes), created_at, updated_at (unix seconds;
                                     updated_at: last written whole, not per round),
                                     sessions (JSON: service -> session id held while running),
                                     choice (its index among the choices of a request with n > 1),
                                     claim (the request's hold on its id: StoredRequest.claim)
    specdec:request:{<id>}:tokens    string: the generated token ids, int32 little-endian
    specdec:request:{<id>}:logprobs  string: with GenerateRequest.logprobs, the generated tokens'
                                     log-probabilities, one TokenLogprobs each, as the bytes of a
                                     GenerateResponse carrying only them (appending such bytes
                                     appends to the list: protobuf merges repeated fields)
    specdec:acceptance:<target>    hash: drafter (or ngram/<n>) -> JSON list of per-position rates
    specdec:acceptance-of:<owner>:<target>  the same, of one owner's requests (adaptive K's warm
                                   starts are per owner: coordinator.speculation.policy.adaptive_state.AdaptiveState)
    specdec:running:{<client>}     sorted set: the client's running requests' leases -> their
                                   expiry (unix ms), see :meth:`RequestStore.acquire_leases`
    specdec:finished:{<client>}    sorted set: the store ids of the client's ended requests -> when
                                   they ended (unix ms), see :meth:`RequestStore.retire`

Each operation's keys are in one cluster slot (one key, or a request's keys under its hash tag), so
on a Redis Cluster each runs whole on one master, transactions and scripts included; the records
:meth:`RequestStore.retire` drops are deleted one DEL each, in a pipeline over their masters.

What one client can keep there is bounded: its running requests by its leases
(``max_streams_per_client``), its ended ones by ``max_finished_per_client`` (the oldest dropped
beyond it), each record by the coordinator's ``max_stored_request_bytes`` (and the tokens a request
may generate); unknown protobuf fields are never stored. Every key has a TTL. Redis is meant to run
with ``maxmemory-policy noeviction`` (docs/scaling.md#the-request-stores-memory): nothing is evicted,
and a write Redis refuses for being full raises :class:`StoreFull`. The leases' scripts (and the
trimming of ended requests, which frees memory) run even then (Redis's ``allow-oom`` script flag),
so a full store never breaks the per-client limit.

A RedisStore that fails (unreachable, or slower than ``timeout_s``) raises
:class:`StoreUnavailable` after logging it and counting it in ``errors`` (a Prometheus counter
labelled by operation), and raises it at once for ``retry_after_s`` seconds instead of waiting on
a dead server again. A full store raises StoreFull (counted too) and is asked again at once: it
is up, and other writes (appends of running requests that fit, releases) still succeed.
"""

import abc
import asyncio
import copy
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, cast, get_args
from urllib.parse import urlsplit, urlunsplit

import grpc
import numpy as np
from redis.exceptions import OutOfMemoryError
from redis.typing import EncodableT, FieldT

from coordinator.request_store.redis_appends import Append, AppendBatcher
from coordinator.request_store.redis_client import FAILURES, connect
from specdec.rpc.errors import Unavailable
from specdec.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

RUNNING, FINISHED, FAILED, CANCELLED = "running", "finished", "failed", "cancelled"
TOKEN_DTYPE = np.dtype("<i4")


class StoreUnavailable(Unavailable):
    """The request store could not be reached."""


class StoreFull(StoreUnavailable):
    """The request store refused a write for being full (Redis's ``maxmemory`` under the
    ``noeviction`` policy): RESOURCE_EXHAUSTED (HTTP 429) to a new request."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def store_id(owner: str, request_id: str) -> str:
    """The id a request is stored under: ``<owner>/<request_id>``, or ``request_id`` without an
    owner (a coordinator without API keys). Request ids hold no ``/``."""
    return f"{owner}/{request_id}" if owner else request_id


@dataclass
class StoredRequest:
    """One request as the store keeps it. ``request`` is the GenerateRequest as the client sent
    it, with the seed filled in; ``generated`` the committed token ids after the prompt, and
    ``logprobs`` theirs (one each when the request asks for them, else none); ``finish_reason``
    and ``metrics`` are set once ``status`` is FINISHED; ``sessions`` the ids of the sessions a
    running request holds, by service (``draft``, ``verify``), so that a resume on another
    coordinator can release those its dead coordinator left behind; ``choice``: the request's
    index among the choices of a request with n > 1 (:mod:`coordinator.api.choices`); ``owner``:
    the owner hash of the API key that started it (:func:`coordinator.api.auth.owner_hash`; empty
    without keys); ``claim``: a random name of this request's hold on its id, so that a create whose
    answer was lost (the store went away after writing it) is known as its own when tried again."""

    request_id: str
    request: coordinator_pb2.GenerateRequest
    target: str
    vocab_fingerprint: str
    status: str = RUNNING
    generated: list[int] = field(default_factory=list)
    finish_reason: coordinator_pb2.FinishReason = coordinator_pb2.FINISH_REASON_UNSPECIFIED
    metrics: coordinator_pb2.RequestMetrics | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    sessions: dict[str, str] = field(default_factory=dict)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    choice: int = 0
    owner: str = ""
    claim: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this request's hold on its id

    @property
    def store_id(self) -> str:
        return store_id(self.owner, self.request_id)

    def header(self) -> dict[FieldT, EncodableT]:
        """Every field but the tokens, as Redis hash fields."""
        return {
            "request": self.request.SerializeToString(),
            "target": self.target,
            "vocab_fingerprint": self.vocab_fingerprint,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.SerializeToString() if self.metrics else b"",
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "sessions": json.dumps(self.sessions),
            "choice": self.choice,
            "claim": self.claim,
        }

    @classmethod
    def from_redis(
        cls, stored_as: str, header: dict[bytes, bytes], tokens: bytes | None, logprobs: bytes | None
    ) -> "StoredRequest":
        """The record stored under the store id ``stored_as``."""
        fields = {key.decode(): value for key, value in header.items()}
        owner, _, request_id = stored_as.rpartition("/")
        return cls(
            request_id,
            coordinator_pb2.GenerateRequest.FromString(fields["request"]),
            fields["target"].decode(),
            fields["vocab_fingerprint"].decode(),
            fields["status"].decode(),
            np.frombuffer(tokens or b"", dtype=TOKEN_DTYPE).tolist(),
            cast(coordinator_pb2.FinishReason, int(fields["finish_reason"])),  # the enum's number
            coordinator_pb2.RequestMetrics.FromString(fields["metrics"]) if fields["metrics"] else None,
            float(fields["created_at"]),
            float(fields["updated_at"]),
            json.loads(fields.get("sessions", b"{}")),
            list(coordinator_pb2.GenerateResponse.FromString(logprobs or b"").logprobs),
            int(fields.get("choice", b"0")),
            owner,
            fields.get("claim", b"").decode(),
        )


def logprobs_bytes(logprobs: list[common_pb2.TokenLogprobs]) -> bytes:
    """The stored form of ``logprobs`` (see the module docstring): bytes that append to a list."""
    return coordinator_pb2.GenerateResponse(logprobs=logprobs).SerializeToString()


class RequestStore(abc.ABC):
    """Where requests and acceptance estimates live, each request ``ttl_s`` seconds after its last
    write and, per client, at most ``max_finished_per_client`` ended requests (0: no bound but the
    TTL). Every method may raise StoreUnavailable (StoreFull among them)."""

    def __init__(self, ttl_s: float, max_finished_per_client: int = 0):
        self.ttl_s, self.max_finished_per_client = ttl_s, max_finished_per_client

    @abc.abstractmethod
    async def create(self, record: StoredRequest) -> bool:
        """Writes a new record; False (and nothing written) when its id is already stored by another
        request. Atomic: of two requests created with one id at once, one gets False. A record's
        own earlier claim, made by a call that then failed (the store went away before it
        answered), is not another's: creating it again writes it."""

    @abc.abstractmethod
    async def put(self, record: StoredRequest) -> None:
        """Writes the whole record (creating or replacing it)."""

    @abc.abstractmethod
    async def append(
        self,
        stored_as: str,
        tokens: list[int],
        sessions: dict[str, str] | None = None,
        logprobs: list[common_pb2.TokenLogprobs] | None = None,
        *,
        stored: int,
        keep_alive: bool = True,
    ) -> int:
        """Appends generated tokens (and their ``logprobs``, when given) to the record under the
        store id ``stored_as`` (:attr:`StoredRequest.store_id`) (and replaces its ``sessions``,
        unless None); ``stored``: the tokens the caller knew the record to hold before. Returns how
        many it holds now, or 0 when that is not ``stored + len(tokens)`` (the store lost the
        record): then :meth:`put` it again. ``keep_alive``: give the record ``ttl_s`` again from
        now (else its expiry stays where its last keep-alive or whole write set it)."""

    @abc.abstractmethod
    async def retire(self, client: str, stored_as: str) -> None:
        """Counts the ended request under the store id ``stored_as`` among ``client``'s ended
        requests, and drops the records of its oldest beyond ``max_finished_per_client``."""

    @abc.abstractmethod
    async def load(self, stored_as: str) -> StoredRequest | None:
        """The record under the store id ``stored_as`` (:func:`store_id`), or None (never stored,
        or expired)."""

    @abc.abstractmethod
    async def load_priors(self, target: str, owner: str = "") -> dict[str, list[float]]:
        """Per-position acceptance rates per drafter (``ngram/<n>`` for n-gram lookup) for
        ``target``, learnt from ``owner``'s requests ("": the requests of no owner)."""

    @abc.abstractmethod
    async def save_priors(self, target: str, priors: dict[str, list[float]], owner: str = "") -> None:
        """Replaces the rates of the drafters in ``priors`` for ``target`` and ``owner``."""

    @abc.abstractmethod
    async def acquire_leases(self, client: str, leases: list[str], limit: int, ttl_s: float) -> int | None:
        """Takes ``leases`` (new ids) for ``client``'s running requests, each living ``ttl_s``
        seconds unless renewed, if the client then holds at most ``limit``; returns None when
        taken, else the number it holds (nothing taken). Atomic across coordinators."""

    @abc.abstractmethod
    async def renew_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        """Gives the leases of each client (client -> lease ids) ``ttl_s`` more seconds from now."""

    @abc.abstractmethod
    async def release_leases(self, client: str, leases: list[str]) -> None:
        """Gives ``client``'s ``leases`` back."""

    async def close(self) -> None:  # noqa: B027 (a no-op unless there is a connection: MemoryStore has none)
        """Closes the connection, if any."""


class MemoryStore(RequestStore):
    """The store inside this process (no Redis). Never raises."""

    def __init__(self, ttl_s: float, max_finished_per_client: int = 0):
        super().__init__(ttl_s, max_finished_per_client)
        self._requests: dict[str, tuple[StoredRequest, float]] = {}  # id -> (record, expiry)
        # client -> store ids of its ended requests, the oldest first
        self._finished: dict[str, dict[str, None]] = {}
        self._priors: dict[tuple[str, str], dict[str, list[float]]] = {}  # by (target, owner)
        self._leases: dict[str, dict[str, float]] = {}  # client -> lease id -> expiry (time.monotonic())

    def _live(self, stored_as: str) -> StoredRequest | None:
        """The record, unless expired (an O(1) look-up: it runs every round)."""
        entry = self._requests.get(stored_as)
        return entry[0] if entry and entry[1] > time.monotonic() else None

    async def create(self, record: StoredRequest) -> bool:
        held = self._live(record.store_id)
        if held is not None and held.claim != record.claim:
            return False
        await self.put(record)
        return True

    async def put(self, record: StoredRequest) -> None:
        now = time.monotonic()  # expired records go here, at a request's start and end
        for expired in [rid for rid, (_, expiry) in self._requests.items() if expiry <= now]:
            del self._requests[expired]
        self._requests[record.store_id] = (copy.deepcopy(record), now + self.ttl_s)

    async def append(
        self,
        stored_as: str,
        tokens: list[int],
        sessions: dict[str, str] | None = None,
        logprobs: list[common_pb2.TokenLogprobs] | None = None,
        *,
        stored: int,
        keep_alive: bool = True,
    ) -> int:
        """Keeps the record alive at every append (``keep_alive`` is for Redis's commands)."""
        record = self._live(stored_as)
        if record is None or len(record.generated) != stored:
            return 0
        record.generated.extend(tokens)
        record.logprobs.extend(copy.deepcopy(logprobs or []))
        if sessions is not None:
            record.sessions = dict(sessions)
        record.updated_at = time.time()
        self._requests[stored_as] = (record, time.monotonic() + self.ttl_s)
        return len(record.generated)

    async def retire(self, client: str, stored_as: str) -> None:
        finished = self._finished.setdefault(client, {})
        finished.pop(stored_as, None)
        finished[stored_as] = None
        for gone in [i for i in finished if self._live(i) is None]:  # expired meanwhile
            del finished[gone]
        while self.max_finished_per_client and len(finished) > self.max_finished_per_client:
            oldest = next(iter(finished))
            del finished[oldest]
            self._requests.pop(oldest, None)
        if not finished:
            del self._finished[client]

    async def load(self, stored_as: str) -> StoredRequest | None:
        record = self._live(stored_as)
        return copy.deepcopy(record) if record else None

    async def load_priors(self, target: str, owner: str = "") -> dict[str, list[float]]:
        return copy.deepcopy(self._priors.get((target, owner), {}))

    async def save_priors(self, target: str, priors: dict[str, list[float]], owner: str = "") -> None:
        self._priors.setdefault((target, owner), {}).update(copy.deepcopy(priors))

    async def acquire_leases(self, client: str, leases: list[str], limit: int, ttl_s: float) -> int | None:
        now = time.monotonic()
        held = {lease: expiry for lease, expiry in self._leases.get(client, {}).items() if expiry > now}
        if len(held) + len(leases) > limit:
            return len(held)
        self._leases[client] = held | dict.fromkeys(leases, now + ttl_s)
        return None

    async def renew_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        expiry = time.monotonic() + ttl_s
        for client, ids in leases.items():
            held = self._leases.get(client, {})
            held.update((lease, expiry) for lease in ids if lease in held)

    async def release_leases(self, client: str, leases: list[str]) -> None:
        held = self._leases.get(client, {})
        for lease in leases:
            held.pop(lease, None)
        if not held:
            self._leases.pop(client, None)


# The scripts run when Redis is full too (allow-oom): their sets are small and bounded (a client's
# leases, its ended requests), and the per-client limit must hold whatever the other records take.
# Takes ARGV[4:] as leases of the client whose sorted set (lease -> expiry, unix ms) is KEYS[1], unless
# that would take it past ARGV[2]; ARGV[1] is now and ARGV[3] the new leases' expiry (unix ms).
# Returns -1 when taken, else the leases it holds.
_ACQUIRE_LEASES = """#!lua flags=allow-oom
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 3 > tonumber(ARGV[2]) then return held end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i]) end
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return -1
"""
# Gives the leases ARGV[2:] of the client whose sorted set is KEYS[1] the expiry ARGV[1] (unix ms),
# those it still holds only.
_RENEW_LEASES = """#!lua flags=allow-oom
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i]) end
redis.call('PEXPIREAT', KEYS[1], ARGV[1])
return 0
"""
# A request's header (as HGETALL's flat list), tokens and logprobs, read at once; on a full Redis too
# (a transaction is refused there: its queue would take memory).
_LOAD = """#!lua flags=no-writes
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"""
# Adds ARGV[3] to the client's ended requests (sorted set KEYS[1]: store id -> when it ended, unix
# ms; ARGV[1] is now), forgets those ended more than ARGV[2] ms ago (expired), and returns the
# oldest beyond the ARGV[4] most recent (their records are the caller's to delete).
_RETIRE = """#!lua flags=allow-oom
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1] - ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[4])
if tonumber(ARGV[4]) == 0 or over <= 0 then return {} end
local oldest = redis.call('ZRANGE', KEYS[1], 0, over - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
return oldest
"""


def _without_password(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


# The store operations: the `operation` label of specdec_session_store_errors_total.
Operation = Literal[
    "create",
    "put",
    "append",
    "retire",
    "load",
    "load_priors",
    "save_priors",
    "acquire_leases",
    "renew_leases",
    "release_leases",
]


class RedisStore(RequestStore):
    """The store in Redis at ``url`` (``redis://host:port/db``, ``rediss://`` for TLS, a password
    as ``rediss://:PASSWORD@host:port/db``) or, with ``cluster``, in the Redis Cluster whose node
    ``url`` names (:func:`coordinator.request_store.redis_client.connect`), shared by every
    coordinator replica. ``errors``: a prometheus_client Counter with an ``operation`` label.
    ``ssl_options``: redis-py's ``ssl_*`` connection arguments (``ssl_ca_certs``, ``ssl_certfile``,
    ``ssl_keyfile``: PEM file paths), only for a rediss:// URL; empty ones are left out (redis-py's
    defaults: the system's roots, no client certificate). On a cluster, a failure of one slot's
    master (until its replica is promoted) makes the whole store unavailable for ``retry_after_s``
    seconds, as a single Redis's failure does."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        errors,
        timeout_s: float = 1.0,
        retry_after_s: float = 1.0,
        max_finished_per_client: int = 0,
        cluster: bool = False,
        **ssl_options: str,
    ):
        super().__init__(ttl_s, max_finished_per_client)
        self.redis = connect(url, timeout_s, cluster, **ssl_options)
        self.url = _without_password(url)  # logged and in error messages
        self._acquire_leases = self.redis.register_script(_ACQUIRE_LEASES)
        self._retire = self.redis.register_script(_RETIRE)
        self._appends = AppendBatcher(self.redis)
        self._load = self.redis.register_script(_LOAD)
        self.errors, self.timeout_s, self.retry_after_s = errors, timeout_s, retry_after_s
        self._down_until = 0.0
        self._full_logged = 0.0  # when a refusal for being full was last logged (time.monotonic())
        # every operation's series exported at 0 from the start: a panel shows "no errors" rather
        # than nothing, and rate() sees the first error (a series born at 1 has no increase)
        for operation in get_args(Operation):
            errors.labels(operation)

    async def _run(self, operation: Operation, make_call):
        """Awaits ``make_call()``; a Redis failure becomes StoreUnavailable (logged, counted)."""
        if time.monotonic() < self._down_until:
            self.errors.labels(operation).inc()
            raise StoreUnavailable(f"the request store at {self.url} failed less than {self.retry_after_s:g} s ago")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await make_call()
        except OutOfMemoryError:  # full, not down: asked again at once
            self.errors.labels(operation).inc()
            if time.monotonic() >= self._full_logged + self.retry_after_s:
                self._full_logged = time.monotonic()
                log.error(
                    "request store at %s is full (Redis maxmemory) on %s: new requests are refused", self.url, operation
                )
            raise StoreFull(
                f"the request store at {self.url} is full (its Redis maxmemory, policy noeviction): retry later; the "
                "operator sizes Redis's maxmemory by docs/scaling.md#the-request-stores-memory, or lowers "
                "--max-finished-requests-per-client, --max-stored-request-bytes or --request-ttl-s"
            ) from None
        except FAILURES as err:
            if time.monotonic() >= self._down_until:
                log.error(
                    "request store at %s failed on %s: %s: %s; requests go on from memory",
                    self.url,
                    operation,
                    type(err).__name__,
                    err,
                )
            self._down_until = time.monotonic() + self.retry_after_s
            self.errors.labels(operation).inc()
            raise StoreUnavailable(f"the request store at {self.url} failed: {err!r}") from None

    @staticmethod
    def _keys(stored_as: str) -> tuple[str, str, str]:
        header = f"specdec:request:{{{stored_as}}}"
        return header, f"{header}:tokens", f"{header}:logprobs"

    async def create(self, record: StoredRequest) -> bool:
        header, _, _ = self._keys(record.store_id)

        mine = record.claim.encode()  # a claim found with it is this record's own, its answer lost

        async def claim():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hsetnx(header, "claim", mine)
                pipe.hget(header, "claim")
                pipe.expire(header, int(self.ttl_s))
                return await pipe.execute()

        _, holder, _ = await self._run("create", claim)
        if holder != mine:
            return False
        await self.put(record)
        return True

    async def put(self, record: StoredRequest) -> None:
        header, tokens, logprobs = self._keys(record.store_id)

        async def call():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(header)
                pipe.hset(header, mapping=record.header())
                pipe.set(tokens, np.asarray(record.generated, dtype=TOKEN_DTYPE).tobytes())
                if record.logprobs:
                    pipe.set(logprobs, logprobs_bytes(record.logprobs))
                else:
                    pipe.delete(logprobs)
                for key in (header, tokens, logprobs):
                    pipe.expire(key, int(self.ttl_s))
                await pipe.execute()

        await self._run("put", call)

    async def append(
        self,
        stored_as: str,
        tokens: list[int],
        sessions: dict[str, str] | None = None,
        logprobs: list[common_pb2.TokenLogprobs] | None = None,
        *,
        stored: int,
        keep_alive: bool = True,
    ) -> int:
        """Sent with the other requests' appends of this turn of the event loop, in one pipeline
        (:mod:`coordinator.request_store.redis_appends`)."""
        append = Append(
            self._keys(stored_as),
            np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes(),
            "" if sessions is None else json.dumps(sessions),
            logprobs_bytes(logprobs) if logprobs else b"",
            int(self.ttl_s) if keep_alive else 0,
            stored * TOKEN_DTYPE.itemsize,
        )
        length = await self._run("append", lambda: self._appends.submit(append))
        held = length // TOKEN_DTYPE.itemsize
        return held if held == stored + len(tokens) else 0

    async def retire(self, client: str, stored_as: str) -> None:
        now_ms, ttl_ms = int(time.time() * 1000), int(self.ttl_s * 1000)
        args: list[EncodableT] = [now_ms, ttl_ms, stored_as, self.max_finished_per_client]
        key = f"specdec:finished:{{{client}}}"
        oldest = await self._run("retire", lambda: self._retire(keys=[key], args=args))
        if oldest:  # one DEL per record: their keys are in other cluster slots

            async def drop():
                async with self.redis.pipeline(transaction=False) as pipe:
                    for gone in oldest:
                        pipe.delete(*self._keys(gone.decode()))
                    await pipe.execute()

            await self._run("retire", drop)

    async def load(self, stored_as: str) -> StoredRequest | None:
        flat, token_bytes, stored_logprobs = await self._run(
            "load", lambda: self._load(keys=self._keys(stored_as), args=[])
        )
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        if not fields.get(b"request"):
            return None
        return StoredRequest.from_redis(stored_as, fields, token_bytes, stored_logprobs)

    @staticmethod
    def _priors_key(target: str, owner: str) -> str:
        return f"specdec:acceptance-of:{owner}:{target}" if owner else f"specdec:acceptance:{target}"

    async def load_priors(self, target: str, owner: str = "") -> dict[str, list[float]]:
        fields = await self._run("load_priors", lambda: self.redis.hgetall(self._priors_key(target, owner)))
        return {key.decode(): json.loads(value) for key, value in fields.items()}

    async def save_priors(self, target: str, priors: dict[str, list[float]], owner: str = "") -> None:
        mapping: dict[FieldT, EncodableT] = {source: json.dumps(rates) for source, rates in priors.items()}
        await self._run("save_priors", lambda: self.redis.hset(self._priors_key(target, owner), mapping=mapping))

    @staticmethod
    def _leases_key(client: str) -> str:
        return f"specdec:running:{{{client}}}"

    async def acquire_leases(self, client: str, leases: list[str], limit: int, ttl_s: float) -> int | None:
        now_ms = int(time.time() * 1000)
        args: list[str | int] = [now_ms, limit, now_ms + int(ttl_s * 1000), *leases]
        held = await self._run(
            "acquire_leases", lambda: self._acquire_leases(keys=[self._leases_key(client)], args=args)
        )
        return None if held < 0 else int(held)

    async def renew_leases(self, leases: dict[str, list[str]], ttl_s: float) -> None:
        expiry_ms = int((time.time() + ttl_s) * 1000)

        async def call():
            # EVAL with the script's text (200 bytes a client), not a registered script's EVALSHA:
            # a cluster pipeline sends EVALSHA without loading the script, and a node that never ran
            # it (a replica promoted since, a node restarted) fails it with NOSCRIPT
            async with self.redis.pipeline(transaction=False) as pipe:
                for client, ids in leases.items():
                    pipe.eval(_RENEW_LEASES, 1, self._leases_key(client), expiry_ms, *ids)
                await pipe.execute()

        await self._run("renew_leases", call)

    async def release_leases(self, client: str, leases: list[str]) -> None:
        await self._run("release_leases", lambda: self.redis.zrem(self._leases_key(client), *leases))

    async def close(self) -> None:
        await self.redis.aclose()

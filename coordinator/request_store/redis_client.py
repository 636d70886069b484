"""The request store's connection: a client of one Redis, or of a Redis Cluster, built from one URL
and used through the same redis-py calls (commands, registered Lua scripts, pipelines, and
transactions over the keys of one cluster slot, which redis-py's cluster client runs on the slot's
master).

A cluster client learns every node and the slots each serves from a seed node (``CLUSTER SLOTS``),
sends each key's command to its slot's master, and learns the topology again when a node fails or
answers MOVED: a replica promoted after a master's failure is followed at the next call after the
promotion (at most one topology refresh a second, redis-py's default). A seed given by its IP
address is one node: the nodes it reported are the seeds from then on. A seed given by a DNS name
(a Kubernetes headless Service: every ready node) stays the seed, its name resolved again at each
new connection to it, so a cluster whose nodes all came back under new addresses is found again.
"""

from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from coordinator.speculation.discovery import is_ip

RedisClient = redis.Redis | RedisCluster
# What a failing store raises: redis-py's errors (among them a cluster's CLUSTERDOWN, MOVED and
# TRYAGAIN answers, and connection errors), the cluster client's own (no node reachable, a slot
# no node serves), and the socket's.
FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


def connect(url: str, timeout_s: float, cluster: bool = False, **ssl_options: str) -> RedisClient:
    """A client of the Redis at ``url`` (``redis://host:port/db``, ``rediss://`` for TLS, a password
    as ``rediss://:PASSWORD@host:port/db``) or, with ``cluster``, of the Redis Cluster whose node
    (or a DNS name of its nodes) ``url`` names, with the same password and TLS (its database must
    be 0). Every call waits at most ``timeout_s`` seconds for a connection and for an answer, and
    is tried once more, at once, on a fresh connection (a pooled one is stale after a Redis
    restart; on a cluster, after the topology is learnt again). ``ssl_options``: redis-py's
    ``ssl_*`` connection arguments (PEM file paths), only for a rediss:// URL; empty ones are left
    out. Connects at the first call, not here. Raises ValueError for a malformed URL, and
    RedisClusterException for a cluster URL whose database is not 0."""
    options: dict[str, Any] = {name: value for name, value in ssl_options.items() if value}
    options.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
    if not cluster:
        return redis.Redis.from_url(url, **options)
    # reinitialize_steps=1: every failure of a node asks for the topology again (redis-py's default,
    # 5, let a transaction go to a dead master again after its replica was promoted)
    seed_is_address = is_ip(urlsplit(url).hostname or "")
    return RedisCluster.from_url(url, dynamic_startup_nodes=seed_is_address, reinitialize_steps=1, **options)

"""The per-client limit on running requests: those of gRPC Generate streams and HTTP completions
(streamed or not) of one client together, each choice of a call with n > 1 counted as a request.
A client is its API key when the coordinator has keys, else its IP address. One call over the
limit fails with RESOURCE_EXHAUSTED (HTTP 429) before any work starts; the calls in flight go
on."""

from collections import Counter
from collections.abc import AsyncGenerator
from typing import TypeVar

from specdec.errors import ResourceExhausted

T = TypeVar("T")


def peer_host(peer: str) -> str:
    """The IP address of a gRPC peer: ``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``, ``ipv6:[::1]:5000``
    -> ``::1``; other forms (``unix:...``) unchanged."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return address.rpartition(":")[0].strip("[]")


class StreamLimit:
    """At most ``max_per_client`` running requests per client (0: no limit); ``keyed``: the
    coordinator has API keys, so clients are told apart by key. One event loop uses it: no lock."""

    def __init__(self, max_per_client: int, keyed: bool):
        self.max_per_client, self.keyed = max_per_client, keyed
        self._running: Counter[str] = Counter()

    def client(self, authorization: str | None, host: str) -> str:
        """The client a call counts against: the API key of its (already checked) ``Bearer <key>``
        authorization when the coordinator has keys, else ``host``, its IP address."""
        if self.keyed and authorization:
            return f"key {authorization.strip().partition(' ')[2].strip()}"
        return f"host {host}"

    async def run(
        self, client: str, responses: AsyncGenerator[T, None], num_requests: int = 1
    ) -> AsyncGenerator[T, None]:
        """``responses`` counted as ``num_requests`` of ``client``'s running requests (its choices)
        until it ends or is closed (closing this closes ``responses``). Raises ResourceExhausted
        at the first step when they would take the client past ``max_per_client``."""
        try:
            if self.max_per_client and self._running[client] + num_requests > self.max_per_client:
                raise ResourceExhausted(
                    f"this client already runs {self._running[client]} requests and asks for {num_requests} more; "
                    f"the coordinator's limit per client (max_streams_per_client) is {self.max_per_client}: wait "
                    "for one to finish, ask for fewer choices (n), or raise --max-streams-per-client"
                )
            self._running[client] += num_requests
            try:
                async for response in responses:
                    yield response
            finally:
                self._running[client] -= num_requests
                if not self._running[client]:
                    del self._running[client]
        finally:
            await responses.aclose()

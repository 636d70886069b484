"""API keys of the coordinator's public APIs: ``Authorization: Bearer <key>`` on HTTP, the same
value as ``authorization`` metadata on the gRPC CoordinatorService. With no key configured both are
open. Health checks (gRPC health, HTTP ``/health``), gRPC reflection and the HTTP API's OpenAPI
document never need a key.

Who calls (:class:`Caller`) decides two things: whose requests it may see (a request belongs to the
key that started it: :mod:`coordinator.request_store.store` keeps it under the key's owner hash) and
what its running requests count against (:mod:`coordinator.api.admission`). On HTTP the key is
checked by :class:`ApiKeyMiddleware` before any of the body is read.
"""

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.rpc.errors import SpecdecError

HOW = (
    "send `Authorization: Bearer <key>` (gRPC: `authorization` metadata) with a key the "
    "coordinator was started with (--api-key)"
)
# The key of the owner hash: fixed, so every coordinator replica derives the same owner from the
# same API key without sharing another secret; the store never holds a key itself.
OWNER_HASH_KEY = b"specdec/request-owner/v1"
# HTTP paths open without a key
OPEN_PATHS = frozenset({"/health", "/openapi.json"})


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


def owner_hash(api_key: str) -> str:
    """The owner a request started with ``api_key`` is stored under: HMAC-SHA256 of the key, 128
    bits in hex."""
    return hmac.new(OWNER_HASH_KEY, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def peer_host(peer: str) -> str:
    """The IP address of a gRPC peer: ``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``, ``ipv6:[::1]:5000``
    -> ``::1``; other forms (``unix:...``) unchanged."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return address.rpartition(":")[0].strip("[]")


@dataclass(frozen=True)
class Caller:
    """Who makes a call. ``owner``: the owner hash of its API key, under which its requests are
    stored and looked up ("" when the coordinator has no keys: requests belong to nobody, and any
    caller may resume any); ``client``: what its running requests count against, its key
    (``key <owner>``) or, without keys, its IP address (``host <address>``)."""

    owner: str
    client: str


class ApiKeys:
    """The accepted keys; empty: no authentication."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [key.encode() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """The key of ``authorization`` (an Authorization header or metadata value, ``Bearer
        <key>``); None when no key is required. Raises Unauthenticated unless it is an accepted
        key."""
        if not self._keys:
            return None
        if not authorization:
            raise Unauthenticated(f"missing API key: {HOW}")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated(f"malformed authorization {scheme!r}: {HOW}")
        given = key.strip().encode()
        # every key is compared (no early exit), each in constant time
        if not any([hmac.compare_digest(given, accepted) for accepted in self._keys]):
            raise Unauthenticated(f"invalid API key: {HOW}")
        return key.strip()

    def caller(self, authorization: str | None, host: str) -> Caller:
        """The caller of a call with ``authorization`` from IP address ``host``. Raises
        Unauthenticated (see :meth:`check`)."""
        key = self.check(authorization)
        if key is None:
            return Caller("", f"host {host}")
        owner = owner_hash(key)
        return Caller(owner, f"key {owner}")


class ApiKeyMiddleware:
    """ASGI middleware: an HTTP request without an accepted key (outside :data:`OPEN_PATHS`) is
    answered ``answer(Unauthenticated)`` (an ASGI app: 401 in OpenAI's error shape) before the
    app, or anything else, reads its body."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, answer):
        self.app, self.keys, self.answer = app, keys, answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"] not in OPEN_PATHS:
            try:
                self.keys.check(Headers(scope=scope).get("authorization"))
            except Unauthenticated as err:
                return await self.answer(err)(scope, receive, send)
        await self.app(scope, receive, send)

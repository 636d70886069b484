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
import math
import string
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
# The key of the owner hash when the deployment gives no secret of its own (owner_hash_secret): a
# public constant, so that every coordinator replica derives the same owner from the same API key
# without sharing another secret; the store never holds a key itself. With it, anyone who reads
# Redis's key names can test a guessed key offline: hence keys of at least MIN_KEY_BITS.
OWNER_HASH_KEY = b"specdec/request-owner/v1"
MIN_KEY_BITS = 128  # an API key's least strength (as a 22-character base64 or 32-character hex secret)
# the character classes a key's alphabet is estimated from, with their sizes: digits, a-z, A-Z, the rest
_CLASSES = ((str.isdigit, 10), (str.islower, 26), (str.isupper, 26))
_OTHER_CHARACTERS = 33  # printable ASCII that is neither a letter nor a digit
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_=")  # base64's and base64url's characters
_BOTH_CASES = 52
# HTTP paths open without a key
OPEN_PATHS = frozenset({"/health", "/openapi.json"})


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


def owner_hash(api_key: str, secret: bytes = OWNER_HASH_KEY) -> str:
    """The owner a request started with ``api_key`` is stored under: HMAC-SHA256 of the key keyed
    with ``secret`` (the deployment's owner_hash_secret, else the public OWNER_HASH_KEY), 128 bits
    in hex."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def key_bits(api_key: str) -> float:
    """An upper bound of ``api_key``'s strength in bits: its length times log2 of the size of its
    alphabet, the character classes it uses (digits 10, a-z 26, A-Z 26, anything else 33), and at
    least base64's 64 for a key of both cases in base64's characters: a random base64 key of 22
    characters (``secrets.token_urlsafe(16)``) lacks digits, ``-`` and ``_`` about once in a
    hundred draws, and is as strong then. A key drawn at random from that alphabet has this
    strength; a chosen one has less."""
    alphabet = sum(size for is_class, size in _CLASSES if any(map(is_class, api_key)))
    if any(not any(is_class(c) for is_class, _ in _CLASSES) for c in api_key):
        alphabet += _OTHER_CHARACTERS
    if alphabet >= _BOTH_CASES and _BASE64.issuperset(api_key):
        alphabet = max(alphabet, 64)
    return len(api_key) * math.log2(alphabet) if alphabet > 1 else 0.0


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

    def __init__(self, keys: Iterable[str], owner_hash_secret: str = ""):
        self._keys = [key.encode() for key in keys]
        self._secret = owner_hash_secret.encode() or OWNER_HASH_KEY

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
        owner = owner_hash(key, self._secret)
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

"""The HTTP API's bounds on request bodies, in OpenAI's error shape naming the setting, before the
app parses them: a body over ``max_bytes`` gets 413 (:class:`BodyLimit`), a client with too many
bodies still arriving 429 (:class:`PendingBodies`), a chat of too many messages 400
(:class:`ChatMessagesLimit`). The deadline on a body's arrival is
the connection's (:class:`coordinator.api.http_api.BoundedHttpProtocol`).

Starlette (1.10) and FastAPI (0.165) have a ``max_body_size`` of their own, but answer a declared
Content-Length over it with a plain-text "Content Too Large" that replaces the app's response, so a
client can neither parse it as an OpenAI error nor learn what to change; uvicorn has no body limit.
This middleware refuses a declared Content-Length at once and counts the bytes of a chunked body
as the app reads them.
"""

import json
import re
from collections import Counter
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.request import too_many_messages


class BodyLimit:
    """ASGI middleware; a body over the limit raises HTTPException(413) in the app (its handler
    shapes the answer), or, when its Content-Length says so, is answered without calling the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, answer):
        """``answer(HTTPException)``: the response (an ASGI app) for a refused body."""
        self.app, self.max_bytes, self.answer = app, max_bytes, answer

    def _too_large(self) -> HTTPException:
        return HTTPException(
            413,
            f"the request body exceeds the coordinator's limit of {self.max_bytes} bytes "
            "(max_request_bytes): shorten the prompt, or raise --max-request-bytes",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.answer(self._too_large())(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited, send)


class PendingBodies:
    """ASGI middleware: at most ``max_per_client`` requests of one client (``client(scope)``: its
    API key's or its address's name) may have a body still arriving. A request with a body
    (Content-Length over 0, or chunked) counts from its header until the app has read the body's
    last bytes or answered; one more of the same client is answered ``answer(HTTPException(429))``
    (an ASGI app) without reading its body. A body that arrives at once counts only for the moment
    it takes to read, so this bounds what slow senders hold, not how many requests a client sends."""

    def __init__(self, app: ASGIApp, max_per_client: int, client: Callable[[Scope], str], answer):
        self.app, self.max_per_client, self.client, self.answer = app, max_per_client, client, answer
        self.pending: Counter[str] = Counter()

    @staticmethod
    def _has_body(scope: Scope) -> bool:
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        return (length.isdigit() and int(length) > 0) or "chunked" in headers.get("transfer-encoding", "").lower()

    def _too_many(self) -> HTTPException:
        return HTTPException(
            429,
            f"this client already sends {self.max_per_client} request bodies that have not arrived yet, the "
            "coordinator's limit per client (http_max_pending_bodies_per_client): send each body at once, or "
            "raise --http-max-pending-bodies-per-client",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_per_client or not self._has_body(scope):
            return await self.app(scope, receive, send)
        client = self.client(scope)
        if self.pending[client] >= self.max_per_client:
            return await self.answer(self._too_many())(scope, receive, send)
        self.pending[client] += 1
        counted = True

        def arrived() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.pending[client] -= 1
                if not self.pending[client]:
                    del self.pending[client]

        async def reading() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                arrived()
            return message

        try:
            await self.app(scope, reading, send)
        finally:
            arrived()


class ChatMessagesLimit:
    """ASGI middleware: a chat completion (``path``) whose body has more than ``max_messages``
    messages is answered ``answer(HTTPException(400))`` (an ASGI app) before the app parses it, its
    messages counted only up to one past the limit (:func:`count_items`). Decoding a body's JSON
    holds the event loop (about 0.1 s for 6.6 MB of 200,000 empty messages), so a body with more
    objects than the limit (``{`` bytes, counted first) has its ``messages`` array walked item by
    item instead; others pass untouched. Runs inside :class:`BodyLimit`: it reads the body, and a
    body over that limit is answered ``answer(HTTPException(413))``."""

    def __init__(self, app: ASGIApp, path: str, max_messages: int, answer):
        self.app, self.path, self.max_messages, self.answer = app, path, max_messages, answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        message: Message = {"more_body": True}
        try:
            while message.get("more_body", False):
                message = await receive()
                if message["type"] != "http.request":  # the client left
                    return await self.app(scope, receive, send)
                chunks.append(message.get("body", b""))
        except HTTPException as err:  # BodyLimit's
            return await self.answer(err)(scope, receive, send)
        body = b"".join(chunks)
        if body.count(b"{") > self.max_messages:
            count = count_items(body, "messages", self.max_messages)
            if count is not None and count > self.max_messages:
                message_text = too_many_messages("messages", f"more than {self.max_messages}", self.max_messages)
                return await self.answer(HTTPException(400, message_text))(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, pos: int) -> int:
    """Where JSON's whitespace from ``pos`` on ends."""
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # it matches the empty string too


def count_items(body: bytes, key: str, limit: int) -> int | None:
    """The most items of an array that the top-level JSON object of ``body`` gives under ``key``
    (every occurrence: json takes the last), counted up to ``limit`` + 1 (each item decoded on
    its own, the rest not at all); None where ``body`` is not such an object (the app's parser
    answers)."""
    try:
        text = body.decode()
        pos = _skip_space(text, 0)
        if text[pos : pos + 1] != "{":
            return None
        most, pos = 0, _skip_space(text, pos + 1)
        while text[pos : pos + 1] == '"':
            name, pos = _DECODER.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if text[pos : pos + 1] != ":":
                return None
            pos = _skip_space(text, pos + 1)
            if name == key and text[pos : pos + 1] == "[":
                count, pos = _count_array(text, pos, limit)
                most = max(most, count)
                if most > limit:
                    return most
            else:
                _, pos = _DECODER.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if text[pos : pos + 1] != ",":
                break
            pos = _skip_space(text, pos + 1)
        return most
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return None


def _count_array(text: str, pos: int, limit: int) -> tuple[int, int]:
    """The items of the array at ``text[pos]`` (``[``), up to ``limit`` + 1, and where it ends
    (where counting stopped). Raises ValueError where it is not a JSON array."""
    count, pos = 0, _skip_space(text, pos + 1)
    if text[pos : pos + 1] == "]":
        return 0, pos + 1
    while count <= limit:
        _, pos = _DECODER.raw_decode(text, pos)
        count += 1
        pos = _skip_space(text, pos)
        if text[pos : pos + 1] == "]":
            return count, pos + 1
        if text[pos : pos + 1] != ",":
            raise ValueError("not a JSON array")
        pos = _skip_space(text, pos + 1)
    return count, pos

"""The HTTP API's request body limit: a body over ``max_bytes`` gets 413 in OpenAI's error shape,
naming the setting, before the app parses it.

Starlette (1.10) and FastAPI (0.165) have a ``max_body_size`` of their own, but answer a declared
Content-Length over it with a plain-text "Content Too Large" that replaces the app's response, so a
client can neither parse it as an OpenAI error nor learn what to change; uvicorn has no body limit.
This middleware refuses a declared Content-Length at once and counts the bytes of a chunked body
as the app reads them.
"""

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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

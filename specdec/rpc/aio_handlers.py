"""What an asyncio gRPC server's interceptor needs of the method behaviour it wraps.

A response-streaming behaviour sends its responses one of two ways: it yields them (an async
generator: the servicers here, server reflection) or writes them with ``context.write`` and returns
nothing (a coroutine: grpcio-health's ``Watch``). A wrapper that expects one way breaks the other
(``async for`` over a coroutine: UNKNOWN, "'async for' requires an object with __aiter__"), so
wrappers iterate :func:`responses` of what the behaviour returned.
"""

import inspect
from collections.abc import AsyncIterator


async def responses(result) -> AsyncIterator:
    """The responses a response-streaming behaviour's call ``result`` yields: those of an async
    generator, none for a coroutine (it writes its own; awaited here)."""
    if inspect.isawaitable(result):
        await result
        return
    async for response in result:
        yield response

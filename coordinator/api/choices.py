"""A request's choices (``GenerateRequest.n``), for both public APIs: each choice is an independent
request, and their streams are merged into the request's one stream.

Choice i is the request with ``seed + i`` (choice 0 is what n = 1 gives; without a seed each
choice draws its own) and the request id ``<request_id>:<i>``, under which the request store keeps
it; a choice is resumed on its own, by that id (``resume_from`` with n > 1 is refused). Choice 0
starts first and the others once its prefill is done, so that their prefills can reuse the
prompt's KV cache where the services cache prefixes (and queue behind it where they do not):
choice 0's first token never waits for them. Their messages then interleave as they come.
"""

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

from coordinator.request_store.resume import MAX_REQUEST_ID_CHARS
from specdec.rpc.errors import InvalidArgument
from specdec.v1 import coordinator_pb2

T = TypeVar("T")


def num_choices(request: coordinator_pb2.GenerateRequest, max_n: int) -> int:
    """The request's n (default 1). Raises InvalidArgument beyond [1, ``max_n``], and for n > 1 with
    ``resume_from`` or a request id too long to take the choices' suffixes."""
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= max_n:
        raise InvalidArgument(f"n is {n}: it must lie in [1, {max_n}] (the coordinator's --max-n)")
    if n > 1 and request.HasField("resume_from"):
        raise InvalidArgument(
            f"n is {n} with resume_from: resume one choice at a time, by its own request_id "
            "(<request_id>:<index>) without n"
        )
    longest = MAX_REQUEST_ID_CHARS - len(f":{n - 1}")
    if n > 1 and len(request.request_id) > longest:
        raise InvalidArgument(
            f"request_id has {len(request.request_id)} characters: with n = {n} it may have at most {longest} "
            "(choice i is stored as <request_id>:<i>); shorten it"
        )
    return n


def choice_requests(
    request: coordinator_pb2.GenerateRequest, request_id: str, max_n: int
) -> list[coordinator_pb2.GenerateRequest]:
    """One GenerateRequest per choice, each with its own ``request_id`` (``request_id`` itself for
    n = 1) and seed, without ``n``. Raises InvalidArgument (see :func:`num_choices`)."""
    n = num_choices(request, max_n)
    if n == 1:
        single = coordinator_pb2.GenerateRequest()
        single.CopyFrom(request)
        single.request_id = request_id
        return [single]
    choices = []
    for i in range(n):
        choice = coordinator_pb2.GenerateRequest()
        choice.CopyFrom(request)
        choice.ClearField("n")
        choice.request_id = f"{request_id}:{i}"
        if request.HasField("seed"):
            choice.seed = (request.seed + i) % 2**64
        choices.append(choice)
    return choices


async def interleave(
    streams: Sequence[AsyncGenerator[T, None]], first_prefilled: asyncio.Event
) -> AsyncGenerator[T, None]:
    """The items of every stream (none of them None), as they come: ``streams[0]`` at once, the
    others once ``first_prefilled`` is set (or the first stream has ended). The first error of any
    stream is raised after the others are cancelled; closing this closes every stream."""
    queue: asyncio.Queue[tuple[T | None, Exception | None]] = asyncio.Queue(maxsize=len(streams))
    pumps: list[asyncio.Task] = []

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
            await queue.put((None, None))  # the stream ended
        except Exception as err:  # handed to the reader
            await queue.put((None, err))
        finally:
            await stream.aclose()

    async def start_the_rest() -> None:
        prefilled = asyncio.ensure_future(first_prefilled.wait())
        try:
            await asyncio.wait({prefilled, pumps[0]}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            prefilled.cancel()
        pumps.extend(asyncio.ensure_future(pump(stream)) for stream in streams[1:])

    pumps.append(asyncio.ensure_future(pump(streams[0])))
    starter = asyncio.ensure_future(start_the_rest())
    try:
        running = len(streams)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in (starter, *pumps):
            task.cancel()
        await asyncio.gather(starter, *pumps, return_exceptions=True)
        for stream in streams:  # those never started
            await stream.aclose()

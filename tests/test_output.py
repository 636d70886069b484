"""coordinator.api.output.write_each: one write in flight, the next round beside it."""

import asyncio

import pytest

from coordinator.api.output import StreamStalled, write_each
from specdec.rpc.errors import Unavailable


class Client:
    """A stream's writes, each ending when the test releases it (``release``)."""

    def __init__(self):
        self.started: list[str] = []
        self.ended: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def write(self, message: str) -> None:
        self.started.append(message)
        gate = self.gates.setdefault(message, asyncio.Event())
        await gate.wait()
        self.ended.append(message)

    def release(self, message: str) -> None:
        self.gates.setdefault(message, asyncio.Event()).set()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_next_round_runs_while_a_write_is_in_flight_and_writes_stay_in_order():
    async def scenario():
        client, rounds = Client(), []

        async def responses():
            for message in ("a", "b", "c"):
                rounds.append(message)
                yield message

        writing = asyncio.ensure_future(write_each(responses(), client.write, 5.0))
        await _settle()
        assert client.started == ["a"] and rounds == ["a", "b"]  # b's round ran beside a's write
        client.release("a")
        await _settle()
        assert client.ended == ["a"] and client.started == ["a", "b"] and rounds == ["a", "b", "c"]
        client.release("b")
        client.release("c")
        await writing
        assert client.ended == ["a", "b", "c"]

    asyncio.run(scenario())


def test_a_failing_round_raises_after_the_write_in_flight_has_ended():
    async def scenario():
        client = Client()

        async def responses():
            yield "a"
            raise Unavailable("the verify service went away")

        writing = asyncio.ensure_future(write_each(responses(), client.write, 5.0))
        await _settle()
        assert not writing.done() and client.ended == []  # the error waits for a's write
        client.release("a")
        with pytest.raises(Unavailable, match="went away"):
            await writing
        assert client.ended == ["a"]

    asyncio.run(scenario())


def test_a_write_the_client_does_not_read_is_cut_at_the_stall_timeout():
    async def scenario():
        client = Client()

        async def responses():
            yield "a"
            yield "b"

        with pytest.raises(StreamStalled, match="stream_stall_timeout_s"):
            await write_each(responses(), client.write, 0.05)
        assert client.started == ["a"]

    asyncio.run(scenario())


def test_cancelled_it_cancels_the_write_in_flight():
    async def scenario():
        client = Client()

        async def responses():
            yield "a"
            await asyncio.Event().wait()  # a round that never ends
            yield "b"

        writing = asyncio.ensure_future(write_each(responses(), client.write, 5.0))
        await _settle()
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        await _settle()
        assert client.started == ["a"] and client.ended == []

    asyncio.run(scenario())

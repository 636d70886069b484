"""The output side of one Generate stream: the generated token ids, their log-probabilities when
asked for, their text, the stop conditions, and the part of it the client has not received yet."""

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Iterable, Sequence
from typing import TypeVar

from coordinator.api.text import IncrementalDetokenizer
from specdec.rpc.errors import Unavailable
from specdec.v1 import common_pb2, coordinator_pb2

STOP, LENGTH = coordinator_pb2.FINISH_REASON_STOP, coordinator_pb2.FINISH_REASON_LENGTH
T = TypeVar("T")


class StreamStalled(Unavailable):
    """The client read nothing of its stream for the coordinator's ``stream_stall_timeout_s``."""


async def written(write: Awaitable[None], stall_timeout_s: float) -> None:
    """Awaits ``write``, the sending of a message to a client (a gRPC ``context.write``, an ASGI
    ``send``), which waits while the connection's flow-control window is full: the client reads
    nothing. Raises StreamStalled after ``stall_timeout_s`` seconds; the caller then cuts the
    stream, which cancels its request and releases its sessions."""
    try:
        async with asyncio.timeout(stall_timeout_s):  # a timer, no task per message (unlike wait_for)
            await write
    except TimeoutError:
        raise StreamStalled(
            f"the client read nothing for {stall_timeout_s:g} s (stream_stall_timeout_s): the stream was cut "
            "and its request cancelled"
        ) from None


async def read_within(responses: AsyncGenerator[T, None], max_wait_s: float) -> AsyncGenerator[T, None]:
    """``responses`` while its consumer (the API writing each message to its client, which waits
    while the client reads nothing) takes at most ``max_wait_s`` seconds in all between receiving
    a message and asking for the next; past that, StreamStalled once the message's write is done
    (each write is bounded by its own stall timeout, :func:`written`), which cancels the request
    (closing this closes ``responses``) and releases its sessions."""
    waited = 0.0
    async with contextlib.aclosing(responses):
        async for response in responses:
            handed = time.monotonic()
            yield response
            waited += time.monotonic() - handed
            if waited > max_wait_s:
                raise StreamStalled(
                    f"the client kept its stream waiting {waited:.1f} s in all, more than {max_wait_s:g} s "
                    "(max_stream_wait_s): the stream was cut and its request cancelled; read the stream as it comes"
                )


class StreamOutput:
    """Generated ids (with their log-probabilities, when the request asks for them: one per id in
    ``logprobs``) and their text, cut by the stop conditions (EOS, stop strings,
    ``max_new_tokens``). ``emit_from``: tokens the client already has (a resumed request); the
    messages carry only the tokens after them, and the text after theirs, which is exactly what
    the first stream had sent with them (the text sent with a prefix of ids depends on those ids
    alone: see :class:`coordinator.api.text.IncrementalDetokenizer`)."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        eos_ids: Iterable[int],
        max_new_tokens: int,
        emit_from: int = 0,
    ):
        self.text = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
        self.eos_ids = set(eos_ids)
        self.max_new_tokens, self.emit_from = max_new_tokens, emit_from
        self.generated: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprobs] = []
        self.finish = coordinator_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def remaining(self) -> int:
        """Tokens that may still be generated."""
        return self.max_new_tokens - len(self.generated)

    def add(self, new: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> list[int]:
        """Appends ``new`` token by token (and ``logprobs``, theirs, one per token or none) until a
        stop condition (which sets ``finish``); returns the tokens appended. EOS tokens are
        appended, not decoded."""
        kept = []
        for i, token in enumerate(new[: self.remaining]):
            kept.append(token)
            self.generated.append(token)
            if logprobs:
                self.logprobs.append(logprobs[i])
            if token in self.eos_ids or self.text.add(token):
                self.finish = STOP
            elif not self.remaining:
                self.finish = LENGTH
            if len(self.generated) == self.emit_from:
                self.text.take_delta(final=bool(self.finish))  # the client already has this text
            if self.finish:
                break
        return kept

    def response(self, kept: Sequence[int]) -> coordinator_pb2.GenerateResponse | None:
        """The message for the tokens just added: those after ``emit_from`` with their
        log-probabilities, the text not sent yet and, at the end, the finish reason; None when it
        would carry nothing."""
        unsent = len(self.generated) - self.emit_from
        visible = list(kept[max(0, len(kept) - unsent) :]) if unsent > 0 else []
        if not visible and not self.finish:
            return None
        return coordinator_pb2.GenerateResponse(
            token_ids=visible,
            text=self.text.take_delta(final=bool(self.finish)),
            finish_reason=self.finish,
            logprobs=self.logprobs[len(self.logprobs) - len(visible) :] if self.logprobs else [],
        )

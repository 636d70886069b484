"""The per-round writes of running requests to Redis, off the per-token path
(:meth:`coordinator.request_store.store.RedisStore.append`).

Every round of every running request appends its tokens to its record before the client has them.
Sent one by one, those appends cost each request an event-loop wake-up, a socket read and a
timeout task per round, and an eight-command Lua script each time, which made a coordinator's CPU
per token twice the in-process store's (docs/scaling.md). Here the appends queued in one turn of
the event loop go to Redis in one pipeline, each as the fewest plain commands that do it:

- ``APPEND`` of the token ids (int32 little-endian), and of the log-probabilities' bytes when the
  request asks for them;
- ``HSET sessions`` only when the request's sessions changed;
- ``EXPIRE`` of the request's three keys only when the caller asks to keep the record alive (the
  journal does at most every ``ttl_s / 8``, :class:`coordinator.request_store.journal.RequestJournal`).

A plain ``APPEND`` cannot check that the record exists (Redis would create a tokens key alone);
the length it returns does: the caller knows what the tokens key held, and any other length means
the store lost the record (the caller then writes it whole). Where that check cannot
tell (nothing stored yet), and for the writes a full Redis refused (its ``noeviction`` policy
refuses ``APPEND`` and ``HSET`` past ``maxmemory``), the Lua script ``_APPEND`` runs instead: it
checks the record's header and runs on a full Redis too (``allow-oom``), so a running request's
record keeps growing while new requests are refused. On a Redis Cluster a request's keys share one
slot (their hash tag), and redis-py sends each node its part of the pipeline.
"""

import asyncio
from dataclasses import dataclass, field

from redis.exceptions import OutOfMemoryError
from redis.typing import EncodableT

# Appends ARGV[2] (token ids, unless empty) and ARGV[4] (logprobs bytes, unless empty) to the request
# whose keys are KEYS[1:3] (header, tokens, logprobs), sets its sessions to ARGV[3] unless empty and,
# unless ARGV[1] is empty, gives every key ARGV[1] more seconds; nothing when its header is gone (the
# store lost it: -1). Returns the tokens' bytes. Runs on a full Redis too.
_APPEND = """#!lua flags=allow-oom
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[2] ~= '' then redis.call('APPEND', KEYS[2], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'sessions', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('APPEND', KEYS[3], ARGV[4]) end
if ARGV[1] ~= '' then for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end end
return redis.call('STRLEN', KEYS[2])
"""


@dataclass
class Append:
    """One request's append: ``keys`` (header, tokens, logprobs), the bytes to append to the
    tokens and the logprobs, its new sessions (JSON, empty when unchanged), ``ttl_s`` (whole
    seconds, 0: no keep-alive) and ``stored``, the bytes the caller knew its tokens key to hold
    before it. Its ``future`` resolves to the bytes the tokens key holds after it, or -1 when the
    record's header is gone."""

    keys: tuple[str, str, str]
    tokens: bytes
    sessions: str
    logprobs: bytes
    ttl_s: int
    stored: int
    future: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def commands(self) -> list[tuple[EncodableT, ...]]:
        """The plain commands, each a tuple of its name and arguments; the tokens' APPEND last, so
        that its reply is the item's last."""
        header, tokens, logprobs = self.keys
        commands: list[tuple[EncodableT, ...]] = []
        if self.logprobs:
            commands.append(("APPEND", logprobs, self.logprobs))
        if self.sessions:
            commands.append(("HSET", header, "sessions", self.sessions))
        if self.ttl_s:
            commands += [("EXPIRE", key, self.ttl_s) for key in self.keys]
        commands.append(("APPEND", tokens, self.tokens))
        return commands


class AppendBatcher:
    """Sends the appends submitted in one turn of the event loop in one pipeline of ``redis`` (a
    ``redis.asyncio.Redis`` or ``RedisCluster``), each as :meth:`Append.commands`, and the others
    (nothing stored before, or refused by a full Redis) through the ``allow-oom`` script."""

    def __init__(self, redis):
        self.redis = redis
        self._script = redis.register_script(_APPEND)
        self._queued: list[Append] = []
        self._sending: set[asyncio.Task] = set()  # referenced until done (the loop holds tasks weakly)

    async def submit(self, append: Append) -> int:
        """Queues ``append`` and returns the bytes the record's tokens key holds after it, or -1
        when its header is gone. Raises what redis-py raises when the pipeline fails (every append
        of the batch then fails with it)."""
        self._queued.append(append)
        if len(self._queued) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        return await append.future

    def _flush(self) -> None:
        """Runs at the end of the turn that queued the first append (``call_soon``), so the
        appends of every request resumed in that turn are in the batch."""
        batch, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[Append]) -> None:
        try:
            piped = [append for append in batch if append.stored]
            refused = await self._pipeline(piped) if piped else []
            scripted = [append for append in batch if not append.stored] + refused
            await asyncio.gather(*(self._run_script(append) for append in scripted))
        except Exception as err:
            for append in batch:
                if not append.future.done():
                    append.future.set_exception(err)

    async def _pipeline(self, appends: list[Append]) -> list[Append]:
        """Runs ``appends`` as plain commands in one pipeline, resolves those that succeeded and
        returns the others (a command refused for memory: run again through the script, with
        only what was refused)."""
        commands = [append.commands() for append in appends]
        async with self.redis.pipeline(transaction=False) as pipe:
            for own_commands in commands:
                for command in own_commands:
                    pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
        refused, at = [], 0
        for append, own_commands in zip(appends, commands, strict=True):
            own, at = replies[at : at + len(own_commands)], at + len(own_commands)
            if errors := [reply for reply in own if isinstance(reply, Exception)]:
                if not all(isinstance(error, OutOfMemoryError) for error in errors):
                    raise errors[0]
                refused.append(_only_refused(append, own_commands, own))
            elif not append.future.done():
                append.future.set_result(own[-1])
        return refused

    async def _run_script(self, append: Append) -> None:
        args: list[EncodableT] = [append.ttl_s or "", append.tokens, append.sessions, append.logprobs]
        length = await self._script(keys=append.keys, args=args)
        if not append.future.done():
            append.future.set_result(length)


def _only_refused(append: Append, commands: list[tuple[EncodableT, ...]], replies: list) -> Append:
    """``append`` less the writes that succeeded (their replies not errors): what the script must
    still do. The tokens' APPEND is the last command; when it succeeded, the script appends
    nothing more to the tokens and only reads their length."""
    done = {command[:2] for command, reply in zip(commands, replies, strict=True) if not isinstance(reply, Exception)}
    header, tokens, logprobs = append.keys
    return Append(
        append.keys,
        b"" if ("APPEND", tokens) in done else append.tokens,
        "" if ("HSET", header) in done else append.sessions,
        b"" if ("APPEND", logprobs) in done else append.logprobs,
        append.ttl_s,
        append.stored,
        append.future,
    )

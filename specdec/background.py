"""Coroutines started without being awaited, held until they finish (the event loop keeps only
weak references to tasks, so an unreferenced one may vanish mid-way)."""

import asyncio
from collections.abc import Coroutine


class BackgroundTasks:
    """The tasks :meth:`run` started and that have not finished yet."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def run(self, coroutine: Coroutine) -> asyncio.Task:
        """Starts ``coroutine`` as a task on the running loop and holds it until it is done."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self) -> None:
        """Waits for every task running now; raises the first one's exception, if any."""
        await asyncio.gather(*self._tasks)

    async def drain(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` seconds for every task, those started meanwhile too (their
        errors are left to them); True when none is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        return not self._tasks

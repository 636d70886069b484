"""Background tasks are held until they finish, and their errors surface on wait()."""

import asyncio
import gc

import pytest

from specdec.background import BackgroundTasks


def test_tasks_run_to_the_end_without_a_reference_and_are_then_dropped():
    async def main():
        tasks, done = BackgroundTasks(), []

        async def work():
            await asyncio.sleep(0.01)
            done.append(True)

        tasks.run(work())  # the returned task is not kept
        gc.collect()
        await tasks.wait()
        await asyncio.sleep(0)  # the done callback runs
        return done, len(tasks._tasks)

    assert asyncio.run(main()) == ([True], 0)


def test_wait_raises_a_tasks_exception():
    async def main():
        tasks = BackgroundTasks()

        async def fail():
            raise RuntimeError("release failed")

        tasks.run(fail())
        await tasks.wait()

    with pytest.raises(RuntimeError, match="release failed"):
        asyncio.run(main())

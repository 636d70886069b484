"""Background tasks are held until they finish, their errors surface on wait(), and drain() waits
for those started while it waits, up to its bound."""

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


def test_drain_waits_for_tasks_started_meanwhile_up_to_its_bound():
    async def main():
        tasks, done = BackgroundTasks(), []

        async def release(then=None):
            await asyncio.sleep(0.01)
            done.append(True)
            if then is not None:
                tasks.run(then)  # as a request's end starts its sessions' releases

        tasks.run(release(release()))
        drained = await tasks.drain(5.0)
        tasks.run(asyncio.sleep(10))
        return drained, done, await tasks.drain(0.05)

    assert asyncio.run(main()) == (True, [True, True], False)

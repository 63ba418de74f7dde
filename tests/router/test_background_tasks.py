"""router/background.py: what shutdown leaves behind. A timer or callback that outlives
`close()` (a fair-share sync after a wait's timer, a nudge) may still start a task: it must not
run, or it opens a connection to a store that is closed, which nobody closes again."""

from __future__ import annotations

import asyncio

from router.background import BackgroundTasks


async def test_a_task_started_after_close_never_runs() -> None:
    tasks = BackgroundTasks()
    ran: list[str] = []

    async def work(name: str) -> None:
        ran.append(name)

    await tasks.job(work("before"), "job")
    await tasks.close()
    late_job = tasks.job(work("late job"), "job")
    late_loop = tasks.loop(work("late loop"), "loop")
    await asyncio.wait({late_job, late_loop})
    assert late_job.cancelled() and late_loop.cancelled()
    assert ran == ["before"]
    assert len(tasks) == 0 and tasks.failures == 0  # released, and not counted as failures


async def test_a_timer_set_before_close_starts_nothing_after_it() -> None:
    """The shape of the leak it fixes: a `call_later` that starts a loop once it fires."""
    tasks = BackgroundTasks()
    started = asyncio.Event()
    ran = False

    async def sync() -> None:
        nonlocal ran
        ran = True

    def fire() -> None:
        tasks.loop(sync(), "fair-share-sync")
        started.set()

    asyncio.get_running_loop().call_later(0.01, fire)
    await tasks.close()
    await asyncio.wait_for(started.wait(), 1.0)
    await asyncio.sleep(0)
    assert not ran

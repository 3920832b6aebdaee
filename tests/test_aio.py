"""`wait_set`: a loop around it ends when its task is cancelled, even while the event is set all the time (on
Python 3.11 a loop around `asyncio.wait_for(event.wait(), t)` swallowed 200 cancellations of 200 so)."""

from __future__ import annotations

import asyncio

import pytest

from duplexd.aio import wait_set


async def test_a_loop_around_wait_set_ends_when_cancelled_while_its_event_is_set_all_the_time() -> None:
    async def paced(event: asyncio.Event) -> None:
        while True:
            event.clear()
            await wait_set(event, 0.01)

    async def busy(event: asyncio.Event) -> None:
        while True:
            event.set()
            await asyncio.sleep(0)

    for _ in range(50):
        event = asyncio.Event()
        setter = asyncio.create_task(busy(event))
        loop = asyncio.create_task(paced(event))
        await asyncio.sleep(0.002)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(loop, 1.0)  # (a swallowed cancellation: TimeoutError here)
        setter.cancel()


async def test_wait_set_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5.0) is True
    assert await wait_set(event, None) is True

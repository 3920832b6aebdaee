"""A wait that a cancellation always ends.

On Python 3.11, `asyncio.wait_for(event.wait(), t)` returns normally when the task is cancelled just as the
event is set (the awaited future is done, so the cancellation is dropped), and a loop around it never ends:
a connection's pacing loop, whose event is set by every audio frame, kept its handler alive after its socket
was gone (the session never detached, a resume waited for the old socket in vain, the server never stopped).
`asyncio.timeout` tells its own cancellation from another's."""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until `event` is set, at most `timeout_s` (None: no limit): True if it was."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True

"""Small asyncio helpers shared by the server's background tasks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has really stopped.

    One cancel is not always enough: on Python 3.11 a cancellation that lands inside
    ``asyncio.wait_for`` (which redis-py wraps around socket I/O) can be swallowed, and a loop
    such as the sweeper then carries on forever. So cancel again until the task is done.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()

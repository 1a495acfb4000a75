"""What several scheduler tests share (imported as ``schedutil``, beside them)."""

from __future__ import annotations

import asyncio
import time


async def wait_for(cond, timeout: float = 60.0, interval: float = 0.01) -> None:
    """Poll ``cond()`` until it holds (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(interval)

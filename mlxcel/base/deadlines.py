"""Absolute deadlines on the running loop's clock.

Library code never reads ``time.monotonic()``: every deadline is ``loop.time() + budget`` so a
virtual clock (the simulator's loop) can drive it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mlxcel.base.errors import DeadlineExceeded


def now() -> float:
    return asyncio.get_running_loop().time()


def deadline_in(seconds: float) -> float:
    """The absolute deadline ``seconds`` from now on the running loop's clock."""
    return now() + seconds


def remaining(deadline: float) -> float:
    return max(0.0, deadline - now())


@asynccontextmanager
async def until(deadline: float | None, what: str) -> AsyncIterator[None]:
    """Run the block until ``deadline``; raise :class:`DeadlineExceeded` naming ``what``."""
    if deadline is None:
        yield
        return
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: deadline passed") from None

"""The one thread that runs MLX work.

The reactor never evaluates an MLX graph: it submits a function here and awaits the result.
``mx.eval`` releases the GIL, so the reactor keeps serving sockets and timers meanwhile.
One thread (not a pool) keeps MLX's per-thread stream state and the batch caches in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "mlxcel-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.closed:
            raise RuntimeError("compute thread is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

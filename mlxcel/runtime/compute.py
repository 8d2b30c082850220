"""The one thread that runs MLX work.

The reactor never evaluates an MLX graph: it submits a function here and awaits the result.
``mx.eval`` releases the GIL, so the reactor keeps serving sockets and timers meanwhile.
One thread (not a pool) keeps MLX's per-thread stream state and the batch caches in one place.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Compute(Protocol):
    """Where a role's jobs run, one after another: the compute thread (the simulator
    supplies one on virtual time)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class ComputeThread:
    def __init__(self, name: str = "mlxcel-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.closed:
            raise RuntimeError("compute thread is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn`` now, in order with everything submitted before it; returns at once."""
        if self.closed:
            raise RuntimeError("compute thread is closed")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Release the thread's MLX streams on the thread itself, then join it.

        MLX streams are thread-local; left to the thread's own teardown, their destructors
        race interpreter shutdown and can abort the process ("terminate called without an
        active exception"). ``mx.clear_streams()`` on the owning thread is MLX's remedy.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self._pool.submit(_release_thread_streams).result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def abandon(self) -> None:
        """Stop accepting work without joining a thread that may never return.

        For a broken tensor-parallel group: the thread can be blocked inside a collective.
        The process must then leave with ``os._exit`` (the CLI does), since the interpreter
        would otherwise wait for this thread at exit.
        """
        self.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


def call_back(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """On the compute thread: run ``fn(*args)`` on the loop (not if the loop has closed).
    How a job's end reaches its adapter: a callback on the loop, not a task per job (a task,
    a wrapped future and a wake-up each)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed: nobody waits for this job any more
        pass


def _release_thread_streams() -> None:
    import mlx.core as mx

    gc.collect()  # drop arrays whose last reference was a cycle, while streams still exist
    mx.synchronize()
    if hasattr(mx, "clear_streams"):
        mx.clear_streams()

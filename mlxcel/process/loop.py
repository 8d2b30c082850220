"""Entry points only: the one place an event loop is chosen (uvloop where it is installed)
and signals are handled.

Library code runs on whatever loop it is given (the simulator and embedding services need
that); ``python -m mlxcel`` and the benchmark's echo peer start theirs here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from loguru import logger


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on uvloop when installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if sys.platform != "win32":
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


@contextmanager
def signals(on_signal: Callable[[], None]) -> Iterator[None]:
    """Call ``on_signal`` on the first SIGINT/SIGTERM while the block runs; a second one exits
    the process at once (not on Windows)."""
    if sys.platform == "win32":
        yield
        return
    loop = asyncio.get_running_loop()
    seen: list[int] = []

    def handle(sig: int) -> None:
        if not seen:
            seen.append(sig)
            on_signal()
            return
        # A second signal: the operator will not wait for the drain. Exit now, saying so.
        logger.warning(
            "{}: a second signal; exiting now without draining", signal.Signals(sig).name
        )
        logger.complete()
        os._exit(128 + sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


PARENT_ENV = "MLXCEL_PARENT_PID"


def die_with_parent() -> None:
    """A process a launcher started (``MLXCEL_PARENT_PID`` set, see
    :func:`mlxcel.runtime.blas.colocated_env`) gets SIGTERM when the launcher goes, however it
    goes: a killed benchmark or test must not leave stage processes and TP ranks behind.
    Linux only (``PR_SET_PDEATHSIG``); elsewhere the launchers' own shutdown is all there is."""
    import os

    want = os.environ.pop(PARENT_ENV, "")
    if not want.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != int(want):
        # Not started by that launcher (a stale variable), or it died in the instant before
        # the line above: better an orphan, as before, than a server killed by its shell.
        libc.prctl(pr_set_pdeathsig, 0)

"""The one place an event loop is chosen: uvloop where it is installed, for entry points only.

Library code runs on whatever loop it is given (the simulator and embedding services need
that); ``python -m mlxcel`` and the benchmark's echo peer start theirs here.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any


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

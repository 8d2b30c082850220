"""Freed memory goes back to the OS once a burst of large messages has passed.

glibc keeps memory a process has freed for its own reuse. After a flood of large messages
(members' activations, KV handoff parts, or a member's junk) every buffer is freed, yet the
process's resident memory stays near the flood's peak for as long as it runs. So once large
messages worth :data:`ENOUGH` bytes have arrived and then none for :data:`QUIET` seconds,
``malloc_trim(0)`` hands the free heap back. One process has one heap, so one trimmer
serves every connection of it. Where there is no glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

LARGE = 1 << 20  # a message this big or bigger counts towards a trim
ENOUGH = 64 << 20  # bytes of large messages after which a quiet spell trims
QUIET = 1.0  # seconds without a large message before the trim


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


class HeapTrimmer:
    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim_fn = trim if trim is not None else _malloc_trim()
        self.pending = 0  # bytes of large messages since the last trim
        self.trims = 0
        self._timer: asyncio.TimerHandle | None = None

    def received(self, n: int) -> None:
        """A message of ``n`` bytes arrived (called on the reactor)."""
        if n < LARGE or self._trim_fn is None:
            return
        self.pending += n
        if self._timer is not None:
            self._timer.cancel()  # the burst goes on: trim once it is over
        if self.pending >= ENOUGH:
            self._timer = asyncio.get_running_loop().call_later(QUIET, self.trim)

    def trim(self) -> None:
        self._timer = None
        self.pending = 0
        if self._trim_fn is not None:
            self._trim_fn(0)
            self.trims += 1


TRIMMER = HeapTrimmer()

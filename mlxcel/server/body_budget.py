"""A memory budget for request bodies being handled: parsed, templated and tokenized at once.

Each body is bounded (``--max-body-bytes``), but a body costs several times its size while
it is parsed, rendered by the chat template and counted against the context, and nothing
bounded how many were handled at once: a few hundred concurrent 4 MB bodies were gigabytes.
A request holds its body's size here from the moment the body has been read (a client that
trickles its body holds nothing) until its prompt is token ids -- tokenizing that a client's
departure cannot stop keeps holding it until it ends. One that cannot get its share within
the body deadline is refused with 503; waiters are served in arrival order, so a large body
is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mlxcel.base.errors import AdmissionRejected

BODIES_IN_FLIGHT = 8  # bodies of the maximum size handled at once (smaller ones: more)


class BodyBudget:
    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.refused = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def hold(self, size: int, wait: float) -> AsyncIterator[None]:
        """Hold ``size`` bytes (at most the whole budget) for the block; 503 after ``wait``."""
        size = max(0, min(size, self.total))
        if not self._waiters and self.used + size <= self.total:
            self.used += size
        else:
            await self._wait(size, wait)
        try:
            yield
        finally:
            self.used -= size
            self._grant()

    async def _wait(self, size: int, wait: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.used -= size  # granted as the wait ended: give it back
            else:
                fut.cancel()
                self._waiters.remove(entry)
            self._grant()
            if isinstance(exc, TimeoutError):
                self.refused += 1
                raise AdmissionRejected(
                    f"request bodies in flight hold this server's budget of "
                    f"{self.total >> 20} MiB; retry shortly"
                ) from None
            raise

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            size, fut = self._waiters.popleft()
            self.used += size
            fut.set_result(None)

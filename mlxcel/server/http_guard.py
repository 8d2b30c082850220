"""Keep the HTTP port answering when clients are slow on purpose (slow-loris), from many
addresses at once.

aiohttp bounds what a request may *contain* but not how long a client may take to *send* it:
a client trickling one header byte every few seconds holds a socket (a file descriptor)
forever, and a few thousand of them leave nothing for ``/health``. :class:`HttpGuard` wraps
each connection's protocol:

- a connection must complete a request's header block within its header deadline of
  opening, and the next one within that of the previous response (one that sent part of a
  header is aborted and logged; an idle keep-alive connection is closed politely, and its
  client reconnects); time spent inside a request -- reading its body, streaming its answer,
  flushing it to a slow reader -- is not counted here (the body has its own deadline in the
  API, the answer the request's own);
- the deadline is ``header_timeout`` while at most half the connection cap is in use, and
  shrinks towards :data:`MIN_HEADER_TIMEOUT` as the rest fills: under pressure, a slow
  sender is cut sooner;
- at most ``max_connections`` are open, at most ``max_per_source`` (a thirty-second of them,
  by default) from one IP, so that it takes dozens of addresses to reach the cap; a
  connection beyond the per-IP share is closed at once, before aiohttp sees it;
- at the cap, a newcomer from an address that holds fewer connections than the busiest one
  takes the place of the busiest address's oldest connection that is not inside a request
  (the pending-handshake pool of the cluster port does the same): whoever holds the most
  pays for a newcomer, and an address with nothing open is always let in.

Every refusal is counted and logged through a rate limiter, so a flood cannot flood the log.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from loguru import logger

from mlxcel.net.ratelimit import WarningLimiter

HEADER_TIMEOUT = 10.0  # seconds to send a complete request header block
FD_RESERVE = 256  # descriptors kept free for the cluster, models and logs
BACKLOG = 1024  # accept queue: a burst of connects is queued, not dropped for a SYN retry
SLOW_READ_WAITS = 6  # header timeouts a client may take to read an answer, then it is cut
MIN_HEADER_TIMEOUT = 1.0  # the header deadline when the connection cap is all but full
SOURCE_SHARE = 32  # one IP may hold 1/SOURCE_SHARE of the connection cap


def raise_fd_limit() -> int:
    """Raise this process's soft file-descriptor limit to its hard limit (where allowed);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections() -> int:
    """Open HTTP connections allowed: below the descriptor limit, with room to spare."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 16384
    return max(64, min(16384, soft - FD_RESERVE))


class HttpGuard:
    def __init__(
        self,
        *,
        max_connections: int | None = None,
        max_per_source: int | None = None,
        header_timeout: float = HEADER_TIMEOUT,
    ) -> None:
        self.max_connections = max_connections or default_max_connections()
        # A small share per IP: it takes dozens of addresses, not a handful, to fill the cap.
        self.max_per_source = max_per_source or max(8, self.max_connections // SOURCE_SHARE)
        self.header_timeout = header_timeout
        loop = asyncio.get_running_loop()
        self.limiter = WarningLimiter(loop.time, schedule=loop.call_later)
        self.by_source: Counter[str] = Counter()
        self.open: dict[Any, _Guarded] = {}  # transport -> its guard
        # Each source's connections, oldest first: where an eviction looks.
        self.of_source: dict[str, dict[_Guarded, None]] = {}
        self.refused = 0  # connections closed at once: a cap was reached
        self.timed_out = 0  # connections closed: no complete header in time
        self.evicted = 0  # connections closed to make room for another address's

    def header_deadline(self) -> float:
        """Seconds a connection has for its next header block, at the load it sees now."""
        load = len(self.open) / self.max_connections
        if load <= 0.5:
            return self.header_timeout
        floor = min(MIN_HEADER_TIMEOUT, self.header_timeout)
        return max(floor, self.header_timeout * 2 * (1 - load))

    def admit(self, conn: _Guarded) -> bool:
        """Whether ``conn`` may stay; at the cap, evicts for it where an address holds more."""
        source = conn.source
        if self.by_source[source] >= self.max_per_source:
            self._refuse(source, f"it holds {self.max_per_source} connections (the per-IP cap)")
            return False
        if len(self.open) >= self.max_connections and not self._evict_for(source):
            self._refuse(source, f"{self.max_connections} connections are open (the cap)")
            return False
        self.open[conn.transport] = conn
        self.by_source[source] += 1
        self.of_source.setdefault(source, {})[conn] = None
        return True

    def forget(self, conn: _Guarded) -> None:
        if self.open.pop(conn.transport, None) is None:
            return
        self.by_source[conn.source] -= 1
        if self.by_source[conn.source] <= 0:
            del self.by_source[conn.source]
        mine = self.of_source.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.of_source[conn.source]

    def _evict_for(self, source: str) -> bool:
        mine = self.by_source[source]
        victim, busiest, most = None, "", 0
        # The busiest address first; if all of its connections are inside requests, the next.
        for busiest, most in sorted(self.by_source.items(), key=lambda kv: -kv[1]):
            if most <= mine + 1:
                return False  # the newcomer's address holds as many: nobody pays for it
            victim = next((c for c in self.of_source[busiest] if not c.busy), None)
            if victim is not None:
                break
        if victim is None:
            return False  # every connection is inside a request: none is slow
        self.evicted += 1
        self.limiter.warn(
            "http-evict",
            f"http: at the cap of {self.max_connections} connections; closed the oldest "
            f"unfinished one of {busiest} (which holds {most}) for one from {source}",
        )
        victim.evict()
        return True

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to give ``create_server``: ``inner``'s, guarded."""
        return lambda: _Guarded(self, inner)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A request whose headers arrived: its connection is busy, not slow, until it ends."""
        conn = self.open.get(request.transport)
        if conn is None:
            return await handler(request)
        conn.begin()
        try:
            return await handler(request)
        finally:
            conn.end()

    def _refuse(self, source: str, why: str) -> None:
        self.refused += 1
        self.limiter.warn("http-cap", f"http: refused a connection from {source}: {why}")


class _Guarded(asyncio.Protocol):
    """One connection: counts it, bounds its header time, then hands everything to aiohttp."""

    def __init__(self, guard: HttpGuard, inner: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self._make_inner = inner
        self.inner: asyncio.Protocol | None = None
        self.transport: Any = None
        self.source = "?"
        self.busy = 0
        self.closed = False
        self.heard = False  # bytes arrived since the last request began (or the connection)
        self.read_waits = 0  # header timeouts spent waiting for it to read its last answer
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = guard.header_timeout  # the header deadline last armed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self.guard
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self.transport = transport  # (uvloop's transports are not asyncio.Transport)
        if not g.admit(self):
            self.transport = None
            transport.abort()
            return
        self._arm()
        self.inner = self._make_inner()
        self.inner.connection_made(transport)

    def begin(self) -> None:
        self.busy += 1
        self.read_waits = 0
        self._cancel()

    def end(self) -> None:
        self.busy -= 1
        if not self.busy and not self.closed:
            self.heard = False  # what arrives from now on is the next request's
            self._arm()

    def _arm(self) -> None:
        self._cancel()
        loop = asyncio.get_running_loop()
        self._deadline = self.guard.header_deadline()
        self._timer = loop.call_later(self._deadline, self._late)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self.busy or self.closed or self.transport is None:
            return
        if self.transport.get_write_buffer_size() and self.read_waits < SLOW_READ_WAITS:
            self.read_waits += 1
            self._arm()  # still writing its last answer to a slow reader: not idle (a while)
            return
        if not self.heard and not self.transport.get_write_buffer_size():
            self.transport.close()  # an idle keep-alive connection: closed politely
            return
        g = self.guard
        g.timed_out += 1
        g.limiter.warn(
            "http-slow",
            f"http: closed a connection from {self.source}: no complete request header "
            f"within {self._deadline:.3g}s"
            + (
                f" (shortened from {g.header_timeout:g}s: connections are scarce)"
                if self._deadline < g.header_timeout
                else ""
            )
            + (", nor its last answer read" if self.transport.get_write_buffer_size() else ""),
        )
        self.transport.abort()

    def evict(self) -> None:
        """Closed to make room for another address: out of the counts at once."""
        self.guard.forget(self)
        self._cancel()
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.heard = True
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel()
        if self.transport is not None:
            self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)


class GuardedSite(web.TCPSite):
    """aiohttp's TCP site, each connection behind ``guard``."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: HttpGuard) -> None:
        super().__init__(runner, host, port)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            self.guard.factory(server),
            self._host,
            self._port,
            backlog=max(self._backlog, BACKLOG),
            reuse_address=self._reuse_address,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
        logger.debug(
            "http: at most {} connections ({} per IP); {:g}s for a request header",
            self.guard.max_connections,
            self.guard.max_per_source,
            self.guard.header_timeout,
        )

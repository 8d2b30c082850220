"""Connecting side: dial, handshake, reconnect with exponential backoff.

A refused or reset connect is retried ``attempts`` times from ``base_delay`` (doubling). A busy
peer -- its pending-handshake pool full, or its authenticated connections at their cap -- is
retried the same way, and then on, at most a second apart, for as long as the caller's own
deadline allows: a flood at the peer delays a member, it does not fail it after a fixed few
seconds. Every other handshake failure (secret mismatch, identity not owned, version or suite
mismatch, forged verdict) is final at once, because retrying cannot fix it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from mlxcel.base.deadlines import until
from mlxcel.base.errors import ConnectFailed, ConnectionClosed, DeadlineExceeded, HandshakeError
from mlxcel.net.connection import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_PEER_TIMEOUT,
    DEFAULT_RECORD_SIZE,
    MemoryBudget,
    SecureConnection,
)
from mlxcel.net.handshake_io import drive
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.wire.frames import DEFAULT_MAX_MESSAGE, AeadProtection, Protection
from mlxcel.wire.handshake import HANDSHAKE_TIMEOUT, Channel, ClientHandshake, Failure, Identity

DEFAULT_KEEPALIVE = 60.0  # seconds of silence before a dialer sends a KEEPALIVE frame
MAX_DIALS = 64  # dials in progress at once; more wait for a slot (within their deadline)
BUSY_RETRY = 1.0  # seconds between dials to a busy peer once the backoff's attempts are spent


@dataclass(frozen=True)
class Backoff:
    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.max_delay, self.base_delay * (2**attempt))


class ConnectionPool:
    """One authenticated outbound connection per peer address, reconnected on demand."""

    def __init__(
        self,
        node: Node,
        secret: ClusterSecret,
        identity: Identity,
        *,
        channel: Channel = Channel.TRANSPORT,
        backoff: Backoff | None = None,
        limiter: WarningLimiter | None = None,
        bind_ip: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_message: int = DEFAULT_MAX_MESSAGE,
        record_size: int = DEFAULT_RECORD_SIZE,
        publish: bool = True,
        protection: Callable[[bytes, bytes], Protection] | None = None,
        budget: MemoryBudget | None = None,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        wall_clock: Callable[[], float] = time.time,
        keepalive: float = DEFAULT_KEEPALIVE,
        peer_timeout: float | None = DEFAULT_PEER_TIMEOUT,
        max_dials: int = MAX_DIALS,
    ) -> None:
        self.node = node
        self.secret = secret
        self.identity = identity
        self.channel = channel
        self.backoff = backoff or Backoff()
        loop = asyncio.get_running_loop()
        self.limiter = limiter or WarningLimiter(loop.time, schedule=loop.call_later)
        self.bind_ip = bind_ip
        self.handshake_timeout = handshake_timeout
        self.max_message = max_message
        self.record_size = record_size
        self.publish = publish
        self._protection = protection or (lambda send, recv: AeadProtection(send, recv))
        self.budget = budget or MemoryBudget()
        self.frame_timeout = frame_timeout
        self.peer_timeout = peer_timeout
        # Both sides keep the link heard: a third of the peer timeout without writing sends one.
        self.keepalive = keepalive if peer_timeout is None else min(keepalive, peer_timeout / 3)
        # A dial that hears nothing (SYN lost to a partition) is given up after the handshake
        # timeout, not the kernel's minutes; dials beyond ``max_dials`` wait for a slot.
        self._dials = asyncio.Semaphore(max_dials)
        self.dials_waited = 0
        self.wall_clock = wall_clock  # handshake timestamps (injectable for simulation)
        # Where to dial a peer whose identity is not directly reachable (a port forward, a
        # relay): identity "host:port" -> the address to connect to. The handshake still
        # authenticates the peer by the secret.
        self.routes: dict[str, tuple[str, int]] = {}
        self._conns: dict[tuple[str, int], SecureConnection] = {}
        self._bytes_of_closed = 0
        # Called with "host:port" when a pooled connection closes (peer died, frame failure).
        self.on_lost: list[Callable[[str], None]] = []
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.attempts_made = 0

        async def close_all() -> None:
            for c in list(self._conns.values()):
                c.close()

        node.on_close(close_all)

    @property
    def dialing(self) -> set[tuple[str, int]]:
        """The destinations whose dial lock the pool keeps now (one per dial in flight or
        connection open; a destination that refused keeps none)."""
        return set(self._locks)

    @property
    def bytes_out(self) -> int:
        """Bytes written to the pool's current connections (frames, headers and tags)."""
        return self._bytes_of_closed + sum(c.bytes_out for c in self._conns.values())

    async def get(
        self, host: str, port: int, deadline: float | None = None, attempts: int | None = None
    ) -> SecureConnection:
        """The open connection to ``host:port``, or a new one (``attempts`` dials at most:
        the backoff's by default; a probe that runs again in a second wants one)."""
        key = (host, port)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            # Another caller may be dialing this peer (a busy one: until its own deadline):
            # waiting for it is bounded by this caller's deadline, not by that one's.
            async with until(deadline, f"connect to {Identity(host, port).address}"):
                await lock.acquire()
        except DeadlineExceeded:
            if key not in self._conns and not lock.locked():
                self._locks.pop(key, None)
            raise ConnectFailed(
                f"{Identity(host, port).address}: connect deadline passed while another "
                "dial to it was under way"
            ) from None
        try:
            conn = self._conns.get(key)
            if conn is not None and not conn.closed:
                return conn
            conn = await self.connect(host, port, deadline, attempts)
            self._conns[key] = conn
            if self.publish:
                self.node.spawn(self._read(conn, key), name=f"conn:{host}:{port}")
                self.node.spawn(conn.keep_alive(self.keepalive), name=f"keepalive:{host}:{port}")
            return conn
        finally:
            lock.release()
            # No entry outlives its connection: destinations named by peers cannot pile up.
            if key not in self._conns and not lock.locked():
                self._locks.pop(key, None)

    def ready(self, host: str, port: int) -> SecureConnection | None:
        """The open connection to ``host:port``, if there is one and nobody is dialing it."""
        conn = self._conns.get((host, port))
        if conn is None or conn.closed:
            return None
        lock = self._locks.get((host, port))
        return None if lock is not None and lock.locked() else conn

    def drop(self, host: str, port: int) -> None:
        """Close the pooled connection to ``host:port`` (the next ``get`` dials again)."""
        conn = self._conns.pop((host, port), None)
        if conn is not None:
            self._bytes_of_closed += conn.bytes_out
            conn.close()
        lock = self._locks.get((host, port))
        if lock is not None and not lock.locked():
            del self._locks[(host, port)]

    async def _read(self, conn: SecureConnection, key: tuple[str, int]) -> None:
        try:
            await conn.run(self.node)
        finally:
            if self._conns.get(key) is conn:  # not dropped on purpose: the peer is lost
                del self._conns[key]
                self._bytes_of_closed += conn.bytes_out
                lock = self._locks.get(key)
                if lock is not None and not lock.locked():
                    del self._locks[key]
                for cb in list(self.on_lost):
                    cb(Identity(conn.peer.host, conn.peer.port).address)

    async def connect(
        self, host: str, port: int, deadline: float | None = None, attempts: int | None = None
    ) -> SecureConnection:
        """Dial and authenticate, retrying refusals with backoff, and a busy peer until
        ``deadline`` (unless ``attempts`` is given: then that many dials at most)."""
        target = Identity(host, port).address
        last: Exception | None = None
        bounded = attempts is not None
        attempts = attempts or self.backoff.attempts
        attempt = 0
        while True:
            self.attempts_made += 1
            try:
                async with until(deadline, f"connect to {target}"):
                    if self._dials.locked():
                        self.dials_waited += 1
                    async with self._dials:
                        return await self._connect_once(host, port)
            except HandshakeError as exc:
                if not exc.failure.retryable:
                    self.limiter.warn(
                        exc.failure.rate_class, f"cluster: connection to {target} refused: {exc}"
                    )
                    raise ConnectFailed(f"{target}: {exc}", exc.failure) from None
                what = (
                    "its pending-handshake pool is full"
                    if exc.failure is Failure.BUSY
                    else "it holds its maximum of authenticated connections"
                )
                self.limiter.warn(
                    "at-capacity",
                    f"cluster: {target} is busy ({what}); retrying (attempt {attempt + 1})",
                )
                last = exc
            except DeadlineExceeded:
                why = f"connect deadline passed (last attempt: {last})" if last else ""
                raise ConnectFailed(f"{target}: {why or 'connect deadline passed'}") from None
            except OSError as exc:
                logger.debug("cluster: connect to {} failed: {}", target, exc)
                last = exc
            attempt += 1
            busy = isinstance(last, HandshakeError)
            if attempt >= attempts and not (busy and deadline is not None and not bounded):
                break
            delay = self.backoff.delay(attempt - 1)
            if attempt >= attempts:
                delay = min(delay, BUSY_RETRY)
            if deadline is not None and asyncio.get_running_loop().time() + delay >= deadline:
                break
            await asyncio.sleep(delay)
        failure = last.failure if isinstance(last, HandshakeError) else None
        raise ConnectFailed(f"{target}: gave up after {attempt} attempts: {last}", failure)

    async def _connect_once(self, host: str, port: int) -> SecureConnection:
        loop = asyncio.get_running_loop()
        local = (self.bind_ip, 0) if self.bind_ip else None
        dial_host, dial_port = self.routes.get(Identity(host, port).address, (host, port))
        try:
            async with asyncio.timeout(self.handshake_timeout):
                reader, writer = await asyncio.open_connection(
                    dial_host, dial_port, local_addr=local, limit=1 << 20
                )
        except TimeoutError:
            raise OSError(f"no answer within {self.handshake_timeout:g}s") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hs = ClientHandshake(
            self.secret.value,
            self.identity,
            self.channel,
            loop.time(),
            os.urandom,
            wall=self.wall_clock(),
            timeout=self.handshake_timeout,
        )
        try:
            est = await drive(hs, reader, writer)
        except BaseException:
            writer.transport.abort()
            raise
        protection = self._protection(est.send_key, est.recv_key)
        peer = Identity(host, port, est.peer.node_id)
        conn = SecureConnection(
            reader,
            writer,
            protection,
            peer,
            self.limiter,
            max_message=self.max_message,
            record_size=self.record_size,
            outbound=True,
            budget=self.budget,
            frame_timeout=self.frame_timeout,
            peer_timeout=self.peer_timeout,
        )
        try:
            await conn.confirm()  # the listener counts us as authenticated only after this
        except (ConnectionError, OSError, ConnectionClosed) as exc:
            conn.close()
            raise OSError(f"connection lost while confirming the handshake: {exc}") from None
        return conn

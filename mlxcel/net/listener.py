"""Accepting side of the cluster transport: pending pool, handshake, connection cap.

Unfinished handshakes draw from a pending pool (``max_pending`` in flight, at most
``max_pending_per_source`` per source -- an IPv4 address or an IPv6 /64); a socket beyond
either bound is closed at accept. A connection stays *pending* -- holding its pending slot,
not an authenticated one -- until the peer's CONFIRM frame opens under the session keys, all
within one absolute handshake deadline; a replayed message 1 (refused by the replay guard) or
a peer that cannot confirm never counts as authenticated. Authenticated connections are
capped at ``max_connections`` (pending confirmations included); a peer that authenticates
beyond it gets the authenticated at-capacity verdict. Both ends of an authenticated connection
send a KEEPALIVE after a third of ``peer_timeout`` without writing, and close it when the other
has not been heard for ``peer_timeout`` (a partition or a stopped process sends no reset); with
no ``peer_timeout``, a peer silent for ``idle_timeout`` is closed. Either way its peer
reconnects when it next needs to.
Every accepted connection's messages reach the node's bus with the peer's bound identity.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from mlxcel.bus import Node
from mlxcel.errors import DeadlineExceeded, ListenError
from mlxcel.net.connection import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_PEER_TIMEOUT,
    DEFAULT_RECORD_SIZE,
    ConnectionClosed,
    MemoryBudget,
    SecureConnection,
)
from mlxcel.net.handshake_io import drive
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.net.secret import ClusterSecret
from mlxcel.wire.frames import DEFAULT_MAX_MESSAGE, AeadProtection, FrameError, Protection
from mlxcel.wire.handshake import (
    HANDSHAKE_TIMEOUT,
    MAX_CLOCK_SKEW,
    Channel,
    Failure,
    HandshakeError,
    Identity,
    ReplayGuard,
    ServerHandshake,
    Verdict,
    busy_preamble,
    source_key,
)

DEFAULT_IDLE_TIMEOUT = 600.0  # seconds an authenticated peer may stay silent


@dataclass(frozen=True)
class Limits:
    max_connections: int = 512
    max_pending: int = 64
    max_pending_per_source: int = 8
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    max_message: int = DEFAULT_MAX_MESSAGE
    record_size: int = DEFAULT_RECORD_SIZE
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT
    # A peer heard from not at all for this long is gone (both sides send keepalives at a
    # third of it); None: only ``idle_timeout`` applies and this side sends no keepalives.
    peer_timeout: float | None = DEFAULT_PEER_TIMEOUT
    max_clock_skew: float = MAX_CLOCK_SKEW
    bus_deadline: float = 30.0  # how long a received message may wait for a full handler queue


class ClusterListener:
    def __init__(
        self,
        node: Node,
        secret: ClusterSecret,
        host: str,
        port: int = 0,
        *,
        node_id: str = "",
        channel: Channel = Channel.TRANSPORT,
        limits: Limits | None = None,
        limiter: WarningLimiter | None = None,
        on_connection: Callable[[SecureConnection], None] | None = None,
        publish: bool = True,
        protection: Callable[[bytes, bytes], Protection] | None = None,
        budget: MemoryBudget | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.secret = secret
        self.host = host
        self.port = port
        self.node_id = node_id
        self.channel = channel
        self.limits = limits or Limits()
        loop = asyncio.get_running_loop()
        self.limiter = limiter or WarningLimiter(loop.time)
        self.on_connection = on_connection
        self.publish = publish
        self._protection = protection or (lambda send, recv: AeadProtection(send, recv))
        self.budget = budget or MemoryBudget()
        self.wall_clock = wall_clock  # handshake timestamps (injectable for simulation)
        self.replay = ReplayGuard(self.limits.max_clock_skew, hold=self.limits.handshake_timeout)
        # Called with the peer's identity when an authenticated connection from it closes.
        self.on_lost: list[Callable[[str], None]] = []
        self.confirming = 0
        self.connections: set[SecureConnection] = set()
        self._by_source: dict[str, SecureConnection] = {}
        self.pending = 0
        self.pending_by_source: Counter[str] = Counter()
        self.failures: Counter[Failure] = Counter()
        self.refused_at_accept = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.StreamReaderProtocol:
            reader = asyncio.StreamReader(limit=1 << 20)
            return asyncio.StreamReaderProtocol(reader, lambda r, w: self._accepted(r, w))

        try:
            self._server = await loop.create_server(factory, self.host, self.port)
        except OSError as exc:
            raise ListenError(
                f"cannot listen for cluster connections on {self.address}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

        async def stop() -> None:
            await self.close()

        self.node.on_close(stop)
        logger.info(
            "cluster listener on {}:{} (channel {})",
            self.host,
            self.port,
            self.channel.name.lower(),
        )
        return self.port

    @property
    def address(self) -> str:
        return Identity(self.host, self.port).address

    def connection_for(self, source: str) -> SecureConnection | None:
        """The live connection whose authenticated identity is ``source`` (replies go there)."""
        conn = self._by_source.get(source)
        return conn if conn is not None and not conn.closed else None

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        ip = peer[0] if peer else "?"
        key = source_key(ip) if peer else "?"
        if (
            self.pending >= self.limits.max_pending
            or self.pending_by_source[key] >= self.limits.max_pending_per_source
        ):
            self.refused_at_accept += 1
            self.limiter.warn(
                "noise", f"cluster: pending-handshake pool full, closing connection from {ip}"
            )
            # Say so before closing: a member then retries with backoff instead of taking the
            # close for a secret mismatch (final, and the wrong diagnosis).
            writer.write(busy_preamble(self.channel))
            writer.close()
            return
        self.pending += 1
        self.pending_by_source[key] += 1
        self.node.spawn(self._handshake(reader, writer, ip, key), name=f"handshake:{ip}")

    def _admit(self, ident: Identity) -> Verdict:
        if len(self.connections) + self.confirming >= self.limits.max_connections:
            return Verdict.AT_CAPACITY
        return Verdict.ACCEPT

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, key: str
    ) -> None:
        loop = asyncio.get_running_loop()
        hs = ServerHandshake(
            self.secret.value,
            self.channel,
            ip,
            loop.time(),
            os.urandom,
            self._admit,
            wall=self.wall_clock(),
            replay=self.replay,
            node_id=self.node_id,
            timeout=self.limits.handshake_timeout,
        )
        conn: SecureConnection | None = None
        try:
            try:
                est = await drive(hs, reader, writer)
            except HandshakeError as exc:
                self.failures[exc.failure] += 1
                self._report(exc, ip)
                writer.transport.abort() if not hs.close_after_send else writer.close()
                return
            conn = SecureConnection(
                reader,
                writer,
                self._protection(est.send_key, est.recv_key),
                est.peer,
                self.limiter,
                max_message=self.limits.max_message,
                record_size=self.limits.record_size,
                budget=self.budget,
                frame_timeout=self.limits.frame_timeout,
                idle_timeout=self.limits.idle_timeout,
                peer_timeout=self.limits.peer_timeout,
            )
            # Authenticated only once the peer proves it holds the session keys.
            self.confirming += 1
            try:
                await conn.expect_confirm(hs.deadline)
            except (FrameError, ConnectionClosed, DeadlineExceeded) as exc:
                self.failures[Failure.UNCONFIRMED] += 1
                self.limiter.warn(
                    Failure.UNCONFIRMED.rate_class,
                    f"cluster: {ip} (claims {est.peer.address}) completed the handshake but "
                    f"did not confirm it: {exc}",
                )
                conn.close()
                return
            finally:
                self.confirming -= 1
        finally:
            self.pending -= 1
            self.pending_by_source[key] -= 1
            if self.pending_by_source[key] <= 0:
                del self.pending_by_source[key]
        self.connections.add(conn)
        self._by_source[conn.source] = conn
        logger.debug("cluster: accepted {} (node {!r})", est.peer.address, est.peer.node_id)
        try:
            if self.limits.peer_timeout is not None:
                self.node.spawn(
                    conn.keep_alive(self.limits.peer_timeout / 3), name=f"keepalive:{conn.source}"
                )
            if self.on_connection is not None:
                self.on_connection(conn)
            if self.publish:
                await conn.run(self.node, self.limits.bus_deadline)
            else:
                await conn.done
        finally:
            self.connections.discard(conn)
            if self._by_source.get(conn.source) is conn:
                del self._by_source[conn.source]
            if self.connection_for(conn.source) is None:  # not replaced by a newer one
                for cb in list(self.on_lost):
                    cb(conn.source)
            await conn.wait_closed()

    def _report(self, exc: HandshakeError, ip: str) -> None:
        f = exc.failure
        if f is Failure.PROBE:
            self.limiter.debug(f"cluster: {ip} connected and closed before the handshake (probe)")
        elif f is Failure.AT_CAPACITY:
            self.limiter.warn(
                "at-capacity",
                f"cluster: max connections ({self.limits.max_connections}) reached; refused {ip}",
            )
        else:
            self.limiter.warn(f.rate_class, f"cluster: handshake from {ip} failed: {exc}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections):
            conn.close()

"""Accepting side of the cluster transport: pending pools, handshake, connection cap.

Unfinished handshakes hold a *pending* slot, each until the peer's CONFIRM opens under the
session keys or the one absolute handshake deadline passes. Slots come from two pools of
``max_pending``, at most ``max_pending_per_source`` per source:

- *members* -- the configured member IPs, and every IP that completed an authenticated
  handshake here before (the newest 1,024), each counted by its exact IP: outsiders cannot
  take these slots, so a flood from addresses that are not members never delays a member's
  dial (when this pool is full, a member tries the other);
- *everyone else*, a source being an IPv4 address or an IPv6 /64. When it is full, a source
  holding no slot takes the oldest slot of the source holding the most (when that is two or
  more): a few flooding addresses cannot keep a new source -- a member this node was not
  told of -- out. Only an outsider with as many addresses as the pool has slots can fill it.

A socket beyond these bounds is closed at accept, after a preamble that says "busy" (a
member retries). A replayed message 1 (refused by the replay guard) or a peer that cannot
confirm never counts as authenticated. Authenticated connections are capped at
``max_connections`` (pending confirmations included); a peer that authenticates beyond it gets
the authenticated at-capacity verdict. Both ends of an authenticated connection send a
KEEPALIVE after a third of ``peer_timeout`` without writing, and close it when the other has
not been heard for ``peer_timeout`` (a partition or a stopped process sends no reset); with no
``peer_timeout``, a peer silent for ``idle_timeout`` is closed. Either way its peer reconnects
when it next needs to. Every accepted connection's messages reach the node's bus with the
peer's bound identity.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loguru import logger

from mlxcel.base.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    FrameError,
    HandshakeError,
    ListenError,
)
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
from mlxcel.wire.handshake import (
    HANDSHAKE_TIMEOUT,
    MAX_CLOCK_SKEW,
    Channel,
    Failure,
    Identity,
    ReplayGuard,
    ServerHandshake,
    Verdict,
    busy_preamble,
    source_key,
)

DEFAULT_IDLE_TIMEOUT = 600.0  # seconds an authenticated peer may stay silent
MAX_PROVEN = 1024  # IPs remembered as having authenticated here (the members' pool)


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


@dataclass(eq=False)
class _Pending:
    """One socket holding a pending slot (released exactly once)."""

    key: str
    writer: asyncio.StreamWriter
    member: bool
    released: bool = False


def exact_ip(text: str) -> str:
    """One spelling per address (IPv6 compressed, an IPv4-mapped one as IPv4)."""
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def member_ips(addresses: Iterable[str]) -> set[str]:
    """The IPs of member addresses ("IP:port", "[IPv6]:port" or an IP); unspecified and
    unparsable ones name no member and are skipped."""
    ips: set[str] = set()
    for a in addresses:
        host = a.rpartition(":")[0] if a.count(":") == 1 or a.startswith("[") else a
        host = host.strip("[]") or a
        try:
            if ipaddress.ip_address(host).is_unspecified:
                continue
        except ValueError:
            continue
        ips.add(exact_ip(host))
    return ips


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
        members: Iterable[str] = (),
    ) -> None:
        self.node = node
        self.secret = secret
        self.host = host
        self.port = port
        self.node_id = node_id
        self.channel = channel
        self.limits = limits or Limits()
        loop = asyncio.get_running_loop()
        self.limiter = limiter or WarningLimiter(loop.time, schedule=loop.call_later)
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
        self.members = member_ips(members)
        self._proven: OrderedDict[str, None] = OrderedDict()  # IPs that authenticated here
        self.pending = 0  # slots held, both pools
        self.member_pending = 0
        self.pending_by_source: Counter[str] = Counter()
        self._slots: dict[str, list[_Pending]] = {}  # source -> its slots, oldest first
        self.failures: Counter[Failure] = Counter()
        self.refused_at_accept = 0
        self.evicted = 0  # outsiders' slots given to a source that held none
        self._server: asyncio.Server | None = None

    @property
    def slot_sources(self) -> list[str]:
        """The sources the listener keeps pending-handshake slots for now (a source whose
        last slot ended has no entry)."""
        return list(self._slots)

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

    def is_member(self, ip: str) -> bool:
        return ip in self.members or ip in self._proven

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        ip = exact_ip(peer[0]) if peer else "?"
        member = self.is_member(ip)
        # A member's slots are its own IP's: an outsider in its IPv6 /64 (or behind its NAT
        # on another address) cannot use them up. An outsider's are its source's.
        key = f"member:{ip}" if member else (source_key(ip) if peer else "?")
        if member and self.member_pending >= self.limits.max_pending:
            member, key = False, source_key(ip)  # a full members' pool: try everyone else's
        why = self._no_slot(key, member)
        if why is not None:
            self.refused_at_accept += 1
            self.limiter.warn("noise", f"cluster: {why}, closing connection from {ip}")
            # Say so before closing: a member then retries with backoff instead of taking the
            # close for a secret mismatch (final, and the wrong diagnosis).
            writer.write(busy_preamble(self.channel))
            writer.close()
            return
        slot = _Pending(key, writer, member)
        self._slots.setdefault(key, []).append(slot)
        self.pending += 1
        self.member_pending += member
        self.pending_by_source[key] += 1
        self.node.spawn(self._handshake(reader, writer, ip, slot), name=f"handshake:{ip}")

    def _no_slot(self, key: str, member: bool) -> str | None:
        """Why a socket from ``key`` gets no pending slot (None: it gets one, perhaps by
        taking an outsider's)."""
        lim = self.limits
        if self.pending_by_source[key] >= lim.max_pending_per_source:
            return f"{lim.max_pending_per_source} unfinished handshakes from this source"
        if member or self.pending - self.member_pending < lim.max_pending:
            return None
        # The pool is full: a source holding nothing takes the oldest slot of the largest
        # holder, so that a few flooding addresses cannot keep every newcomer out.
        outsiders = [k for k, slots in self._slots.items() if not slots[0].member]
        biggest = max(outsiders, key=lambda k: len(self._slots[k]), default=None)
        if self.pending_by_source[key] == 0 and biggest and len(self._slots[biggest]) >= 2:
            victim = self._slots[biggest][0]
            self._release(victim)
            victim.writer.transport.abort()
            self.evicted += 1
            return None
        return "pending-handshake pool full"

    def _release(self, slot: _Pending) -> None:
        if slot.released:
            return
        slot.released = True
        self.pending -= 1
        self.member_pending -= slot.member
        self.pending_by_source[slot.key] -= 1
        if self.pending_by_source[slot.key] <= 0:
            del self.pending_by_source[slot.key]
        slots = self._slots.get(slot.key, [])
        if slot in slots:
            slots.remove(slot)
        if not slots:
            self._slots.pop(slot.key, None)

    def _proved(self, ip: str) -> None:
        self._proven[ip] = None
        self._proven.move_to_end(ip)
        while len(self._proven) > MAX_PROVEN:
            self._proven.popitem(last=False)

    def _admit(self, ident: Identity) -> Verdict:
        if len(self.connections) + self.confirming >= self.limits.max_connections:
            return Verdict.AT_CAPACITY
        return Verdict.ACCEPT

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, slot: _Pending
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
            self._release(slot)
        self._proved(ip)
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
        elif f is Failure.BAD_MAGIC:  # not mlxcel at all (a scanner, a browser): closed
            # silently, as the wire spec says, and counted in failures; nothing to act on
            self.limiter.debug(f"cluster: {ip} sent no mlxcel preamble (bad magic); closed")
        elif f is Failure.AT_CAPACITY:
            self.limiter.warn(
                "at-capacity",
                f"cluster: max connections ({self.limits.max_connections}) reached; refused {ip}",
            )
        else:
            self.limiter.warn(f.rate_class, f"cluster: handshake from {ip} failed: {exc}")

    def stop_accepting(self) -> None:
        """Close the listening socket; connections already authenticated stay open."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections):
            conn.close()

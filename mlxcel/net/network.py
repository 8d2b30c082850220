"""How roles address each other: by identity string, over sockets or in memory.

A role never holds a socket. It calls ``endpoint.send(dest, msg, deadline)`` with the
destination's identity and receives on its node's bus, where every message carries the
sender's identity as ``Envelope.source``. :class:`TcpEndpoint` sends over authenticated cluster
connections (identity = the peer's bound ``host:port``); :class:`LocalFabric` delivers between
nodes of one process (identity = the node's name) -- same messages, no sockets.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Callable

from mlxcel.base.errors import MlxcelError, SendFailed
from mlxcel.base.messages import Message
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import ConnectionPool
from mlxcel.reactor.bus import Node
from mlxcel.reactor.endpoint import Endpoint

__all__ = ["Endpoint", "LocalEndpoint", "LocalFabric", "ReplyEndpoint", "SendFailed", "TcpEndpoint"]


class LocalFabric:
    """An in-memory network between nodes of one process."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.sent = 0

    def endpoint(self, name: str, node: Node) -> LocalEndpoint:
        self.nodes[name] = node
        return LocalEndpoint(self, name)


class LocalEndpoint:
    def __init__(self, fabric: LocalFabric, identity: str) -> None:
        self.fabric = fabric
        self.identity = identity

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        node = self.fabric.nodes.get(dest)
        if node is None or node.bus.closed:
            raise SendFailed(f"no node {dest!r} on the local fabric")
        self.fabric.sent += 1
        await node.bus.publish(msg, source=self.identity, deadline=deadline)

    def send_now(self, dest: str, msg: Message) -> bool:
        """Deliver ``msg`` at once if every subscriber of ``dest`` has room; False: nothing
        was delivered, ``send`` it instead."""
        node = self.fabric.nodes.get(dest)
        if node is None or node.bus.closed:
            raise SendFailed(f"no node {dest!r} on the local fabric")
        if not node.bus.publish_now(msg, source=self.identity):
            return False
        self.fabric.sent += 1
        return True

    def reset(self, dest: str) -> None:
        """Nothing to reset in memory."""

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        """Nodes of one process never lose each other."""

    @property
    def wire_bytes(self) -> int:
        return 0


# Ports the kernel hands out on its own (connections' source ports, bind(0)); read once.
_EPHEMERAL: tuple[int, int] | None = None
FIXED_PORTS = (20000, 32767)  # where free_port looks first: below Linux's default ephemeral range


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (for a listener started a moment later). Taken, where
    it can be, outside the kernel's ephemeral range: a port from that range may be handed to
    some connection's source side before the listener binds it (a busy host did so to a
    tensor-parallel ring port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _ephemeral()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randint(*FIXED_PORTS)
        if low <= port <= high:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral() -> tuple[int, int]:
    global _EPHEMERAL
    if _EPHEMERAL is None:
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                low, high = (int(x) for x in f.read().split())
            _EPHEMERAL = (low, high)
        except (OSError, ValueError):
            _EPHEMERAL = (32768, 65535)  # elsewhere: stay below the usual ranges
    return _EPHEMERAL


def check_address(address: str, flag: str, port_zero: bool) -> None:
    """IP:PORT with a literal IP (identities are bound to source IPs, so no host names), in
    the one form identities are compared in: no leading zeros, IPv6 in brackets."""
    host, sep, port = address.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        canonical = f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"
        ok = (
            bool(sep)
            and port.isdigit()
            and (port_zero or int(port) > 0)
            and int(port) < 65536
            and address == canonical
        )
    except ValueError:
        ok = False
    if not ok:
        zero = " (port 0: any free port)" if port_zero else ""
        raise ValueError(
            f"{flag}: expected IP:PORT with a literal IP{zero} (IPv6 as [IP]:PORT, no leading "
            f"zeros), got {address!r}"
        )


def split_hostport(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


def _destination(dest: str) -> tuple[str, int]:
    """``dest`` as a host and port; a destination that is not HOST:PORT fails the send (the
    message never left), as an unreachable one does."""
    try:
        return split_hostport(dest)
    except ValueError as exc:
        raise SendFailed(f"send to {dest!r} failed: {exc}", unsent=True) from None


class TcpEndpoint:
    """Sends over the cluster transport; replies reach a peer at its authenticated identity."""

    def __init__(
        self, identity: str, pool: ConnectionPool, listener: ClusterListener | None = None
    ) -> None:
        self.identity = identity
        self.pool = pool
        self.listener = listener
        self._closing: set[str] = set()  # inbound connections we closed: not a lost peer
        self._lost: list[Callable[[str], None]] = []
        pool.on_lost.append(self._report_lost)  # the pool reports only what it did not drop
        if listener is not None:
            listener.on_lost.append(self._inbound_lost)

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        host, port = _destination(dest)
        try:
            conn = await self.pool.get(host, port, deadline)
        except (MlxcelError, ConnectionError, OSError) as exc:
            raise SendFailed(f"send to {dest} failed: {exc}", unsent=True) from exc
        written = conn.frames_out
        try:
            await conn.send(msg, deadline)
        except (MlxcelError, ConnectionError, OSError) as exc:
            raise SendFailed(
                f"send to {dest} failed: {exc}", unsent=conn.frames_out == written
            ) from exc

    def send_now(self, dest: str, msg: Message) -> bool:
        """Write ``msg`` to ``dest`` at once if a connection is open and idle (see
        :meth:`SecureConnection.send_now`); False: nothing was sent, ``send`` it instead."""
        conn = self.pool.ready(*_destination(dest))
        if conn is None:
            return False
        written = conn.frames_out
        try:
            return conn.send_now(msg)
        except (MlxcelError, ConnectionError, OSError) as exc:
            raise SendFailed(
                f"send to {dest} failed: {exc}", unsent=conn.frames_out == written
            ) from exc

    async def settled(self, dest: str) -> None:
        """Return once what was written to ``dest`` has mostly left this host (see
        :meth:`SecureConnection.settled`); at once when there is no connection to it."""
        try:
            conn = self.pool.ready(*_destination(dest))
        except SendFailed:
            return
        if conn is not None:
            await conn.settled()

    def reset(self, dest: str) -> None:
        """Close our connection to ``dest`` and its connection to us: a wedged stream (a
        damaged length, a stalled peer) is replaced instead of failing every later request."""
        try:
            host, port = split_hostport(dest)
        except ValueError:  # never sent to, so nothing to close
            return
        self.pool.drop(host, port)
        if self.listener is not None:
            inbound = self.listener.connection_for(dest)
            if inbound is not None:
                self._closing.add(dest)
                inbound.close()

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        """Either direction lost is the peer lost: our connection to it (pool) and its
        connection to us (listener) -- but not a connection ``reset`` closed on purpose."""
        self._lost.append(callback)

    def _report_lost(self, identity: str) -> None:
        for cb in list(self._lost):
            cb(identity)

    def _inbound_lost(self, identity: str) -> None:
        if identity in self._closing:
            self._closing.discard(identity)
        else:
            self._report_lost(identity)

    @property
    def wire_bytes(self) -> int:
        return self.pool.bytes_out


class ReplyEndpoint:
    """Answers over the connection the other side opened: for request/reply channels (the
    bring-up assignment) whose asking side does not listen for connections."""

    def __init__(self, identity: str, listener: ClusterListener) -> None:
        self.identity = identity
        self.listener = listener

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        conn = self.listener.connection_for(dest)
        if conn is None:
            raise SendFailed(f"no open connection from {dest} to answer on")
        try:
            await conn.send(msg, deadline)
        except (MlxcelError, ConnectionError, OSError) as exc:
            raise SendFailed(f"answer to {dest} failed: {exc}") from exc

    def reset(self, dest: str) -> None:
        conn = self.listener.connection_for(dest)
        if conn is not None:
            conn.close()

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        self.listener.on_lost.append(callback)

    @property
    def wire_bytes(self) -> int:
        return 0

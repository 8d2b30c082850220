"""How roles address each other: by identity string, over sockets or in memory.

A role never holds a socket. It calls ``endpoint.send(dest, msg, deadline)`` with the
destination's identity and receives on its node's bus, where every message carries the
sender's identity as ``Envelope.source``. :class:`TcpEndpoint` sends over authenticated cluster
connections (identity = the peer's bound ``host:port``); :class:`LocalFabric` delivers between
nodes of one process (identity = the node's name) -- same messages, no sockets.
"""

from __future__ import annotations

from typing import Protocol

from mlxcel.bus import Node
from mlxcel.errors import MlxcelError
from mlxcel.messages import Message
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import ConnectionPool


class SendFailed(MlxcelError):
    """A message could not be delivered to its destination."""


class Endpoint(Protocol):
    identity: str

    async def send(self, dest: str, msg: Message, deadline: float) -> None: ...

    def reset(self, dest: str) -> None:
        """Drop every connection with ``dest`` (both directions); the next send redials."""


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

    def reset(self, dest: str) -> None:
        """Nothing to reset in memory."""


def split_hostport(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


class TcpEndpoint:
    """Sends over the cluster transport; replies reach a peer at its authenticated identity."""

    def __init__(
        self, identity: str, pool: ConnectionPool, listener: ClusterListener | None = None
    ) -> None:
        self.identity = identity
        self.pool = pool
        self.listener = listener

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        host, port = split_hostport(dest)
        try:
            conn = await self.pool.get(host, port, deadline)
            await conn.send(msg, deadline)
        except MlxcelError as exc:
            raise SendFailed(f"send to {dest} failed: {exc}") from exc
        except (ConnectionError, OSError) as exc:
            raise SendFailed(f"send to {dest} failed: {exc}") from exc

    def reset(self, dest: str) -> None:
        """Close our connection to ``dest`` and its connection to us: a wedged stream (a
        damaged length, a stalled peer) is replaced instead of failing every later request."""
        host, port = split_hostport(dest)
        self.pool.drop(host, port)
        if self.listener is not None:
            inbound = self.listener.connection_for(dest)
            if inbound is not None:
                inbound.close()

    @property
    def wire_bytes(self) -> int:
        return self.pool.bytes_out

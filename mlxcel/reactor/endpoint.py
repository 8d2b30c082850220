"""How a role reaches other nodes: the ``Endpoint`` protocol, defined beside the bus.

A role never holds a socket or a connection pool. It sends with ``endpoint.send(dest, msg,
deadline)`` to a peer's identity and receives on its node's bus, where every message carries
the sender's authenticated identity. The network layer (:mod:`mlxcel.net.network`), the
in-process fabric and the simulator each provide one; roles import only this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mlxcel.base.errors import SendFailed
from mlxcel.base.messages import Message


class Endpoint(Protocol):
    identity: str

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        """Deliver ``msg`` to ``dest`` by ``deadline``; raise :class:`SendFailed` if it cannot."""

    # Optional, and what the adapter tries first: ``send_now(dest, msg) -> bool`` delivers
    # ``msg`` at once when that needs no waiting (an open, idle connection; a subscriber with
    # room) and returns False, having sent nothing, otherwise. An endpoint without it (or
    # with it set to None) gets every message through ``send``.

    # Optional: ``async settled(dest)`` returns once what was written to ``dest`` has
    # mostly left this host (the kernel's send queue is within the link's share). The
    # adapter awaits it before telling a core that a ``notify`` send was written, so a bulk
    # transfer paced by those notices never fills the queue that other messages wait in.

    def reset(self, dest: str) -> None:
        """Drop every connection with ``dest`` (both directions); the next send redials."""

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(identity)`` whenever a connection with a peer closes."""

    @property
    def wire_bytes(self) -> int:
        """Bytes this node has written to the network (0 where nothing is on a wire)."""


class NoNetwork:
    """The endpoint of a role that talks only to its own process (the engine): it has no
    peers, so a send fails (unsent) and no peer is ever lost."""

    identity = "local"
    wire_bytes = 0

    async def send(self, dest: str, msg: Message, deadline: float) -> None:
        raise SendFailed(f"{type(msg).__name__} to {dest}: this role has no network", unsent=True)

    def reset(self, dest: str) -> None:
        pass

    def on_peer_lost(self, callback: Callable[[str], None]) -> None:
        pass

"""How much of what this host wrote to a TCP connection has not left it yet.

A bulk transfer (a KV handoff's parts) must not fill the kernel's send queue and the link's
queue behind it: everything else sent the same way -- a short request's handoff, a commit,
a first token -- would wait behind all of it. On a 1 Mbit/s link whose queue holds 400 ms,
TCP keeps that queue full and every small message waits there, once per crossing. So the
sender of bulk data hands the kernel its next piece only once the connection's unsent and
unacknowledged bytes (``TIOCOUTQ``) are under :func:`share`: at least :data:`FLOOR`, or what
the link delivers in twice the path's minimum round trip (or :data:`DELAY`), whichever is
more -- so a fast or long link is never held below its bandwidth-delay product, and a slow
one holds a fraction of a second. The kernel's own estimates (``TCP_INFO``'s delivery rate
and minimum RTT) are used; where they are missing (not Linux, or a kernel before 4.9)
nothing waits.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass

FLOOR = 24 << 10  # bytes a connection may always hold in its send queue
DELAY = 0.02  # seconds of the link's delivery rate it may hold, at least
POLL = (0.001, 0.05)  # seconds between looks while above the share: bounds
_INFO = struct.Struct("=144x I I 8x Q")  # tcp_info: notsent_bytes, min_rtt (us), delivery_rate


@dataclass(frozen=True)
class QueueState:
    queued: int  # bytes written and not yet acknowledged by the peer (sent or not)
    delivery_rate: int  # bytes/s the kernel last measured (0: unknown)
    min_rtt: float  # seconds (0: unknown)


def read(sock: socket.socket) -> QueueState | None:
    """The connection's send queue now; None where the platform does not say."""
    if sys.platform != "linux":
        return None
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        queued = struct.unpack("i", raw)[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO.size)
    except OSError:
        return None
    if len(info) < _INFO.size:  # a kernel before 4.9: no rate to size the share by
        return None
    _, min_rtt, rate = _INFO.unpack(info)
    return QueueState(queued, rate, min_rtt / 1e6)


def share(state: QueueState) -> int:
    """How many bytes this connection may hold in its send queue."""
    return max(FLOOR, int(state.delivery_rate * max(DELAY, 2 * state.min_rtt)))


async def settled(sock: socket.socket, closed: Callable[[], bool]) -> None:
    """Return once ``sock``'s send queue is within its share (or the connection closed:
    ``closed()`` is true, or the queue cannot be read)."""
    while not closed():
        state = read(sock)
        if state is None:
            return
        excess = state.queued - share(state)
        if excess <= 0:
            return
        low, high = POLL
        await asyncio.sleep(min(high, max(low, excess / max(state.delivery_rate, 1))))

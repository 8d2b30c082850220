"""UDP for discovery beacons: a sender a peer uses once a second, and a bounded receiver.

Beacons are droppable traffic: the receiver keeps at most ``maxsize`` datagrams waiting for
its consumer and drops (and counts) the rest, so a flood cannot grow memory or stall the
reactor. Judging a beacon is the bring-up core's business, not this module's.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from loguru import logger

from mlxcel.errors import ListenError

MAX_DATAGRAM = 2048  # a beacon is far smaller: a larger datagram is dropped unread (and counted)


class BeaconSender:
    """Sends datagrams to ``target:port`` from ``source_ip`` (so the receiver sees that IP)."""

    def __init__(self, target: str, port: int, source_ip: str = "0.0.0.0") -> None:
        self.target = (target, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        self.sock.setblocking(False)
        try:
            self.sock.bind((source_ip, 0))
        except OSError as exc:
            self.sock.close()
            raise ListenError(f"cannot send beacons from {source_ip}: {exc.strerror}") from None
        self.sent = 0
        self.failed = 0

    def send(self, datagram: bytes) -> None:
        try:
            self.sock.sendto(datagram, self.target)
            self.sent += 1
        except OSError as exc:  # no route yet, a full buffer: the next beacon tries again
            self.failed += 1
            if self.failed in (1, 10, 100):
                logger.warning("discovery: beacon to {}:{} not sent: {}", *self.target, exc)

    def close(self) -> None:
        self.sock.close()


class _Protocol(asyncio.DatagramProtocol):
    def __init__(
        self, queue: asyncio.Queue[tuple[bytes, str]], counter: Callable[[], None]
    ) -> None:
        self.queue = queue
        self.counter = counter

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        if len(data) > MAX_DATAGRAM:  # nothing this large is a beacon; do not hold it
            self.counter()
            return
        try:
            self.queue.put_nowait((data, addr[0]))
        except asyncio.QueueFull:
            self.counter()


class BeaconReceiver:
    """Listens on ``host:port``; ``queue`` yields ``(datagram, source_ip)``."""

    def __init__(self, host: str, port: int, maxsize: int = 256) -> None:
        self.host, self.port = host, port
        self.queue: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue(maxsize)
        self.dropped = 0
        self._transport: asyncio.DatagramTransport | None = None

    def _drop(self) -> None:
        self.dropped += 1

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(self.queue, self._drop),
                local_addr=(self.host, self.port),
                reuse_port=False,
            )
        except OSError as exc:
            raise ListenError(
                f"cannot listen for discovery beacons on UDP {self.host}:{self.port}: "
                f"{exc.strerror or exc}"
            ) from None
        self._transport = transport  # type: ignore[assignment]
        logger.info("discovery: listening for beacons on UDP {}:{}", self.host, self.port)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

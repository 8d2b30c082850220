"""UDP for discovery beacons: a sender a peer uses once a second, and a bounded receiver.

Beacons are droppable traffic, and anyone on the network can send datagrams. The receiver
spends as little as it can on each before anything is queued:

1. a budget per source IP (a token bucket: 10 a second, bursts of 10; a peer sends one a
   second): a flooding source is throttled and every other source keeps its share;
2. a cheap shape test supplied by the caller (the first bytes of a beacon) before any MAC;
3. at most ``maxsize`` datagrams wait for the consumer.

Everything dropped is counted, by reason and by source, for the operator (``stats``). Judging
a beacon (its MAC, clock, nonce, address) is the bring-up core's business, not this module's.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from mlxcel.base.errors import ListenError

MAX_DATAGRAM = 2048  # a beacon is far smaller: a larger datagram is dropped unread (and counted)
SOURCE_RATE = 10.0  # datagrams a second one source may have judged ...
SOURCE_BURST = 10.0  # ... after a burst of this many
MAX_SOURCES = 4096  # sources with a budget of their own; beyond, newcomers share one
SOURCE_IDLE = 10.0  # seconds unheard before a source's bucket may go to a newcomer
SHARED = "(other sources)"


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


class SourceBudget:
    """A token bucket per source: ``allow(ip, now)`` spends one token or says no.

    At most ``limit`` sources have a bucket of their own. A source unheard for ``idle``
    seconds may give its bucket up (the least recently heard first, in constant time) to a
    newcomer; while every bucket is in use -- thousands of sources, forged ones -- newcomers
    share one. A peer beaconing once a second is never idle that long, so it keeps its own.
    """

    def __init__(
        self,
        rate: float = SOURCE_RATE,
        burst: float = SOURCE_BURST,
        limit: int = MAX_SOURCES,
        idle: float = SOURCE_IDLE,
    ) -> None:
        self.rate, self.burst, self.limit, self.idle = rate, burst, limit, idle
        # ip -> [tokens, when last heard], least recently heard first
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        self.shared = [burst, 0.0]  # the newcomers' bucket while every other one is in use

    @property
    def sources(self) -> list[str]:
        """The sources that have a bucket now, least recently heard first."""
        return list(self._buckets)

    def allow(self, ip: str, now: float) -> bool:
        b = self._buckets.get(ip)
        if b is not None:
            self._buckets.move_to_end(ip)
        else:
            if len(self._buckets) >= self.limit:
                oldest, ob = next(iter(self._buckets.items()))
                if now - ob[1] < self.idle:
                    return self._spend(self.shared, now)
                del self._buckets[oldest]
            b = self._buckets[ip] = [self.burst, now]
        return self._spend(b, now)

    def _spend(self, b: list[float], now: float) -> bool:
        tokens = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[1] = now
        if tokens < 1.0:
            b[0] = tokens
            return False
        b[0] = tokens - 1.0
        return True


@dataclass
class ReceiverStats:
    """What the receiver dropped, and from whom (the busiest ``MAX_SOURCES`` sources)."""

    received: int = 0
    throttled: int = 0  # over a source's budget
    not_beacon: int = 0  # too large, or not shaped like a beacon
    queue_full: int = 0
    by_source: Counter[str] = field(default_factory=Counter)  # dropped, per source

    @property
    def dropped(self) -> int:
        return self.throttled + self.not_beacon + self.queue_full

    def drop(self, ip: str) -> None:
        if ip in self.by_source or len(self.by_source) < MAX_SOURCES:
            self.by_source[ip] += 1
        else:
            self.by_source[SHARED] += 1


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, rx: BeaconReceiver) -> None:
        self.rx = rx
        self.time = asyncio.get_running_loop().time

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        rx, ip = self.rx, addr[0]
        st = rx.stats
        st.received += 1
        if not rx.budget.allow(ip, self.time()):
            st.throttled += 1
            st.drop(ip)
            return
        if len(data) > MAX_DATAGRAM or not rx.shaped(data):
            st.not_beacon += 1
            st.drop(ip)
            return
        try:
            rx.queue.put_nowait((data, ip))
        except asyncio.QueueFull:
            st.queue_full += 1
            st.drop(ip)


class BeaconReceiver:
    """Listens on ``host:port``; ``queue`` yields ``(datagram, source_ip)``. ``shaped``: a
    cheap test that a datagram could be a beacon at all (no cryptography)."""

    def __init__(
        self,
        host: str,
        port: int,
        maxsize: int = 256,
        shaped: Callable[[bytes], bool] = lambda _d: True,
        budget: SourceBudget | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.queue: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue(maxsize)
        self.shaped = shaped
        self.budget = budget or SourceBudget()
        self.stats = ReceiverStats()
        self._transport: asyncio.DatagramTransport | None = None

    @property
    def dropped(self) -> int:
        return self.stats.dropped

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(self),
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

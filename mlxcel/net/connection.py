"""One authenticated connection: frames in and out, messages to the bus.

Thin glue over the wire layer (:mod:`mlxcel.wire.stream`). Sending encodes a message (CBOR)
and writes the frames :func:`~mlxcel.wire.stream.message_frames` seals -- one frame, or above
``record_size`` (256 KiB) a run of PART frames and an END frame -- draining the socket after
each, so the receiver can open one record while the next is in flight.

Receiving reads exactly the bytes the :class:`~mlxcel.wire.stream.FrameStream` asks for,
feeds them and acts on its events; the stream enforces every limit (a frame announces at most
one record, refused from its header; a message grows to at most ``max_message``; every
connection of a node draws on one :class:`MemoryBudget`). This module owns the clock: while
the stream is inside a frame or a multi-record message the peer has ``frame_timeout`` for the
rest; otherwise a listener-side connection that receives nothing for ``idle_timeout`` is
closed. Any frame failure closes the connection; nothing from it reaches the bus. A decoded
message that the bus cannot take before its deadline is dropped and counted (``bus_drops``)
-- a declared decision, never a teardown.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import sys

from loguru import logger

from mlxcel.base.deadlines import until
from mlxcel.base.defaults import PEER_TIMEOUT
from mlxcel.base.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    DecodeError,
    FrameError,
    FrameTimeout,
    PeerSilent,
    QueueFull,
)
from mlxcel.base.messages import Message, Undecodable
from mlxcel.net import send_queue
from mlxcel.net.heap import TRIMMER
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.net.read_deadline import ReadDeadline
from mlxcel.reactor.bus import Node
from mlxcel.wire.codec import decode, encode, salvage, tensor_bytes
from mlxcel.wire.frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    KIND_CONFIRM,
    KIND_KEEPALIVE,
    KIND_PING,
    Protection,
)
from mlxcel.wire.handshake import Identity
from mlxcel.wire.stream import (
    DEFAULT_MEMORY_BUDGET,
    ConfirmReceived,
    FrameDropped,
    FrameStream,
    MemoryBudget,
    MessageReceived,
    PingReceived,
    StreamEvent,
    message_frames,
)

__all__ = [
    "DECODE_INLINE",
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_MEMORY_BUDGET",
    "DEFAULT_RECORD_SIZE",
    "ConnectionClosed",
    "MemoryBudget",
    "SecureConnection",
]

DEFAULT_RECORD_SIZE = DEFAULT_MAX_FRAME
DEFAULT_FRAME_TIMEOUT = 10.0  # seconds from a frame's header to the end of its body
# A peer heard from not at all for this long is dead (a partition, a stopped process: no reset
# ever comes). Each side sends a KEEPALIVE after a third of it without writing.
DEFAULT_PEER_TIMEOUT = PEER_TIMEOUT
DECODE_INLINE = 64 << 10  # messages above this are decoded on a worker thread
ENCODE_INLINE = 4 << 20  # messages carrying more tensor bytes are encoded on a worker thread
_ids = itertools.count(1)


# Bytes a cluster socket's kernel buffer may hold that were not sent yet. The rest waits in
# the connection's own buffer, where a deadline can still stop it and the next message can
# still be chosen: on a slow link a kernel buffer of megabytes is tens of seconds of data that
# nothing can take back or reorder. In-flight (sent, unacknowledged) bytes are not limited.
NOTSENT_LOWAT = 32 << 10


def _keep_unsent_here(writer: asyncio.StreamWriter) -> None:
    # The event loop's own buffer too: a send counts as written (drain returns) only once the
    # kernel took it, so what waits behind it is still the connection's to order and stop.
    writer.transport.set_write_buffer_limits(high=0)
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform == "linux" else None)
    if sock is None or option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, NOTSENT_LOWAT)
    except OSError:  # an older kernel: the kernel's buffer then holds what it will
        pass


class SecureConnection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        protection: Protection,
        peer: Identity,
        limiter: WarningLimiter,
        *,
        max_message: int = DEFAULT_MAX_MESSAGE,
        record_size: int = DEFAULT_RECORD_SIZE,
        outbound: bool = False,
        budget: MemoryBudget | None = None,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        idle_timeout: float | None = None,
        peer_timeout: float | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.protection = protection
        self.peer = peer
        self.limiter = limiter
        self.max_message = max_message
        self.record_size = min(record_size, DEFAULT_MAX_FRAME)
        self.max_frame = DEFAULT_MAX_FRAME
        self.outbound = outbound
        self.budget = budget or MemoryBudget()
        self.frame_timeout = frame_timeout
        # The read deadline between frames: a peer must be heard within ``peer_timeout`` (its
        # heartbeat keeps a live one heard); ``idle_timeout`` alone where there is none.
        waits = [t for t in (idle_timeout, peer_timeout) if t is not None]
        self.idle_timeout = min(waits) if waits else None
        self.peer_timeout = peer_timeout
        self.bus_drops = 0
        self._last_write = asyncio.get_running_loop().time()
        self.heard_at = self._last_write  # when a frame (or part of one) last arrived
        self._waiting: list[asyncio.Future[None]] = []  # pings waiting to hear the peer
        self._gone = False  # the peer stopped answering: close by abort, not by a flush
        _keep_unsent_here(writer)
        self.id = next(_ids)
        self.closed = False
        self.frames_out = 0
        self.bytes_out = 0
        self.unknown_kinds = 0
        # The listener side's first frame must be the dialer's CONFIRM.
        self._stream = FrameStream(
            protection,
            max_frame=self.max_frame,
            max_message=max_message,
            budget=self.budget,
            confirm_first=not outbound,
        )
        self._send_lock = asyncio.Lock()
        self._read_deadline = ReadDeadline(asyncio.get_running_loop(), self._read_late)
        self._frame_late = (
            f"{self.source}: a frame (or the next record of a message) did not arrive within "
            f"{frame_timeout:g}s"
        )
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The one message send_now encoded and then declined, for the send that follows it.
        self._declined: tuple[Message, bytes | bytearray | memoryview] | None = None

    @property
    def frames_in(self) -> int:
        return self._stream.frames_in

    @property
    def bytes_in(self) -> int:
        return self._stream.bytes_in

    @property
    def source(self) -> str:
        """The identity every received message is attributed to."""
        return self.peer.address

    def __repr__(self) -> str:
        return f"<SecureConnection #{self.id} {'to' if self.outbound else 'from'} {self.source}>"

    # --- sending -----------------------------------------------------------------------------
    async def send(self, msg: Message, deadline: float | None = None) -> None:
        # Encoding copies every tensor byte: a KV handoff of hundreds of MiB would stall the
        # reactor for everyone, so a large one is encoded on a worker thread.
        declined, self._declined = self._declined, None
        if declined is not None and declined[0] is msg:  # encoded already by send_now
            payload = declined[1]
        elif tensor_bytes(msg) > ENCODE_INLINE:
            payload = await asyncio.to_thread(encode, msg)
        else:
            payload = encode(msg)
        await self.send_payload(payload, deadline)

    async def send_payload(
        self, payload: bytes | bytearray | memoryview, deadline: float | None = None
    ) -> None:
        if self.closed:
            raise ConnectionClosed(f"{self!r} is closed")
        if self._write_now(payload, deadline):
            return
        frames = message_frames(
            self.protection, payload, record_size=self.record_size, max_message=self.max_message
        )
        records = max(1, -(-len(payload) // self.record_size))
        written = 0
        try:
            async with until(deadline, f"send to {self.source}"), self._send_lock:
                # Sealed one by one under the lock (counter order = write order); the drain
                # after each record lets the peer start opening it while the next is sealed.
                for frame in frames:
                    self._write(frame)
                    written += 1
                    await self.writer.drain()
        except BaseException:
            if 0 < written < records:
                # The peer holds the first part of a message that will never end: whatever
                # came next on this stream would be glued onto it. Only a new connection helps,
                # and what the kernel still holds of this message is not worth sending.
                self._gone = True
                self.close()
            raise

    async def settled(self) -> None:
        """Return once what this side wrote has mostly left the host: its unsent and
        unacknowledged bytes are within the link's share (:mod:`.send_queue`). A bulk sender
        awaits this before its next piece, so other messages never queue behind much."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            await send_queue.settled(sock, lambda: self.closed)

    def send_now(self, msg: Message) -> bool:
        """Write ``msg`` at once if that needs no waiting: a message of one record onto an idle
        stream whose buffer the kernel has emptied. False: nothing was written (``send`` it).
        What a role's outbox tries first, saving a task's wake-up per message."""
        if self.closed or tensor_bytes(msg) > self.record_size // 2:
            return False  # large: maybe several records, maybe encoded on a worker thread
        if self._send_lock.locked() or not self._drained(None):
            return False  # checked before encoding, so a busy stream costs nothing here
        payload = encode(msg)
        if self._write_now(payload, None):
            return True
        # Too large for one record (a long prompt's token ids): ``send`` follows with this
        # same message, and takes the payload instead of encoding it again.
        self._declined = (msg, payload)
        return False

    def _write_now(self, payload: bytes | bytearray | memoryview, deadline: float | None) -> bool:
        if len(payload) > self.record_size or self._send_lock.locked():
            return False
        if not self._drained(deadline):
            return False
        # One frame onto an idle stream: sealed and written without yielding (so nothing
        # interleaves and the counter order holds); no deadline to arm, since nothing waits.
        self._write(next(message_frames(self.protection, payload, max_message=self.max_message)))
        if self.writer.transport.is_closing():  # the write found the socket broken
            raise ConnectionClosed(f"{self!r} closed while sending")
        return True

    def _drained(self, deadline: float | None) -> bool:
        transport = self.writer.transport
        if deadline is not None and deadline <= asyncio.get_running_loop().time():
            return False  # let the slow path say the deadline passed
        return not transport.is_closing() and transport.get_write_buffer_size() == 0

    def _write(self, frame: bytearray) -> None:
        # The peer may have gone while a long message waited for its drain: uvloop raises a
        # bare RuntimeError on a write to a closed transport, which would end the caller's
        # outbox task for good instead of failing this one send.
        if self.writer.transport.is_closing():
            raise ConnectionClosed(f"{self!r} closed while sending")
        self.writer.write(frame)
        self.frames_out += 1
        self.bytes_out += len(frame)
        self._last_write = asyncio.get_running_loop().time()

    async def keep_alive(self, interval: float) -> None:
        """An empty KEEPALIVE whenever ``interval`` passed without a write, so the peer's read
        deadline only ever closes connections whose other end is gone. Both sides run it
        where a ``peer_timeout`` is set; a dialer without one keeps a listener's idle
        timeout at bay."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            wait = max(0.01, self._last_write + interval - loop.time())
            try:
                await asyncio.wait_for(asyncio.shield(self.done), wait)
                return  # closed
            except TimeoutError:
                pass
            if self.closed or loop.time() - self._last_write < interval:
                continue
            self.send_control(KIND_KEEPALIVE)

    async def ping(self, deadline: float) -> float:
        """A round trip on this connection: ask the peer for a frame (PING) and wait until one
        arrives -- its answer, or anything else it sends meanwhile (a peer busy writing a long
        message answers with that). Returns the seconds it took; raises
        :class:`PeerSilent` when nothing came by ``deadline`` (the connection is then closed:
        the peer is not answering) and :class:`ConnectionClosed` if it closes."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        self.send_control(KIND_PING)
        try:
            async with until(deadline, f"an answer from {self.source}"):
                while self.heard_at <= sent:
                    if self.closed:
                        raise ConnectionClosed(f"the connection to {self.source} closed")
                    heard = loop.create_future()
                    self._waiting.append(heard)
                    await heard
        except DeadlineExceeded:
            self._gone = True
            self.close()
            waited = loop.time() - sent
            raise PeerSilent(f"no answer to a ping within {waited:.1f}s") from None
        return loop.time() - sent

    async def confirm(self) -> None:
        """The dialing side's first frame: proof that it holds the session keys."""
        if not self.send_control(KIND_CONFIRM):
            raise ConnectionClosed(f"{self!r} closed before confirming")

    def send_control(self, kind: int) -> bool:
        """Write an empty control frame now, never waiting: not while a message is being
        written (it could land between that message's records -- and the records flowing
        already tell the peer this side is alive), not onto a closed stream. Nothing awaits
        the drain, so a peer that stops reading cannot hang a heartbeat."""
        if self.closed or self._send_lock.locked() or self.writer.transport.is_closing():
            return False
        try:
            self._write(self.protection.seal(kind, b""))
        except FrameError:  # the counter ran out: only a new connection helps
            self.close()
            return False
        return True

    async def expect_confirm(self, deadline: float) -> None:
        """Listening side: the first frame must be a CONFIRM that opens, before ``deadline``."""
        async with until(deadline, f"confirmation from {self.source}"):
            event = await self._next_event(idle=None)
        if not isinstance(event, ConfirmReceived):  # the stream allows nothing else first
            raise FrameError(f"{self.source}: first frame is not a confirmation")

    # --- receiving ---------------------------------------------------------------------------
    async def _next_event(self, idle: float | None) -> StreamEvent:
        """The stream's next event, reading exactly what it asks for. Outside a frame the
        wait is bounded by ``idle``; inside one (or between the records of a message) by
        ``frame_timeout``, so a damaged length or a stalled peer cannot wedge the reader and
        a half-sent message cannot hold the budget forever."""
        stream = self._stream
        deadline = self._read_deadline
        while (event := stream.next_event()) is None:
            if stream.in_frame:
                deadline.start(self.frame_timeout, self._frame_late)
            elif idle is None:
                deadline.done()
            else:
                deadline.start(idle, f"{self.source} sent nothing for {idle:g}s")
            try:
                data = await self.reader.readexactly(stream.bytes_needed)
            except asyncio.IncompleteReadError:
                raise ConnectionClosed(f"{self.source} closed the connection") from None
            except (ConnectionError, OSError) as exc:
                raise ConnectionClosed(f"{self.source}: {exc}") from None
            finally:
                deadline.done()
            self.heard_at = asyncio.get_running_loop().time()
            self._wake_pings()
            if self.closed:  # closed on this side while reading: no frame error to report
                raise ConnectionClosed(f"{self!r} is closed")
            stream.receive_data(data)
        return event

    def _read_late(self, why: str) -> None:
        """A read overran its deadline: the read in progress raises :class:`FrameTimeout`."""
        self._gone = True  # whatever waits in the write buffer will never be read
        self.reader.set_exception(FrameTimeout(why))

    async def recv_payload(self) -> bytes | bytearray | memoryview:
        """The next complete message payload (raises ConnectionClosed or FrameError). An
        interrupted call (timeout, cancellation) ends the stream: the budget it held goes back
        and the half-read frame cannot be resumed."""
        if self.closed:
            raise ConnectionClosed(f"{self!r} is closed")
        try:
            while True:
                event = await self._next_event(self.idle_timeout)
                if isinstance(event, MessageReceived):
                    TRIMMER.received(len(event.payload))
                    return event.payload
                if isinstance(event, FrameDropped):
                    # Authenticated, but not a kind this build handles here.
                    self.unknown_kinds += 1
                    self.limiter.warn(
                        "diagnostic",
                        f"cluster: dropping an authenticated frame of unknown kind "
                        f"{event.kind} from {self.source}",
                    )
                elif isinstance(event, PingReceived):
                    self.send_control(KIND_KEEPALIVE)  # (a message being written answers too)
                # KeepaliveReceived: it has done its job by arriving (the idle wait restarts).
        except BaseException:
            self._stream.close()
            raise

    async def run(self, node: Node, deadline_s: float = 30.0) -> None:
        """Reader loop: decode each message and publish it with the peer's identity."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                payload = await self.recv_payload()
                try:
                    # A large message takes long to check element by element: off the reactor,
                    # so one member's megabyte of CBOR cannot stall everyone's traffic.
                    if len(payload) > DECODE_INLINE:
                        msg = await asyncio.to_thread(decode, payload)
                    else:
                        msg = decode(payload)
                except DecodeError as exc:
                    self.limiter.warn(
                        "diagnostic", f"cluster: undecodable message from {self.source}: {exc}"
                    )
                    kind, request_id, nonce, rows = salvage(payload)
                    if nonce is None and not rows:
                        continue  # nothing anyone waits on can be named
                    msg = Undecodable(kind, request_id, nonce, str(exc)[:300], rows)
                try:
                    await node.bus.publish(
                        msg, source=self.source, deadline=loop.time() + deadline_s
                    )
                except (DeadlineExceeded, QueueFull):
                    # Back-pressure held for the whole deadline: drop this one, keep the link.
                    self.bus_drops += 1
                    self.limiter.warn(
                        "router-drop",
                        f"cluster: dropped a {type(msg).__name__} from {self.source}: "
                        "its handler's queue stayed full",
                    )
        except FrameError as exc:
            self.limiter.warn(
                "diagnostic", f"cluster: closing connection from {self.source}: {exc}"
            )
        except ConnectionClosed as exc:
            logger.debug("cluster: {}", exc)
        finally:
            self.close()

    def _wake_pings(self) -> None:
        waiting, self._waiting = self._waiting, []
        for heard in waiting:
            if not heard.done():
                heard.set_result(None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._wake_pings()
        self._read_deadline.cancel()
        self._stream.close()  # gives back what a half-received message holds of the budget
        try:
            if self._gone:
                # A graceful close would wait to flush to a peer that reads nothing: the
                # socket (and the reader waiting on it) would linger for TCP's minutes.
                self.writer.transport.abort()
            else:
                self.writer.close()
        except Exception:  # pragma: no cover - closing a broken transport
            pass
        self.reader.feed_eof()  # the read in progress ends now, not when the socket does
        if not self.done.done():
            self.done.set_result(None)

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """Close, and wait (at most ``timeout``) until the socket is gone; a peer that does
        not take the rest of what was written gets its connection aborted then."""
        self.close()
        try:
            async with asyncio.timeout(timeout):
                await self.writer.wait_closed()
        except TimeoutError:
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass

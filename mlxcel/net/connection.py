"""One authenticated connection: frames in and out, messages to the bus.

Thin glue over the wire layer. Sending encodes a message (CBOR), seals it as one frame (or,
above ``record_size`` (256 KiB), as a run of PART frames and an END frame, so the receiver can open
one record while the next is in flight) and drains the socket.

Receiving is bounded in memory and in time. A frame may announce at most one record
(``max_frame``), refused from the header alone, so at most 256 KiB is allocated before a tag
is checked. A message being reassembled may grow to ``max_message`` bytes on this connection,
and every connection of a node draws on one :class:`MemoryBudget`. A frame's body must follow
its header within ``frame_timeout``; a listener-side connection that receives nothing for
``idle_timeout`` is closed. Any frame failure closes the connection; nothing from it reaches
the bus. A decoded message that the bus cannot take before its deadline is dropped and
counted (``bus_drops``) -- a declared decision, never a teardown.
"""

from __future__ import annotations

import asyncio
import itertools

from loguru import logger

from mlxcel.bus import Node
from mlxcel.deadlines import until
from mlxcel.errors import DeadlineExceeded, DecodeError, MlxcelError, QueueFull
from mlxcel.messages import Message, Undecodable
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.wire.codec import decode, encode, salvage
from mlxcel.wire.frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    HEADER_LEN,
    KIND_CONFIRM,
    KIND_END,
    KIND_KEEPALIVE,
    KIND_MESSAGE,
    KIND_PART,
    BudgetExceeded,
    FrameError,
    FrameTimeout,
    FrameTooLarge,
    Protection,
    parse_header,
)
from mlxcel.wire.handshake import Identity

DEFAULT_RECORD_SIZE = DEFAULT_MAX_FRAME
DEFAULT_FRAME_TIMEOUT = 10.0  # seconds from a frame's header to the end of its body
DEFAULT_MEMORY_BUDGET = 1 << 30  # reassembly buffers of all connections of one node
DECODE_INLINE = 64 << 10  # messages above this are decoded on a worker thread
_ids = itertools.count(1)


class MemoryBudget:
    """One node's allowance for message reassembly across all its connections."""

    def __init__(self, limit: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refusals = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refusals += 1
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n


class ConnectionClosed(MlxcelError):
    """The connection is closed (by either side, or after a failure)."""


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
        self.idle_timeout = idle_timeout
        self.bus_drops = 0
        self._last_write = asyncio.get_running_loop().time()
        self.id = next(_ids)
        self.closed = False
        self.frames_in = 0
        self.frames_out = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.unknown_kinds = 0
        self._send_lock = asyncio.Lock()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def source(self) -> str:
        """The identity every received message is attributed to."""
        return self.peer.address

    def __repr__(self) -> str:
        return f"<SecureConnection #{self.id} {'to' if self.outbound else 'from'} {self.source}>"

    # --- sending -----------------------------------------------------------------------------
    async def send(self, msg: Message, deadline: float | None = None) -> None:
        await self.send_payload(encode(msg), deadline)

    async def send_payload(
        self, payload: bytes | bytearray | memoryview, deadline: float | None = None
    ) -> None:
        if self.closed:
            raise ConnectionClosed(f"{self!r} is closed")
        if len(payload) > self.max_message:
            raise FrameTooLarge(
                f"message of {len(payload)} bytes exceeds the {self.max_message}-byte cap"
            )
        mv = memoryview(payload)
        async with until(deadline, f"send to {self.source}"), self._send_lock:
            if len(mv) <= self.record_size:
                self._write(self.protection.seal(KIND_MESSAGE, mv))
            else:
                for off in range(0, len(mv), self.record_size):
                    end = min(off + self.record_size, len(mv))
                    self._write(
                        self.protection.seal(KIND_END if end == len(mv) else KIND_PART, mv[off:end])
                    )
                    await self.writer.drain()  # let the peer start opening this record
            await self.writer.drain()

    def _write(self, frame: bytearray) -> None:
        self.writer.write(frame)
        self.frames_out += 1
        self.bytes_out += len(frame)
        self._last_write = asyncio.get_running_loop().time()

    async def keep_alive(self, interval: float) -> None:
        """Dialing side: an empty KEEPALIVE frame whenever ``interval`` passed without a
        write, so the listener's idle timeout only ever closes peers that are gone."""
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
            try:
                await self._send_empty(KIND_KEEPALIVE)
            except (ConnectionError, OSError, FrameError):
                self.close()

    async def confirm(self) -> None:
        """The dialing side's first frame: proof that it holds the session keys."""
        await self._send_empty(KIND_CONFIRM)

    async def _send_empty(self, kind: int) -> None:
        async with self._send_lock:
            self._write(self.protection.seal(kind, b""))
            await self.writer.drain()

    async def expect_confirm(self, deadline: float) -> None:
        """Listening side: the first frame must be a CONFIRM that opens, before ``deadline``."""
        async with until(deadline, f"confirmation from {self.source}"):
            kind, plain = await self._read_frame(idle=None)
        if kind != KIND_CONFIRM or plain:
            raise FrameError(f"{self.source}: first frame is not a confirmation (kind {kind})")

    # --- receiving ---------------------------------------------------------------------------
    async def _read_frame(self, idle: float | None) -> tuple[int, bytes | bytearray]:
        """One opened frame. ``idle`` bounds the wait for its header; its body always has
        ``frame_timeout`` (a damaged length or a stalled peer cannot wedge the reader)."""
        try:
            try:
                async with asyncio.timeout(idle):
                    header = await self.reader.readexactly(HEADER_LEN)
            except TimeoutError:
                raise FrameTimeout(f"{self.source} sent nothing for {idle:g}s") from None
            kind, length = parse_header(header, self.max_frame)
            try:
                async with asyncio.timeout(self.frame_timeout):
                    body = await self.reader.readexactly(length + self.protection.overhead)
            except TimeoutError:
                raise FrameTimeout(
                    f"{self.source}: a frame of {length} bytes did not arrive within "
                    f"{self.frame_timeout:g}s of its header"
                ) from None
        except asyncio.IncompleteReadError:
            raise ConnectionClosed(f"{self.source} closed the connection") from None
        except (ConnectionError, OSError) as exc:
            raise ConnectionClosed(f"{self.source}: {exc}") from None
        plain = self.protection.open(header, body)
        self.frames_in += 1
        self.bytes_in += HEADER_LEN + len(body)
        return kind, plain

    async def recv_payload(self) -> bytes | bytearray:
        """The next complete message payload (raises ConnectionClosed or FrameError)."""
        parts: list[bytes | bytearray] = []
        total = 0
        try:
            while True:
                # Between the records of one message the peer gets frame_timeout, not the
                # idle allowance: a half-sent message must not hold the budget forever.
                wait = self.frame_timeout if parts else self.idle_timeout
                kind, plain = await self._read_frame(wait)
                if kind == KIND_MESSAGE and not parts:
                    return plain
                if kind == KIND_KEEPALIVE and not parts and not plain:
                    continue
                if kind in (KIND_PART, KIND_END):
                    if total + len(plain) > self.max_message:
                        raise FrameTooLarge(f"message exceeds the {self.max_message}-byte cap")
                    if not self.budget.take(len(plain)):
                        raise BudgetExceeded(
                            f"reassembling a message from {self.source} would pass this node's "
                            f"{self.budget.limit}-byte budget for messages in flight"
                        )
                    parts.append(plain)
                    total += len(plain)
                    if kind == KIND_END:
                        return b"".join(parts)
                    continue
                # Authenticated, but not a kind this build knows (or a MESSAGE inside a PART run).
                self.unknown_kinds += 1
                self.limiter.warn(
                    "diagnostic",
                    f"cluster: dropping an authenticated frame of unknown kind {kind} "
                    f"from {self.source}",
                )
                self.budget.give(total)
                parts.clear()
                total = 0
        finally:
            self.budget.give(total)

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
                    kind, request_id, nonce = salvage(payload)
                    if nonce is None:
                        continue  # nothing anyone waits on can be named
                    msg = Undecodable(kind, request_id, nonce, str(exc)[:300])
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

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()
        except Exception:  # pragma: no cover - closing a broken transport
            pass
        if not self.done.done():
            self.done.set_result(None)

    async def wait_closed(self) -> None:
        self.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass

"""One authenticated connection: frames in and out, messages to the bus.

Thin glue over the wire layer. Sending encodes a message (CBOR), seals it as one frame (or,
above ``record_size`` (256 KiB), as a run of PART frames and an END frame, so the receiver can open
one record while the next is in flight) and drains the socket. The reader loop refuses an
oversize length from the header before reading the body, opens every frame, reassembles, decodes
and publishes to the bus with the peer's authenticated identity as the source -- blocking when
the bus is full, which stops reading and lets the kernel buffer push back on the sender.
Any frame failure closes the connection; nothing from it reaches the bus.
"""

from __future__ import annotations

import asyncio
import itertools

from loguru import logger

from mlxcel.bus import Node
from mlxcel.deadlines import until
from mlxcel.errors import DecodeError, MlxcelError
from mlxcel.messages import Message
from mlxcel.net.ratelimit import WarningLimiter
from mlxcel.wire.codec import decode, encode
from mlxcel.wire.frames import (
    DEFAULT_MAX_FRAME,
    HEADER_LEN,
    KIND_END,
    KIND_MESSAGE,
    KIND_PART,
    FrameError,
    FrameTooLarge,
    Protection,
    parse_header,
)
from mlxcel.wire.handshake import Identity

DEFAULT_RECORD_SIZE = 256 << 10
_ids = itertools.count(1)


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
        max_frame: int = DEFAULT_MAX_FRAME,
        record_size: int = DEFAULT_RECORD_SIZE,
        outbound: bool = False,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.protection = protection
        self.peer = peer
        self.limiter = limiter
        self.max_frame = max_frame
        self.record_size = record_size
        self.outbound = outbound
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
        if len(payload) > self.max_frame:
            raise FrameTooLarge(
                f"message of {len(payload)} bytes exceeds the {self.max_frame}-byte cap"
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

    # --- receiving ---------------------------------------------------------------------------
    async def recv_payload(self) -> bytes | bytearray:
        """The next complete message payload (raises ConnectionClosed or FrameError)."""
        parts: list[bytes | bytearray] = []
        total = 0
        while True:
            try:
                header = await self.reader.readexactly(HEADER_LEN)
                kind, length = parse_header(header, self.max_frame)
                if total + length > self.max_frame:
                    raise FrameTooLarge(f"message exceeds the {self.max_frame}-byte cap")
                body = await self.reader.readexactly(length + self.protection.overhead)
            except asyncio.IncompleteReadError:
                raise ConnectionClosed(f"{self.source} closed the connection") from None
            except (ConnectionError, OSError) as exc:
                raise ConnectionClosed(f"{self.source}: {exc}") from None
            plain = self.protection.open(header, body)
            self.frames_in += 1
            self.bytes_in += HEADER_LEN + len(body)
            if kind == KIND_MESSAGE and not parts:
                return plain
            if kind in (KIND_PART, KIND_END):
                parts.append(plain)
                total += len(plain)
                if kind == KIND_END:
                    return b"".join(parts)
                continue
            # Authenticated, but not a kind this build knows (or a MESSAGE inside a PART run).
            self.unknown_kinds += 1
            self.limiter.warn(
                "diagnostic",
                f"cluster: dropping an authenticated frame of unknown kind {kind} from {self.source}",
            )
            parts.clear()
            total = 0

    async def run(self, node: Node, deadline_s: float = 30.0) -> None:
        """Reader loop: decode each message and publish it with the peer's identity."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                payload = await self.recv_payload()
                try:
                    msg = decode(payload)
                except DecodeError as exc:
                    self.limiter.warn(
                        "diagnostic", f"cluster: undecodable message from {self.source}: {exc}"
                    )
                    continue
                await node.bus.publish(msg, source=self.source, deadline=loop.time() + deadline_s)
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

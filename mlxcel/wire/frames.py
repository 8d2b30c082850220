"""Frame protection after the handshake: ``[kind u8][len u32][ciphertext][16-byte tag]``.

Each direction has its own AES-256-GCM key (from the handshake's split). The 96-bit nonce
is an implicit counter (32 zero bits, then the frame's 64-bit big-endian sequence number):
never sent, never reused, never wrapped -- a direction that reaches the last counter value
fails closed. The 5-byte clear header is the associated data, so a receiver refuses an
oversize ``len`` from the header alone, before any allocation or decryption, and a flipped
header bit fails authentication.

Keys rotate by volume with Noise's REKEY (the first 32 bytes of encrypting 32 zero bytes at
nonce 2^64-1), deterministically on both sides: after ``rekey_bytes`` of payload (default
2^36 bytes = 64 GiB) or ``rekey_frames`` frames (default 2^32), whichever comes first. That
keeps each key far below AES-GCM's usage limits (about 2^35 16-byte blocks per key for a
2^-57 confidentiality advantage, and well inside the 2^64 nonce space).

Sealing writes header, ciphertext and tag into one preallocated buffer (``encrypt_into``);
opening decrypts into one (``decrypt_into``): no other payload copies.

The other suites here (unprotected, HMAC-SHA256, ChaCha20-Poly1305) exist for the frame
benchmark's comparison only; the cluster transport always uses AES-256-GCM.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from mlxcel.base.errors import (
    CounterExhausted,
    FrameAuthFailed,
    FrameTooLarge,
)

HEADER = struct.Struct("!BI")
HEADER_LEN = HEADER.size  # 5
TAG_LEN = 16
# A frame carries at most one 256 KiB record: a message above that travels as PART..END
# records, so a receiver never allocates more than this before a frame's tag is checked.
DEFAULT_MAX_FRAME = 256 << 10
# A reassembled message (and so the buffer a connection may grow) is capped separately.
DEFAULT_MAX_MESSAGE = 256 << 20
DEFAULT_REKEY_BYTES = 1 << 36
DEFAULT_REKEY_FRAMES = 1 << 32
LAST_COUNTER = 2**64 - 1  # reserved for REKEY, never a frame nonce

# Frame kinds. A message larger than one record travels as PART..., END. CONFIRM (empty) is
# the dialing side's first frame: it proves to the listener that the peer holds the session
# keys, which a replayed handshake message cannot.
KIND_MESSAGE = 0x01
KIND_PART = 0x02
KIND_END = 0x03
KIND_CONFIRM = 0x04
KIND_KEEPALIVE = 0x05  # empty; a side with nothing to say sends one so it is heard
KIND_PING = 0x06  # empty; asks the peer for a frame now (it answers with a KEEPALIVE)
KNOWN_KINDS = frozenset(
    {KIND_MESSAGE, KIND_PART, KIND_END, KIND_CONFIRM, KIND_KEEPALIVE, KIND_PING}
)


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "big")


def parse_header(
    header: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME
) -> tuple[int, int]:
    """(kind, payload length) from a 5-byte header; oversize lengths raise FrameTooLarge."""
    kind, length = HEADER.unpack(header)
    if length > max_frame:
        raise FrameTooLarge(f"frame announces {length} bytes, cap is {max_frame}")
    return kind, length


class _Direction:
    """Counter and rekey bookkeeping shared by both ends of one direction."""

    def __init__(self, key: bytes, rekey_bytes: int, rekey_frames: int) -> None:
        if len(key) != 32:
            raise ValueError("frame keys are 32 bytes")
        self.key = key
        self.n = 0
        self.rekey_bytes = rekey_bytes
        self.rekey_frames = rekey_frames
        self._bytes = 0
        self._frames = 0
        self.rekeys = 0
        self.aead = AESGCM(key)

    def next_nonce(self) -> bytes:
        if self.n >= LAST_COUNTER:
            raise CounterExhausted("frame counter exhausted; reconnect")
        return _nonce(self.n)

    def advance(self, nbytes: int) -> None:
        self.n += 1
        self._bytes += nbytes
        self._frames += 1
        if self._bytes >= self.rekey_bytes or self._frames >= self.rekey_frames:
            # Noise REKEY: k' = first 32 bytes of ENCRYPT(k, 2^64-1, "", 32 zero bytes).
            self.key = self.aead.encrypt(_nonce(LAST_COUNTER), b"\x00" * 32, b"")[:32]
            self.aead = AESGCM(self.key)
            self._bytes = 0
            self._frames = 0
            self.rekeys += 1


class FrameSealer:
    """The sending half of one direction."""

    def __init__(
        self,
        key: bytes,
        *,
        rekey_bytes: int = DEFAULT_REKEY_BYTES,
        rekey_frames: int = DEFAULT_REKEY_FRAMES,
    ) -> None:
        self._d = _Direction(key, rekey_bytes, rekey_frames)

    @property
    def counter(self) -> int:
        return self._d.n

    @property
    def rekeys(self) -> int:
        return self._d.rekeys

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray:
        """One frame, ready to write: header + ciphertext + tag in a single buffer."""
        n = len(payload)
        out = bytearray(HEADER_LEN + n + TAG_LEN)
        HEADER.pack_into(out, 0, kind, n)
        header = bytes(out[:HEADER_LEN])
        self._d.aead.encrypt_into(
            self._d.next_nonce(), payload, header, memoryview(out)[HEADER_LEN:]
        )
        self._d.advance(n)
        return out


class FrameOpener:
    """The receiving half of one direction. After any failure it stays failed."""

    def __init__(
        self,
        key: bytes,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        rekey_bytes: int = DEFAULT_REKEY_BYTES,
        rekey_frames: int = DEFAULT_REKEY_FRAMES,
    ) -> None:
        self._d = _Direction(key, rekey_bytes, rekey_frames)
        self.max_frame = max_frame
        self.failed = False

    @property
    def counter(self) -> int:
        return self._d.n

    @property
    def rekeys(self) -> int:
        return self._d.rekeys

    def header(self, header: bytes | bytearray | memoryview) -> tuple[int, int]:
        self._check()
        try:
            return parse_header(header, self.max_frame)
        except FrameTooLarge:
            self.failed = True
            raise

    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytearray:
        """Authenticate and decrypt ``body`` (ciphertext + tag) for ``header``."""
        self._check()
        kind, length = self.header(header)
        if len(body) != length + TAG_LEN:
            self.failed = True
            raise FrameAuthFailed(
                f"frame body is {len(body)} bytes, header says {length + TAG_LEN}"
            )
        out = bytearray(length)
        try:
            self._d.aead.decrypt_into(self._d.next_nonce(), body, bytes(header), out)
        except InvalidTag:
            self.failed = True
            raise FrameAuthFailed("frame failed authentication") from None
        self._d.advance(length)
        return out

    def _check(self) -> None:
        if self.failed:
            raise FrameAuthFailed("connection already failed")


# --- benchmark-only suites (same framing, other protection) ----------------------------------


class Protection(Protocol):
    """What a connection needs from its frame protection."""

    overhead: int

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray: ...
    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytes | bytearray: ...


class Unprotected:
    """Framing only: the baseline the protected suites are compared with."""

    overhead = 0

    def __init__(self, send_key: bytes = b"", recv_key: bytes = b"") -> None:
        pass

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray:
        out = bytearray(HEADER_LEN + len(payload))
        HEADER.pack_into(out, 0, kind, len(payload))
        out[HEADER_LEN:] = payload
        return out

    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytes | bytearray:
        return body


class HmacSha256:
    """Integrity only: HMAC-SHA256(counter || header || payload), tag truncated to 16 bytes."""

    overhead = TAG_LEN

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self.key = send_key
        self.recv_key = recv_key
        self.n_send = 0
        self.n_recv = 0

    def _tag(
        self, n: int, header: bytes, payload: bytes | bytearray | memoryview, key: bytes
    ) -> bytes:
        h = hmac.new(key, n.to_bytes(8, "big") + header, hashlib.sha256)
        h.update(payload)
        return h.digest()[:TAG_LEN]

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray:
        n = len(payload)
        out = bytearray(HEADER_LEN + n + TAG_LEN)
        HEADER.pack_into(out, 0, kind, n)
        out[HEADER_LEN : HEADER_LEN + n] = payload
        out[HEADER_LEN + n :] = self._tag(self.n_send, bytes(out[:HEADER_LEN]), payload, self.key)
        self.n_send += 1
        return out

    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytes | bytearray:
        mv = memoryview(body)
        payload, tag = mv[:-TAG_LEN], mv[-TAG_LEN:]
        if not hmac.compare_digest(
            self._tag(self.n_recv, bytes(header), payload, self.recv_key), tag
        ):
            raise FrameAuthFailed("HMAC does not verify")
        self.n_recv += 1
        return payload


class ChaChaSuite:
    """ChaCha20-Poly1305 with the same framing, nonces and associated data (benchmark only)."""

    overhead = TAG_LEN

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send = ChaCha20Poly1305(send_key)
        self._recv = ChaCha20Poly1305(recv_key)
        self.n_send = 0
        self.n_recv = 0

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray:
        n = len(payload)
        out = bytearray(HEADER_LEN + n + TAG_LEN)
        HEADER.pack_into(out, 0, kind, n)
        self._send.encrypt_into(
            _nonce(self.n_send), payload, bytes(out[:HEADER_LEN]), memoryview(out)[HEADER_LEN:]
        )
        self.n_send += 1
        return out

    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytes | bytearray:
        out = bytearray(len(body) - TAG_LEN)
        try:
            self._recv.decrypt_into(_nonce(self.n_recv), body, bytes(header), out)
        except InvalidTag:
            raise FrameAuthFailed("frame failed authentication") from None
        self.n_recv += 1
        return out


class AeadProtection:
    """Both directions of one connection: the cluster transport's frame protection."""

    overhead = TAG_LEN

    def __init__(
        self,
        send_key: bytes,
        recv_key: bytes,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        rekey_bytes: int = DEFAULT_REKEY_BYTES,
        rekey_frames: int = DEFAULT_REKEY_FRAMES,
    ) -> None:
        self.sealer = FrameSealer(send_key, rekey_bytes=rekey_bytes, rekey_frames=rekey_frames)
        self.opener = FrameOpener(
            recv_key, max_frame=max_frame, rekey_bytes=rekey_bytes, rekey_frames=rekey_frames
        )

    def seal(self, kind: int, payload: bytes | bytearray | memoryview) -> bytearray:
        return self.sealer.seal(kind, payload)

    def open(
        self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview
    ) -> bytes | bytearray:
        return self.opener.open(header, body)

"""The cluster handshake's fixed parts: constants, enums, identities, payload codecs, and the
replay guard -- everything the state machines in :mod:`mlxcel.wire.handshake` parse or build
(byte layouts in docs/wire-protocol.md). Pure: no I/O, no clock reads.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass

from mlxcel.base.errors import HandshakeError

MAGIC = b"MLXC"
PROTOCOL_VERSION = 2  # 2: timestamp in message 1, CONFIRM frame
SUITE_NNPSK0_AESGCM = 1  # Noise_NNpsk0_25519_AESGCM_SHA256 handshake + AES-256-GCM frames
PATTERN = "NNpsk0"
HANDSHAKE_TIMEOUT = 5.0
MAX_CLOCK_SKEW = 60.0  # seconds between two members' clocks that a handshake tolerates
MAX_HANDSHAKE_MESSAGE = 1024  # msg1 and msg2 are far smaller; anything bigger is junk

PREAMBLE = struct.Struct("!4sBBBB")  # magic, version, suite, channel, flags
FLAG_BUSY = 0x01  # server -> client, then close: the pending-handshake pool is full; retry
PREAMBLE_LEN = PREAMBLE.size  # 8
LEN = struct.Struct("!H")


class Channel(enum.IntEnum):
    TRANSPORT = 1
    ASSIGNMENT = 2
    TENSOR_PARALLEL = 3  # ranks meeting rank 0 before MLX's group forms (mlxcel.tp)


class Verdict(enum.IntEnum):
    ACCEPT = 0
    AT_CAPACITY = 1
    REFUSED_IDENTITY = 2
    REFUSED_STALE = 3  # message 1's timestamp is outside the server's window


class Failure(enum.Enum):
    """Why a handshake failed. ``rate_class`` says which warning budget reports it."""

    PROBE = "closed before sending anything"
    BAD_MAGIC = "not an mlxcel cluster connection (bad magic)"
    MALFORMED = "malformed handshake"
    VERSION_MISMATCH = "protocol version mismatch"
    SUITE_MISMATCH = "frame suite mismatch"
    CHANNEL_MISMATCH = "channel mismatch"
    SECRET_MISMATCH = "probable cluster secret mismatch"
    IDENTITY_NOT_OWNED = "advertised identity not owned by the connection's source"
    AT_CAPACITY = "server at capacity"
    VERDICT_FORGED = "verdict does not verify under the cluster secret"
    BUSY = "server's pending-handshake pool is full"
    TIMEOUT = "handshake timed out"
    CLOSED = "connection closed during the handshake"
    REPLAYED = "handshake message 1 replayed"
    CLOCK_SKEW = "handshake timestamp outside the clock-skew window"
    UNCONFIRMED = "peer did not prove it holds the session keys"

    @property
    def rate_class(self) -> str:
        if self in (
            Failure.SECRET_MISMATCH,
            Failure.IDENTITY_NOT_OWNED,
            Failure.SUITE_MISMATCH,
            Failure.VERSION_MISMATCH,
            Failure.CHANNEL_MISMATCH,
            Failure.VERDICT_FORGED,
            Failure.REPLAYED,
            Failure.CLOCK_SKEW,
            Failure.UNCONFIRMED,
        ):
            return "diagnostic"
        if self in (Failure.AT_CAPACITY, Failure.BUSY):
            return "at-capacity"
        return "noise"

    @property
    def retryable(self) -> bool:
        return self in (Failure.AT_CAPACITY, Failure.BUSY)


@dataclass(frozen=True, slots=True)
class Identity:
    """A node's advertised listener address plus its node id."""

    host: str
    port: int
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Established:
    """Handshake done: the peer's bound identity and the two directional frame keys."""

    peer: Identity
    send_key: bytes
    recv_key: bytes
    handshake_hash: bytes


def derive_psk(secret: bytes) -> bytes:
    """The 32-byte Noise PSK from a cluster secret of any length (>= 16 bytes)."""
    return hmac.digest(b"mlxcel cluster psk v1", secret, hashlib.sha256)


def preamble(
    channel: Channel,
    version: int = PROTOCOL_VERSION,
    suite: int = SUITE_NNPSK0_AESGCM,
    flags: int = 0,
) -> bytes:
    return PREAMBLE.pack(MAGIC, version, suite, int(channel), flags)


def busy_preamble(channel: Channel) -> bytes:
    """What a listener whose pending pool is full sends before closing. It is cleartext, so
    a forgery can only make a client retry -- the safe direction."""
    return preamble(channel, flags=FLAG_BUSY)


def encode_identity(ident: Identity) -> bytes:
    host = ident.host.encode("ascii")
    node = ident.node_id.encode("utf-8")
    if len(host) > 255 or len(node) > 255 or not 0 <= ident.port <= 65535:
        raise ValueError("identity too long or port out of range")
    return bytes([len(host)]) + host + ident.port.to_bytes(2, "big") + bytes([len(node)]) + node


def decode_identity(data: bytes) -> Identity:
    try:
        hl = data[0]
        host = data[1 : 1 + hl].decode("ascii")
        port = int.from_bytes(data[1 + hl : 3 + hl], "big")
        nl = data[3 + hl]
        node = data[4 + hl : 4 + hl + nl].decode("utf-8")
        if len(data) != 4 + hl + nl or len(host) != hl:
            raise ValueError("length mismatch")
    except (IndexError, ValueError, UnicodeDecodeError):
        raise HandshakeError(Failure.MALFORMED, "malformed identity payload") from None
    return Identity(host, port, node)


TIMESTAMP = struct.Struct("!QI")  # Unix seconds, nanoseconds


def encode_hello(ident: Identity, wall: float) -> bytes:
    """Message 1's payload: the identity, then the client's wall-clock time."""
    secs = int(wall)
    nanos = min(999_999_999, max(0, int(round((wall - secs) * 1e9))))
    return encode_identity(ident) + TIMESTAMP.pack(secs, nanos)


def decode_hello(data: bytes) -> tuple[Identity, float]:
    if len(data) < TIMESTAMP.size:
        raise HandshakeError(Failure.MALFORMED, "message 1 payload has no timestamp")
    secs, nanos = TIMESTAMP.unpack(data[-TIMESTAMP.size :])
    if nanos > 999_999_999:
        raise HandshakeError(Failure.MALFORMED, "message 1 timestamp out of range")
    return decode_identity(data[: -TIMESTAMP.size]), secs + nanos / 1e9


class ReplayGuard:
    """Remembers every message 1 accepted inside the clock-skew window (sans-I/O).

    A message 1 is identified by the client's ephemeral public key (its first 32 bytes): fresh
    per handshake, so a duplicate is a replay. Entries expire once their timestamp has left
    the window, after which the timestamp check alone refuses them. Only messages that
    decrypted under the secret are recorded, so an outsider cannot fill it; ``max_entries``
    bounds it anyway (oldest first out).
    """

    def __init__(
        self,
        max_skew: float = MAX_CLOCK_SKEW,
        max_entries: int = 1 << 16,
        hold: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.max_skew = max_skew
        # Entries outlive the window by one handshake timeout: a connection accepted just
        # inside the window (its clock read at accept) may process its message 1 that much
        # later, and must still find the entry.
        self.hold = hold
        self.max_entries = max_entries
        self._seen: dict[bytes, float] = {}  # ephemeral key -> expiry (wall clock)
        self.replays = 0
        self.stale = 0

    @property
    def remembered(self) -> list[bytes]:
        """The ephemeral keys it remembers now, oldest first."""
        return list(self._seen)

    def check(self, ephemeral: bytes, stamp: float, wall_now: float) -> Failure | None:
        """None to go on; CLOCK_SKEW or REPLAYED to refuse. Records the message if fresh."""
        while self._seen:  # insertion order ~ expiry order: stop at the first live entry
            key, expiry = next(iter(self._seen.items()))
            if expiry > wall_now and len(self._seen) < self.max_entries:
                break
            del self._seen[key]
        if abs(stamp - wall_now) > self.max_skew:
            self.stale += 1
            return Failure.CLOCK_SKEW
        if ephemeral in self._seen:
            self.replays += 1
            return Failure.REPLAYED
        self._seen[ephemeral] = stamp + self.max_skew + self.hold
        return None


def encode_verdict(verdict: Verdict, text: str = "") -> bytes:
    raw = text.encode("utf-8")[:255]
    return bytes([int(verdict), len(raw)]) + raw


def decode_verdict(data: bytes) -> tuple[Verdict, str]:
    try:
        verdict = Verdict(data[0])
        n = data[1]
        text = data[2 : 2 + n].decode("utf-8")
        if len(data) != 2 + n:
            raise ValueError
    except (IndexError, ValueError, UnicodeDecodeError):
        raise HandshakeError(Failure.MALFORMED, "malformed verdict payload") from None
    return verdict, text


def source_key(ip: str) -> str:
    """Per-source budget key: an IPv4 address, or the /64 of an IPv6 address."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)

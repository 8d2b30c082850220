"""The cluster handshake, sans-I/O: bytes and ``now`` in; bytes, events and a deadline out.

Wire flow (byte layouts in docs/wire-protocol.md)::

    client -> server   preamble(8) || u16 len || Noise msg1  (psk, e  + payload: identity, time)
    server -> client   preamble(8) || u16 len || Noise msg2  (e, ee   + payload: verdict)
    client -> server   first frame: CONFIRM (empty, sealed with the new keys)

Message 1 carries the client's wall-clock time. The server refuses a message 1 whose time is
more than ``max_skew`` from its own (answering an authenticated *stale* verdict), and closes
without answering one it has already seen inside that window (:class:`ReplayGuard`): a
recorded message 1 can be replayed neither later nor now. Until the client's CONFIRM frame
opens under the session keys -- which only the holder of the client's ephemeral private key
can produce -- the listener counts the connection as pending, not authenticated.

The preamble (magic, protocol version, frame suite, channel) is cleartext and fixed-size;
a server that does not speak the client's preamble answers with its own preamble alone and
closes, so both sides can report both versions. The common preamble is the Noise prologue,
so nothing in it can be changed undetected. The handshake is
``Noise_NNpsk0_25519_AESGCM_SHA256``: msg1 proves the client holds the cluster secret (its
payload only decrypts under the PSK), msg2 proves the server does, and the ephemeral DH gives
forward secrecy -- a later leak of the secret does not decrypt recorded traffic.

The client's payload carries its advertised listener identity and node id; the server binds
the identity to the TCP source IP (an unspecified IP is replaced by the source) and refuses a
mismatch *inside* msg2, so the refusal is authenticated. The verdict (accept, at-capacity,
refused) is encrypted and authenticated too: nobody on the path can turn one into another.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import struct
from collections.abc import Callable
from dataclasses import dataclass

from mlxcel.wire.noise import DecryptFailed, HandshakeState, NoiseError

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


class HandshakeError(Exception):
    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


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


class _Side:
    def __init__(self, channel: Channel, now: float, timeout: float) -> None:
        self.channel = channel
        self.deadline = now + timeout
        self._out = bytearray()
        self._in = bytearray()
        self.result: Established | None = None
        self.error: HandshakeError | None = None
        self.received_any = False

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; results appear in ``result``/``error``/``data_to_send``."""
        if self.finished:
            return
        self.received_any = self.received_any or bool(data)
        self._in += data
        try:
            self._advance()
        except HandshakeError as exc:
            self._fail(exc.failure, str(exc))

    def _advance(self) -> None:
        raise NotImplementedError

    def data_to_send(self) -> bytes:
        out, self._out = bytes(self._out), bytearray()
        return out

    def get_timer(self) -> float | None:
        return None if self.finished else self.deadline

    def handle_timer(self, now: float) -> None:
        if not self.finished and now >= self.deadline:
            self._fail(Failure.TIMEOUT, "handshake did not finish within its deadline")

    def _fail(self, failure: Failure, message: str) -> None:
        if self.error is None and self.result is None:
            self.error = HandshakeError(failure, message)

    def _take_message(self) -> bytes | None:
        if len(self._in) < LEN.size:
            return None
        (n,) = LEN.unpack_from(self._in)
        if n > MAX_HANDSHAKE_MESSAGE:
            raise HandshakeError(Failure.MALFORMED, f"handshake message of {n} bytes")
        if len(self._in) < LEN.size + n:
            return None
        msg = bytes(self._in[LEN.size : LEN.size + n])
        del self._in[: LEN.size + n]
        return msg


def _preamble_mismatch(mine: bytes, theirs: bytes, *, we_dialed: bool) -> HandshakeError:
    """The typed refusal for a preamble that differs from ours, naming both sides' values."""
    _, mv, ms, mc, _ = PREAMBLE.unpack(mine)
    _, v, s, c, _ = PREAMBLE.unpack(theirs)
    if v != mv:
        text = (
            f"this node speaks v{mv}, the server v{v}"
            if we_dialed
            else f"peer speaks v{v}, this node v{mv}"
        )
        return HandshakeError(Failure.VERSION_MISMATCH, f"protocol version mismatch: {text}")
    if s != ms:
        text = (
            f"this node uses suite {ms}, the server suite {s}"
            if we_dialed
            else f"peer uses suite {s}, this node suite {ms}"
        )
        return HandshakeError(Failure.SUITE_MISMATCH, f"frame suite mismatch: {text}")
    text = (
        f"this node dialed channel {mc}, the server serves {c}"
        if we_dialed
        else f"peer dialed channel {c}, this listener serves {mc}"
    )
    return HandshakeError(Failure.CHANNEL_MISMATCH, f"channel mismatch: {text}")


class ClientHandshake(_Side):
    """The connecting side. ``start`` queues preamble + msg1; feed replies to ``receive_data``."""

    def __init__(
        self,
        secret: bytes,
        identity: Identity,
        channel: Channel,
        now: float,
        random_bytes: Callable[[int], bytes],
        *,
        wall: float,
        timeout: float = HANDSHAKE_TIMEOUT,
        version: int = PROTOCOL_VERSION,
        suite: int = SUITE_NNPSK0_AESGCM,
    ) -> None:
        super().__init__(channel, now, timeout)
        self.identity = identity
        self.preamble = preamble(channel, version, suite)
        self._hs = HandshakeState(
            PATTERN, True, self.preamble, psk=derive_psk(secret), random_bytes=random_bytes
        )
        self._got_preamble = False
        msg1 = self._hs.write_message(encode_hello(identity, wall))
        self._out += self.preamble + LEN.pack(len(msg1)) + msg1

    def _advance(self) -> None:
        if not self._got_preamble:
            if len(self._in) < PREAMBLE_LEN:
                return
            theirs = bytes(self._in[:PREAMBLE_LEN])
            del self._in[:PREAMBLE_LEN]
            if theirs[:4] != MAGIC:
                raise HandshakeError(
                    Failure.BAD_MAGIC, "server is not an mlxcel cluster endpoint (bad magic)"
                )
            if theirs[7] & FLAG_BUSY:
                raise HandshakeError(
                    Failure.BUSY,
                    "server's pending-handshake pool is full (many unfinished handshakes, "
                    "perhaps a flood); retrying",
                )
            if theirs != self.preamble:
                raise _preamble_mismatch(self.preamble, theirs, we_dialed=True)
            self._got_preamble = True
        msg2 = self._take_message()
        if msg2 is None:
            return
        if self._in:
            raise HandshakeError(Failure.MALFORMED, "bytes after the server's handshake message")
        try:
            payload = self._hs.read_message(msg2)
        except DecryptFailed:
            raise HandshakeError(
                Failure.VERDICT_FORGED,
                "server's handshake verdict does not verify under the cluster secret",
            ) from None
        except NoiseError as exc:
            raise HandshakeError(Failure.MALFORMED, f"server handshake message: {exc}") from None
        verdict, text = decode_verdict(payload)
        if verdict is Verdict.AT_CAPACITY:
            raise HandshakeError(
                Failure.AT_CAPACITY,
                "server authenticated this node but refused the connection: it already "
                "holds its maximum number of authenticated connections; retry later",
            )
        if verdict is Verdict.REFUSED_IDENTITY:
            raise HandshakeError(
                Failure.IDENTITY_NOT_OWNED,
                f"server refused this node's advertised identity {self.identity.address}: the "
                "advertised IP must be the address the server sees this connection come from",
            )
        if verdict is Verdict.REFUSED_STALE:
            raise HandshakeError(
                Failure.CLOCK_SKEW,
                f"server refused this node's handshake time: the two clocks differ by more "
                f"than {text or 'the allowed skew'}; synchronise them (NTP)",
            )
        c1, c2 = self._hs.split()
        assert c1.k is not None and c2.k is not None
        self.result = Established(Identity("", 0, text), c1.k, c2.k, self._hs.handshake_hash)

    def connection_lost(self) -> None:
        """The server closed (or reset) the connection before the handshake finished."""
        if self.finished:
            return
        if not self.received_any:
            self._fail(
                Failure.SECRET_MISMATCH,
                "server closed the connection after this node's first handshake message without "
                "answering: its authenticator does not verify under the configured cluster secret "
                "(secret mismatch)",
            )
        else:
            self._fail(Failure.CLOSED, "server closed the connection during the handshake")


class ServerHandshake(_Side):
    """The accepting side. ``admit(identity) -> Verdict`` decides capacity after authentication."""

    def __init__(
        self,
        secret: bytes,
        channel: Channel,
        source_ip: str,
        now: float,
        random_bytes: Callable[[int], bytes],
        admit: Callable[[Identity], Verdict],
        *,
        wall: float,
        replay: ReplayGuard,
        node_id: str = "",
        timeout: float = HANDSHAKE_TIMEOUT,
        version: int = PROTOCOL_VERSION,
        suite: int = SUITE_NNPSK0_AESGCM,
    ) -> None:
        super().__init__(channel, now, timeout)
        self.wall = wall
        self.replay = replay
        self.preamble = preamble(channel, version, suite)
        self.source_ip = source_ip
        self.node_id = node_id
        self._admit = admit
        self._psk = derive_psk(secret)
        self._random = random_bytes
        self._got_preamble = False
        self.close_after_send = False
        self.verdict: Verdict | None = None
        self.peer: Identity | None = None

    def _advance(self) -> None:
        if not self._got_preamble:
            if len(self._in) < PREAMBLE_LEN:
                if self._in and not MAGIC.startswith(bytes(self._in[:4])):
                    raise HandshakeError(Failure.BAD_MAGIC, "bad magic")
                return
            theirs = bytes(self._in[:PREAMBLE_LEN])
            del self._in[:PREAMBLE_LEN]
            if theirs[:4] != MAGIC:
                raise HandshakeError(Failure.BAD_MAGIC, "bad magic")
            if theirs != self.preamble:
                # Answer with our own preamble so the client can name both versions, then close.
                self._out += self.preamble
                self.close_after_send = True
                raise _preamble_mismatch(self.preamble, theirs, we_dialed=False)
            self._got_preamble = True
        msg1 = self._take_message()
        if msg1 is None:
            return
        if self._in:
            raise HandshakeError(Failure.MALFORMED, "bytes after the client's handshake message")
        hs = HandshakeState(PATTERN, False, self.preamble, psk=self._psk, random_bytes=self._random)
        try:
            payload = hs.read_message(msg1)
        except DecryptFailed:
            raise HandshakeError(
                Failure.SECRET_MISMATCH,
                "client's handshake message does not verify under the cluster secret "
                "(probable secret mismatch)",
            ) from None
        except NoiseError as exc:
            raise HandshakeError(Failure.MALFORMED, f"client handshake message: {exc}") from None
        claimed, stamp = decode_hello(payload)
        problem = self.replay.check(msg1[:32], stamp, self.wall)
        if problem is Failure.REPLAYED:
            # Seen inside the window: a recording. No answer, no state, no slot.
            raise HandshakeError(
                Failure.REPLAYED,
                f"handshake message 1 from {self.source_ip} was already used "
                f"(claims {claimed.address}): a replay",
            )
        bound = self._bind(claimed)
        text = self.node_id
        if problem is Failure.CLOCK_SKEW:
            verdict = Verdict.REFUSED_STALE
            text = f"{self.replay.max_skew:g}s"
        elif bound is None:
            verdict = Verdict.REFUSED_IDENTITY
        else:
            verdict = self._admit(bound)
        msg2 = hs.write_message(encode_verdict(verdict, text))
        self._out += self.preamble + LEN.pack(len(msg2)) + msg2
        self.verdict = verdict
        if verdict is Verdict.REFUSED_IDENTITY:
            self.close_after_send = True
            raise HandshakeError(
                Failure.IDENTITY_NOT_OWNED,
                f"refusing to bind a listener address the peer does not own: it claims "
                f"{claimed.address} but connects from {self.source_ip}",
            )
        if verdict is Verdict.REFUSED_STALE:
            self.close_after_send = True
            raise HandshakeError(
                Failure.CLOCK_SKEW,
                f"handshake from {self.source_ip} (claims {claimed.address}) is stamped "
                f"{stamp - self.wall:+.0f}s from this node's clock (allowed: "
                f"{self.replay.max_skew:g}s): clock skew, or an old recording replayed",
            )
        if verdict is Verdict.AT_CAPACITY:
            self.close_after_send = True
            raise HandshakeError(Failure.AT_CAPACITY, "max connections reached")
        assert bound is not None
        c1, c2 = hs.split()
        assert c1.k is not None and c2.k is not None
        self.peer = bound
        self.result = Established(bound, c2.k, c1.k, hs.handshake_hash)

    def _bind(self, claimed: Identity) -> Identity | None:
        """The identity with an unspecified IP replaced by the source; None if not owned."""
        try:
            addr = ipaddress.ip_address(claimed.host)
            src = ipaddress.ip_address(self.source_ip.split("%")[0])
        except ValueError:
            # Not a socket address at all: no mlxcel client sends this; close without a verdict.
            raise HandshakeError(
                Failure.MALFORMED, "advertised identity is not an IP address"
            ) from None
        if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped is not None:
            src = src.ipv4_mapped
        if addr.is_unspecified:
            return Identity(str(src), claimed.port, claimed.node_id)
        if addr != src:
            return None
        return Identity(str(addr), claimed.port, claimed.node_id)

    def connection_lost(self) -> None:
        if self.finished:
            return
        if not self.received_any:
            self._fail(Failure.PROBE, "peer connected and closed without sending anything")
        else:
            self._fail(Failure.CLOSED, "peer closed the connection during the handshake")

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

import ipaddress
from collections.abc import Callable

from mlxcel.base.errors import DecryptFailed, HandshakeError, NoiseError
from mlxcel.wire.handshake_fields import (
    FLAG_BUSY,
    HANDSHAKE_TIMEOUT,
    LEN,
    MAGIC,
    MAX_CLOCK_SKEW,
    MAX_HANDSHAKE_MESSAGE,
    PATTERN,
    PREAMBLE,
    PREAMBLE_LEN,
    PROTOCOL_VERSION,
    SUITE_NNPSK0_AESGCM,
    TIMESTAMP,
    Channel,
    Established,
    Failure,
    Identity,
    ReplayGuard,
    Verdict,
    busy_preamble,
    decode_hello,
    decode_identity,
    decode_verdict,
    derive_psk,
    encode_hello,
    encode_identity,
    encode_verdict,
    preamble,
    source_key,
)
from mlxcel.wire.noise import HandshakeState

# The fixed parts live in handshake_fields; importers keep using this module for all of them.
__all__ = [
    "Channel",
    "ClientHandshake",
    "Established",
    "FLAG_BUSY",
    "Failure",
    "HANDSHAKE_TIMEOUT",
    "HandshakeError",
    "Identity",
    "LEN",
    "MAGIC",
    "MAX_CLOCK_SKEW",
    "MAX_HANDSHAKE_MESSAGE",
    "PATTERN",
    "PREAMBLE",
    "PREAMBLE_LEN",
    "PROTOCOL_VERSION",
    "ReplayGuard",
    "SUITE_NNPSK0_AESGCM",
    "ServerHandshake",
    "TIMESTAMP",
    "Verdict",
    "busy_preamble",
    "decode_hello",
    "decode_identity",
    "decode_verdict",
    "derive_psk",
    "encode_hello",
    "encode_identity",
    "encode_verdict",
    "preamble",
    "source_key",
]


class _Side:
    def __init__(self, channel: Channel, now: float, timeout: float) -> None:
        self.channel = channel
        self.deadline = now + timeout
        self._out = bytearray()
        self._in = bytearray()
        self.result: Established | None = None
        self.error: HandshakeError | None = None
        self.received_any = False
        self._got_preamble = False

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def bytes_needed(self) -> int:
        """How many more bytes the machine can use now (0 once finished). The handshake's
        last message is followed by nothing the peer may send before it has answered (the
        client cannot seal CONFIRM before message 2; the server sends no frame before it), so
        bytes beyond it are refused as malformed: an I/O layer reads exactly this many and
        leaves the first frame for the frame stream."""
        if self.finished:
            return 0
        buf = self._in
        if not self._got_preamble:
            return PREAMBLE_LEN - len(buf)
        if len(buf) < LEN.size:
            return LEN.size - len(buf)
        (n,) = LEN.unpack_from(buf)
        return max(1, LEN.size + n - len(buf))

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

    def next_timer(self) -> float | None:
        return None if self.finished else self.deadline

    def on_timer(self, now: float) -> None:
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

"""Discovery beacons, sans-I/O: build a signed beacon, and judge one that arrived.

A peer announces its assignment listener once a second over UDP. The beacon (a CBOR
:class:`~mlxcel.base.messages.Beacon`) carries the mlxcel version, the advertised address, the
peer's wall-clock time and a random nonce, plus an HMAC-SHA256 over the encoding of all of
them under a key derived from the cluster secret (HKDF, its own info string, so it shares no
key with any connection). :class:`BeaconGate` checks, MAC first so that nobody without the
secret learns anything from the order of refusals: the MAC, the clock skew (60 s), a replay
of a nonce inside that window, the version, and that the advertised IP is the datagram's
source. The address names a concrete IP -- a peer listening on 0.0.0.0 announces the address
its beacons leave from -- so a beacon replayed from anywhere else is refused, whether or not
this coordinator saw the original. Beacons of another cluster name are set aside (a shared
network may carry several clusters). Payloads are readable: a beacon hides nothing, it only
cannot be forged, replayed or redirected.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mlxcel.base.errors import BeaconRejected, DecodeError
from mlxcel.base.messages import Beacon
from mlxcel.bringup.protocol import Rejection
from mlxcel.net.network import split_hostport
from mlxcel.wire.codec import decode, encode

BEACON_PORT = 49555
BEACON_INTERVAL = 1.0  # seconds between a peer's beacons
MAX_BEACON_SKEW = 60.0  # seconds a beacon's clock may differ from ours; also the replay window
MAX_BEACON_BYTES = 1024  # larger datagrams are not beacons
NONCE_BYTES = 16
MAX_REMEMBERED = 4096  # nonces kept for replay detection (about 68 peers at one per second)


def beacon_key(secret: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"mlxcel-discovery-beacon-v1").derive(secret)


def _mac(key: bytes, unsigned: Beacon) -> bytes:
    h = HMAC(key, hashes.SHA256())
    h.update(encode(unsigned))
    return h.finalize()


def _prefix() -> bytes:
    sample = encode(Beacon("v", "c", "a", 0.0, b""))
    return sample[: sample.index(b"gversion")]  # the map header and the kind: always the same


BEACON_PREFIX = _prefix()


def looks_like_beacon(datagram: bytes) -> bool:
    """A test that costs nothing next to a MAC: the size and the first bytes of a beacon."""
    return len(datagram) <= MAX_BEACON_BYTES and datagram.startswith(BEACON_PREFIX)


def make_beacon(
    key: bytes, version: str, cluster: str, address: str, wall: float, nonce: bytes
) -> bytes:
    """The datagram a peer sends (``nonce``: fresh random bytes for every beacon)."""
    unsigned = Beacon(version, cluster, address, wall, nonce)
    return encode(replace(unsigned, mac=_mac(key, unsigned)))


class BeaconGate:
    """The coordinator's judge of beacons. ``check`` returns the peer's address (IP:port)."""

    def __init__(
        self,
        key: bytes,
        version: str,
        cluster: str = "mlxcel-cluster",
        max_skew: float = MAX_BEACON_SKEW,
        remember: int = MAX_REMEMBERED,
    ) -> None:
        self.key = key
        self.version = version
        self.cluster = cluster
        self.max_skew = max_skew
        self.remember = remember
        self._seen: dict[bytes, float] = {}  # nonce -> when (our wall clock) it may be forgotten
        self.rejected: dict[Rejection, int] = dict.fromkeys(Rejection, 0)
        self.rejected_from: Counter[str] = Counter()  # by source IP (the first 4,096 sources)

    def check(self, datagram: bytes, source_ip: str, wall: float) -> str:
        try:
            return self._check(datagram, source_ip, wall)
        except BeaconRejected as exc:
            self.rejected[exc.why] += 1
            counted = source_ip in self.rejected_from or len(self.rejected_from) < self.remember
            if counted and exc.why is not Rejection.CLUSTER:  # another cluster is no anomaly
                self.rejected_from[source_ip] += 1
            raise

    def _check(self, datagram: bytes, source_ip: str, wall: float) -> str:
        if len(datagram) > MAX_BEACON_BYTES:
            raise BeaconRejected(Rejection.MALFORMED, f"from {source_ip}: {len(datagram)} bytes")
        try:
            msg = decode(datagram)
        except DecodeError as exc:
            raise BeaconRejected(Rejection.MALFORMED, f"from {source_ip}: {exc}") from None
        if not isinstance(msg, Beacon):
            raise BeaconRejected(
                Rejection.MALFORMED, f"from {source_ip}: a {type(msg).__name__} message"
            )
        h = HMAC(self.key, hashes.SHA256())
        h.update(encode(replace(msg, mac=b"")))
        try:
            h.verify(msg.mac)
        except InvalidSignature:
            raise BeaconRejected(Rejection.BAD_MAC, f"from {source_ip}") from None
        if not abs(msg.timestamp - wall) <= self.max_skew:  # also refuses NaN
            raise BeaconRejected(
                Rejection.SKEW, f"from {source_ip}: {msg.timestamp - wall:+.0f} s off this clock"
            )
        self._forget(wall)
        if msg.nonce in self._seen:
            raise BeaconRejected(Rejection.REPLAY, f"from {source_ip}")
        if len(self._seen) >= self.remember:
            raise BeaconRejected(Rejection.FULL, f"from {source_ip}")
        # Remembered until its timestamp leaves the window on either side.
        self._seen[msg.nonce] = max(wall, msg.timestamp) + 2 * self.max_skew
        if msg.version != self.version:
            raise BeaconRejected(
                Rejection.VERSION,
                f"{source_ip} runs mlxcel {msg.version}, this node {self.version}",
            )
        try:
            host, port = split_hostport(msg.address)
            if not 0 < port <= 65535:
                raise ValueError(msg.address)
            advertised = ipaddress.ip_address(host)
            source = ipaddress.ip_address(source_ip)
        except ValueError:
            raise BeaconRejected(Rejection.ADDRESS, f"{msg.address!r} is not IP:PORT") from None
        if advertised != source:
            raise BeaconRejected(
                Rejection.ADDRESS, f"advertises {msg.address} but was sent from {source_ip}"
            )
        if msg.cluster != self.cluster:
            raise BeaconRejected(
                Rejection.CLUSTER,
                f"{source_ip} is in cluster {msg.cluster!r}, not {self.cluster!r}",
            )
        return f"[{source}]:{port}" if source.version == 6 else f"{source}:{port}"

    def _forget(self, wall: float) -> None:
        if len(self._seen) > self.remember // 2:
            self._seen = {n: t for n, t in self._seen.items() if t > wall}

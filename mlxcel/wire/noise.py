"""The Noise Protocol Framework pieces mlxcel uses: 25519, AESGCM, SHA256; NN-family patterns.

Written from the Noise specification (revision 34) on top of ``cryptography``'s X25519, HMAC
and AESGCM. Pure: no sockets, no clock, no global randomness (ephemeral keys are injected).
Conformance is checked against the cacophony vectors for ``NN``, ``NNpsk0`` and ``NNpsk2``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from mlxcel.base.errors import DecryptFailed, NoiseError

HASHLEN = 32
DHLEN = 32
TAGLEN = 16
MAX_NONCE = 2**64 - 1  # reserved by Noise for REKEY; never used for a message

# Message patterns: tokens per message, initiator first.
PATTERNS: dict[str, list[list[str]]] = {
    "NN": [["e"], ["e", "ee"]],
    "NNpsk0": [["psk", "e"], ["e", "ee"]],
    "NNpsk2": [["e"], ["e", "ee", "psk"]],
}


def nonce_bytes(n: int) -> bytes:
    """AESGCM nonce for counter ``n``: 32 zero bits, then ``n`` as a big-endian 64-bit integer."""
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "big")


def hkdf(ck: bytes, ikm: bytes, outputs: int) -> list[bytes]:
    temp = hmac.digest(ck, ikm, "sha256")
    out: list[bytes] = []
    prev = b""
    for i in range(1, outputs + 1):
        prev = hmac.digest(temp, prev + bytes([i]), "sha256")
        out.append(prev)
    return out


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class CipherState:
    """A key plus a 64-bit counter nonce (AESGCM)."""

    def __init__(self, key: bytes | None = None, n: int = 0) -> None:
        self.k = key
        self.n = n
        self._aead = AESGCM(key) if key is not None else None

    def has_key(self) -> bool:
        return self.k is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce space exhausted")
        out = self._aead.encrypt(nonce_bytes(self.n), plaintext, ad)
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self._aead is None:
            return ciphertext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce space exhausted")
        try:
            out = self._aead.decrypt(nonce_bytes(self.n), ciphertext, ad)
        except InvalidTag:
            raise DecryptFailed("authentication tag does not verify") from None
        self.n += 1
        return out


class SymmetricState:
    def __init__(self, protocol_name: bytes) -> None:
        if len(protocol_name) <= HASHLEN:
            self.h = protocol_name.ljust(HASHLEN, b"\x00")
        else:
            self.h = hashlib.sha256(protocol_name).digest()
        self.ck = self.h
        self.cs = CipherState()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = hkdf(self.ck, ikm, 2)
        self.cs = CipherState(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.cs = CipherState(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = self.cs.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        pt = self.cs.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[bytes, bytes]:
        k1, k2 = hkdf(self.ck, b"", 2)
        return k1, k2


class HandshakeState:
    """One side of an NN-family handshake. Call write/read alternately, then ``split``."""

    def __init__(
        self,
        pattern: str,
        initiator: bool,
        prologue: bytes,
        *,
        psk: bytes | None = None,
        ephemeral: bytes | None = None,
        random_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unsupported pattern {pattern}")
        self.messages = PATTERNS[pattern]
        self.psk_mode = pattern.startswith("NNpsk")
        if self.psk_mode and (psk is None or len(psk) != 32):
            raise ValueError("a psk pattern needs a 32-byte psk")
        if ephemeral is None:
            if random_bytes is None:
                raise ValueError("inject either an ephemeral key or a random source")
            ephemeral = random_bytes(32)
        self.name = f"Noise_{pattern}_25519_AESGCM_SHA256".encode()
        self.ss = SymmetricState(self.name)
        self.ss.mix_hash(prologue)
        self.initiator = initiator
        self.psk = psk
        self.e = X25519PrivateKey.from_private_bytes(ephemeral)
        self.re: bytes | None = None
        self.index = 0

    @property
    def handshake_hash(self) -> bytes:
        return self.ss.h

    @property
    def done(self) -> bool:
        return self.index >= len(self.messages)

    def _my_turn(self) -> bool:
        return (self.index % 2 == 0) == self.initiator

    def write_message(self, payload: bytes) -> bytes:
        if self.done or not self._my_turn():
            raise NoiseError("not this side's turn to write")
        out = bytearray()
        for token in self.messages[self.index]:
            if token == "e":
                pub = public_bytes(self.e)
                out += pub
                self.ss.mix_hash(pub)
                if self.psk_mode:
                    self.ss.mix_key(pub)
            elif token == "ee":
                self.ss.mix_key(self._dh())
            elif token == "psk":
                assert self.psk is not None
                self.ss.mix_key_and_hash(self.psk)
        out += self.ss.encrypt_and_hash(payload)
        self.index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        if self.done or self._my_turn():
            raise NoiseError("not this side's turn to read")
        rest = message
        for token in self.messages[self.index]:
            if token == "e":
                if len(rest) < DHLEN:
                    raise NoiseError("handshake message too short")
                self.re, rest = rest[:DHLEN], rest[DHLEN:]
                self.ss.mix_hash(self.re)
                if self.psk_mode:
                    self.ss.mix_key(self.re)
            elif token == "ee":
                self.ss.mix_key(self._dh())
            elif token == "psk":
                assert self.psk is not None
                self.ss.mix_key_and_hash(self.psk)
        if self.ss.cs.has_key() and len(rest) < TAGLEN:
            raise NoiseError("handshake message too short")
        payload = self.ss.decrypt_and_hash(rest)
        self.index += 1
        return payload

    def _dh(self) -> bytes:
        assert self.re is not None
        try:
            return self.e.exchange(X25519PublicKey.from_public_bytes(self.re))
        except ValueError:  # all-zero shared secret: a low-order point
            raise NoiseError("peer ephemeral key is a low-order point") from None

    def split(self) -> tuple[CipherState, CipherState]:
        """(initiator->responder, responder->initiator) cipher states."""
        if not self.done:
            raise NoiseError("handshake not finished")
        k1, k2 = self.ss.split()
        return CipherState(k1), CipherState(k2)

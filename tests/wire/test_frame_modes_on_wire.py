"""Each frame-protection mode is what it says on the wire (captured by a relay on a real socket).

The frame benchmark compares these modes; this proves the bytes differ the way the modes do:
unprotected frames carry the payload in the clear, HMAC frames carry it in the clear plus a
verifying tag, and the AEAD modes carry ciphertext that opens only under their own cipher.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from mlxcel.bench.frames import MODES
from mlxcel.net.connection import SecureConnection
from mlxcel.net.listener import ClusterListener
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.reactor.bus import Node
from mlxcel.wire.frames import HEADER, HEADER_LEN, KIND_MESSAGE, TAG_LEN, Protection
from mlxcel.wire.handshake import Identity
from tests.wiretap import WireTap

SECRET = ClusterSecret(b"frame-mode-wire-test-secret-0001", "test")
MARKER = b"MLXCEL-CLEARTEXT-MARKER:"
NONCE1 = (1).to_bytes(12, "big")  # the payload is the 2nd frame: CONFIRM used counter 0


async def _capture(mode: str) -> tuple[bytes, bytes, bytes]:
    """Send one payload client -> server through a relay; (frame bytes, payload, client send key)."""
    factory = MODES[mode]
    keys: list[tuple[bytes, bytes]] = []

    def recording(make: Callable[[bytes, bytes], Protection]) -> Callable[..., Protection]:
        def build(send: bytes, recv: bytes) -> Protection:
            keys.append((send, recv))
            return make(send, recv)

        return build

    payload = MARKER * 200
    async with Node("wire-modes") as node:
        inbound: asyncio.Queue[SecureConnection] = asyncio.Queue()
        listener = ClusterListener(
            node,
            SECRET,
            "127.0.0.3",
            0,
            publish=False,
            protection=recording(factory),
            on_connection=inbound.put_nowait,
        )
        port = await listener.start()
        tap = WireTap("127.0.0.4", ("127.0.0.3", port), bind_ip="127.0.0.5")
        tap_port = await tap.start()
        pool = ConnectionPool(
            node,
            SECRET,
            Identity("127.0.0.5", 9000, "client"),
            publish=False,
            backoff=Backoff(attempts=1),
            protection=recording(factory),
        )
        client = await pool.connect("127.0.0.4", tap_port)
        server = await asyncio.wait_for(inbound.get(), 10)
        await client.send_payload(payload)
        assert bytes(await asyncio.wait_for(server.recv_payload(), 10)) == payload
        client_send_key = keys[-1][0]  # the pool builds its protection last
        assert keys[0][1] == client_send_key  # the listener opens with the same key
        client.close()
        tap.close()
        overhead = 0 if mode == "unprotected" else TAG_LEN
        frame = bytes(tap.up[-(HEADER_LEN + len(payload) + overhead) :])
        return frame, payload, client_send_key


def _header_ok(frame: bytes, payload: bytes) -> bytes:
    kind, length = HEADER.unpack_from(frame)
    assert (kind, length) == (KIND_MESSAGE, len(payload))
    return frame[:HEADER_LEN]


async def test_unprotected_payload_is_visible_on_the_wire() -> None:
    frame, payload, _ = await _capture("unprotected")
    _header_ok(frame, payload)
    assert frame[HEADER_LEN:] == payload


async def test_hmac_frame_is_cleartext_plus_a_verifying_tag() -> None:
    frame, payload, key = await _capture("hmac-sha256")
    header = _header_ok(frame, payload)
    body, tag = frame[HEADER_LEN:-TAG_LEN], frame[-TAG_LEN:]
    assert body == payload
    want = hmac.new(key, (1).to_bytes(8, "big") + header + payload, hashlib.sha256).digest()
    assert tag == want[:TAG_LEN]


@pytest.mark.parametrize(
    ("mode", "cipher", "other"),
    [
        ("aes-256-gcm", AESGCM, ChaCha20Poly1305),
        ("chacha20-poly1305", ChaCha20Poly1305, AESGCM),
    ],
)
async def test_aead_payload_is_hidden_and_opens_only_under_its_cipher(
    mode: str, cipher: type, other: type
) -> None:
    frame, payload, key = await _capture(mode)
    header = _header_ok(frame, payload)
    assert MARKER not in frame
    sealed = frame[HEADER_LEN:]
    assert cipher(key).decrypt(NONCE1, sealed, header) == payload
    with pytest.raises(InvalidTag):
        other(key).decrypt(NONCE1, sealed, header)

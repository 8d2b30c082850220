"""Conformance of mlxcel's Noise implementation with the published cacophony vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.base.errors import DecryptFailed
from mlxcel.wire.noise import HandshakeState

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "noise-cacophony-nn.json").read_text())[
    "vectors"
]


@pytest.mark.parametrize("v", VECTORS, ids=[v["protocol_name"] for v in VECTORS])
def test_cacophony_vector(v: dict) -> None:
    pattern = v["protocol_name"].split("_")[1]
    psk_i = bytes.fromhex(v["init_psks"][0]) if v.get("init_psks") else None
    psk_r = bytes.fromhex(v["resp_psks"][0]) if v.get("resp_psks") else None
    init = HandshakeState(
        pattern,
        True,
        bytes.fromhex(v["init_prologue"]),
        psk=psk_i,
        ephemeral=bytes.fromhex(v["init_ephemeral"]),
    )
    resp = HandshakeState(
        pattern,
        False,
        bytes.fromhex(v["resp_prologue"]),
        psk=psk_r,
        ephemeral=bytes.fromhex(v["resp_ephemeral"]),
    )
    msgs = v["messages"]
    for i, m in enumerate(msgs[:2]):
        sender, receiver = (init, resp) if i % 2 == 0 else (resp, init)
        ct = sender.write_message(bytes.fromhex(m["payload"]))
        assert ct.hex() == m["ciphertext"]
        assert receiver.read_message(ct).hex() == m["payload"]
    assert init.handshake_hash.hex() == resp.handshake_hash.hex() == v["handshake_hash"]
    i_send, i_recv = init.split()
    r_recv, r_send = resp.split()
    for i, m in enumerate(msgs[2:]):
        enc, dec = (i_send, r_recv) if i % 2 == 0 else (r_send, i_recv)
        ct = enc.encrypt_with_ad(b"", bytes.fromhex(m["payload"]))
        assert ct.hex() == m["ciphertext"]
        assert dec.decrypt_with_ad(b"", ct).hex() == m["payload"]


def test_wrong_psk_fails_on_the_first_message() -> None:
    a = HandshakeState("NNpsk0", True, b"p", psk=b"a" * 32, ephemeral=b"\x01" * 32)
    b = HandshakeState("NNpsk0", False, b"p", psk=b"b" * 32, ephemeral=b"\x02" * 32)
    with pytest.raises(DecryptFailed):
        b.read_message(a.write_message(b"hello"))


def test_prologue_mismatch_fails() -> None:
    a = HandshakeState("NNpsk0", True, b"v5", psk=b"a" * 32, ephemeral=b"\x01" * 32)
    b = HandshakeState("NNpsk0", False, b"v6", psk=b"a" * 32, ephemeral=b"\x02" * 32)
    with pytest.raises(DecryptFailed):
        b.read_message(a.write_message(b""))


# --- each refusal of the Noise layer, by name ------------------------------------------------
def test_each_misuse_and_malformed_message_is_refused_with_its_reason() -> None:
    from mlxcel.base.errors import NoiseError
    from mlxcel.wire.noise import MAX_NONCE, CipherState

    with pytest.raises(ValueError, match="^unsupported pattern XX$"):
        HandshakeState("XX", True, b"", ephemeral=b"\x01" * 32)
    for psk in (None, b"a" * 31):
        with pytest.raises(ValueError, match="^a psk pattern needs a 32-byte psk$"):
            HandshakeState("NNpsk0", True, b"", psk=psk, ephemeral=b"\x01" * 32)
    with pytest.raises(ValueError, match="^inject either an ephemeral key or a random source$"):
        HandshakeState("NN", True, b"")
    a = HandshakeState("NNpsk0", True, b"p", psk=b"a" * 32, ephemeral=b"\x01" * 32)
    b = HandshakeState("NNpsk0", False, b"p", psk=b"a" * 32, ephemeral=b"\x02" * 32)
    assert a.re is None and not a.done
    with pytest.raises(NoiseError, match="^not this side's turn to read$"):
        a.read_message(b"")
    with pytest.raises(NoiseError, match="^not this side's turn to write$"):
        b.write_message(b"")
    with pytest.raises(NoiseError, match="^handshake not finished$"):
        a.split()
    msg1 = a.write_message(b"hi")
    with pytest.raises(NoiseError, match="^not this side's turn to write$"):
        a.write_message(b"")
    short = HandshakeState("NNpsk0", False, b"p", psk=b"a" * 32, ephemeral=b"\x02" * 32)
    with pytest.raises(NoiseError, match="^handshake message too short$"):
        short.read_message(msg1[:31])
    short = HandshakeState("NNpsk0", False, b"p", psk=b"a" * 32, ephemeral=b"\x02" * 32)
    with pytest.raises(NoiseError, match="^handshake message too short$"):
        short.read_message(msg1[: 32 + 15])  # the key, and less than a tag
    low = HandshakeState("NN", False, b"", ephemeral=b"\x02" * 32)
    low.read_message(bytes(32))  # NN's first message has no key yet: the DH comes next
    with pytest.raises(NoiseError, match="^peer ephemeral key is a low-order point$"):
        low.write_message(b"")
    assert b.read_message(msg1) == b"hi" and b.re == msg1[:32]
    a.read_message(b.write_message(b""))
    assert a.done and b.done
    with pytest.raises(NoiseError, match="^not this side's turn to write$"):
        a.write_message(b"")
    with pytest.raises(NoiseError, match="^not this side's turn to read$"):
        b.read_message(b"")
    # Cipher states: the nonce counts every message and stops one short of the reserved one.
    (i_send, _), (r_recv, _) = a.split(), b.split()
    assert i_send.has_key() and not CipherState().has_key()
    for _ in range(3):
        assert r_recv.decrypt_with_ad(b"", i_send.encrypt_with_ad(b"", b"x")) == b"x"
    assert i_send.n == r_recv.n == 3
    tampered = bytearray(i_send.encrypt_with_ad(b"", b"x"))
    tampered[0] ^= 1
    with pytest.raises(DecryptFailed, match="^authentication tag does not verify$"):
        r_recv.decrypt_with_ad(b"", bytes(tampered))
    for side in (CipherState(b"k" * 32, MAX_NONCE - 1), CipherState(b"k" * 32, MAX_NONCE)):
        if side.n == MAX_NONCE - 1:
            ct = side.encrypt_with_ad(b"", b"last")
            assert CipherState(b"k" * 32, MAX_NONCE - 1).decrypt_with_ad(b"", ct) == b"last"
        with pytest.raises(NoiseError, match="^nonce space exhausted$"):
            side.encrypt_with_ad(b"", b"")
        with pytest.raises(NoiseError, match="^nonce space exhausted$"):
            CipherState(b"k" * 32, MAX_NONCE).decrypt_with_ad(b"", bytes(16))


def test_a_protocol_name_longer_than_the_hash_is_hashed() -> None:
    import hashlib

    from mlxcel.wire.noise import SymmetricState

    name = b"Noise_NNpsk0_25519_AESGCM_SHA256+a-longer-name"
    assert SymmetricState(name).h == hashlib.sha256(name).digest()
    assert SymmetricState(b"short").h == b"short" + bytes(27)

"""Conformance of mlxcel's Noise implementation with the published cacophony vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.wire.noise import DecryptFailed, HandshakeState

VECTORS = json.loads((Path(__file__).parent / "data" / "noise-cacophony-nn.json").read_text())[
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

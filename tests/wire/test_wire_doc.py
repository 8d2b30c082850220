"""The worked example in docs/wire-protocol.md is exactly what the code produces."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlxcel.base.messages import Ack  # noqa: E402
from mlxcel.wire.codec import decode  # noqa: E402
from tools.wire_example import example  # noqa: E402


def doc_values() -> dict[str, str]:
    text = (ROOT / "docs" / "wire-protocol.md").read_text()
    return dict(re.findall(r"^([a-z_]+): ([0-9a-f]+)$", text, re.M))


def test_doc_example_matches_the_implementation() -> None:
    doc = doc_values()
    assert doc == example()


def test_doc_example_can_be_followed_by_hand() -> None:
    """An independent reading of the documented bytes, using only the documented layout."""
    d = doc_values()
    c2s = bytes.fromhex(d["client_to_server"])
    assert c2s[:8] == b"MLXC\x02\x01\x01\x00"
    assert int.from_bytes(c2s[8:10], "big") == len(c2s) - 10 == 80
    s2c = bytes.fromhex(d["server_to_client"])
    assert s2c[:8] == c2s[:8] and int.from_bytes(s2c[8:10], "big") == len(s2c) - 10
    key = AESGCM(bytes.fromhex(d["key_client_to_server"]))
    confirm = bytes.fromhex(d["confirm_frame"])
    assert confirm[0] == 4 and confirm[1:5] == bytes(4) and len(confirm) == 5 + 16
    assert key.decrypt(bytes(12), confirm[5:], confirm[:5]) == b""
    frame = bytes.fromhex(d["first_message_frame"])
    kind, length = frame[0], int.from_bytes(frame[1:5], "big")
    assert kind == 1 and length == len(frame) - 5 - 16
    plain = key.decrypt((1).to_bytes(12, "big"), frame[5:], frame[:5])
    assert plain.hex() == d["ack_cbor"]
    assert decode(plain) == Ack("req-1", 7)

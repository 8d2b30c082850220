"""Print the worked handshake and frame example of docs/wire-protocol.md.

Fixed inputs (secret, ephemeral keys, identity) make every byte reproducible; the test suite
recomputes these values and compares them with the document.
"""

from __future__ import annotations

from mlxcel.base.messages import Ack
from mlxcel.wire.codec import encode
from mlxcel.wire.frames import KIND_CONFIRM, KIND_MESSAGE, FrameSealer
from mlxcel.wire.handshake import (
    Channel,
    ClientHandshake,
    Identity,
    ReplayGuard,
    ServerHandshake,
    Verdict,
    derive_psk,
)

SECRET = b"example-cluster-secret-0123456789abcdef"
CLIENT_E = bytes.fromhex("11" * 32)
WALL = 1_800_000_000.25  # the client's clock: 2027-01-15T08:00:00.25Z
SERVER_E = bytes.fromhex("22" * 32)


def example() -> dict[str, str]:
    c = ClientHandshake(
        SECRET,
        Identity("127.0.0.2", 18081, "stage-1"),
        Channel.TRANSPORT,
        0.0,
        lambda n: CLIENT_E,
        wall=WALL,
    )
    s = ServerHandshake(
        SECRET,
        Channel.TRANSPORT,
        "127.0.0.2",
        0.0,
        lambda n: SERVER_E,
        lambda ident: Verdict.ACCEPT,
        wall=WALL + 1.5,
        replay=ReplayGuard(),
        node_id="coordinator",
    )
    client_bytes = c.data_to_send()
    s.receive_data(client_bytes)
    server_bytes = s.data_to_send()
    c.receive_data(server_bytes)
    assert c.result is not None and s.result is not None
    sealer = FrameSealer(c.result.send_key)
    confirm = sealer.seal(KIND_CONFIRM, b"")
    frame = sealer.seal(KIND_MESSAGE, encode(Ack("req-1", 7)))
    return {
        "secret": SECRET.hex(),
        "psk": derive_psk(SECRET).hex(),
        "client_ephemeral_private": CLIENT_E.hex(),
        "server_ephemeral_private": SERVER_E.hex(),
        "client_to_server": client_bytes.hex(),
        "server_to_client": server_bytes.hex(),
        "handshake_hash": c.result.handshake_hash.hex(),
        "key_client_to_server": c.result.send_key.hex(),
        "key_server_to_client": c.result.recv_key.hex(),
        "confirm_frame": bytes(confirm).hex(),
        "ack_cbor": encode(Ack("req-1", 7)).hex(),
        "first_message_frame": bytes(frame).hex(),
    }


if __name__ == "__main__":
    for k, v in example().items():
        print(f"{k}: {v}")

"""Every handshake failure, on both sides, with its exact class and text; the fixed byte
layouts and their bounds.

An operator reads these lines to tell a wrong secret from a clock out of sync from a
port scanner: each is pinned word for word, and each bound is tried at its edge.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from mlxcel.base.errors import HandshakeError
from mlxcel.wire.handshake import (
    FLAG_BUSY,
    LEN,
    MAGIC,
    MAX_HANDSHAKE_MESSAGE,
    PREAMBLE_LEN,
    PROTOCOL_VERSION,
    SUITE_NNPSK0_AESGCM,
    Channel,
    ClientHandshake,
    Failure,
    Identity,
    ReplayGuard,
    ServerHandshake,
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

SECRET = b"correct horse battery staple 123"
WALL = 1_800_000_000.0
ME = Identity("127.0.0.2", 9000, "stage-1")


def client(ident: Identity = ME, **kw: object) -> ClientHandshake:
    base: dict = {"wall": WALL}
    secret = kw.pop("secret", SECRET)
    channel = kw.pop("channel", Channel.TRANSPORT)
    return ClientHandshake(secret, ident, channel, 0.0, os.urandom, **{**base, **kw})  # type: ignore[arg-type]


def server(
    source: str = "127.0.0.2", verdict: Verdict = Verdict.ACCEPT, **kw: object
) -> ServerHandshake:
    base: dict = {"wall": WALL, "replay": ReplayGuard(), "node_id": "coord"}
    secret = kw.pop("secret", SECRET)
    channel = kw.pop("channel", Channel.TRANSPORT)
    return ServerHandshake(
        secret,
        channel,
        source,
        0.0,
        os.urandom,
        lambda i: verdict,
        **{**base, **kw},  # type: ignore[arg-type]
    )


def run(c: ClientHandshake, s: ServerHandshake) -> None:
    s.receive_data(c.data_to_send())
    out = s.data_to_send()
    if out:
        c.receive_data(out)
    if not c.finished:
        c.connection_lost()


def failed(side: ClientHandshake | ServerHandshake) -> tuple[Failure, str] | None:
    return None if side.error is None else (side.error.failure, str(side.error))


# --- both sides of each refusal -------------------------------------------------------------
def test_a_wrong_secret_is_named_on_both_sides() -> None:
    c, s = client(secret=b"another secret of enough length"), server()
    run(c, s)
    assert failed(s) == (
        Failure.SECRET_MISMATCH,
        "client's handshake message does not verify under the cluster secret "
        "(probable secret mismatch)",
    )
    assert failed(c) == (
        Failure.SECRET_MISMATCH,
        "server closed the connection after this node's first handshake message without "
        "answering: its authenticator does not verify under the configured cluster secret "
        "(secret mismatch)",
    )
    assert s.data_to_send() == b"" and s.verdict is None and s.peer is None


def test_an_identity_the_client_does_not_own_is_refused_with_both_addresses() -> None:
    c, s = client(Identity("10.1.2.3", 9000, "n")), server()
    run(c, s)
    assert failed(s) == (
        Failure.IDENTITY_NOT_OWNED,
        "refusing to bind a listener address the peer does not own: it claims 10.1.2.3:9000 "
        "but connects from 127.0.0.2",
    )
    assert failed(c) == (
        Failure.IDENTITY_NOT_OWNED,
        "server refused this node's advertised identity 10.1.2.3:9000: the advertised IP "
        "must be the address the server sees this connection come from",
    )
    assert s.verdict is Verdict.REFUSED_IDENTITY and s.close_after_send and s.peer is None


def test_a_clock_out_of_the_window_is_refused_with_the_offset_and_the_allowance() -> None:
    c, s = client(wall=WALL + 100), server()
    run(c, s)
    assert failed(s) == (
        Failure.CLOCK_SKEW,
        "handshake from 127.0.0.2 (claims 127.0.0.2:9000) is stamped +100s from this node's "
        "clock (allowed: 60s): clock skew, or an old recording replayed",
    )
    assert failed(c) == (
        Failure.CLOCK_SKEW,
        "server refused this node's handshake time: the two clocks differ by more than 60s; "
        "synchronise them (NTP)",
    )
    assert s.verdict is Verdict.REFUSED_STALE and s.close_after_send
    c, s = client(wall=WALL - 61.5), server()
    run(c, s)
    assert failed(s) is not None and "stamped -62s" in failed(s)[1]  # type: ignore[index]


def test_a_full_server_refuses_after_authentication_and_the_client_may_retry() -> None:
    c, s = client(), server(verdict=Verdict.AT_CAPACITY)
    run(c, s)
    assert failed(s) == (Failure.AT_CAPACITY, "max connections reached")
    assert failed(c) == (
        Failure.AT_CAPACITY,
        "server authenticated this node but refused the connection: it already holds its "
        "maximum number of authenticated connections; retry later",
    )
    assert s.verdict is Verdict.AT_CAPACITY and s.close_after_send and s.peer is None


def test_a_busy_listener_makes_the_client_retry() -> None:
    c = client()
    c.receive_data(busy_preamble(Channel.TRANSPORT))
    assert failed(c) == (
        Failure.BUSY,
        "server's pending-handshake pool is full (many unfinished handshakes, perhaps a "
        "flood); retrying",
    )
    assert busy_preamble(Channel.ASSIGNMENT) == MAGIC + bytes(
        [PROTOCOL_VERSION, SUITE_NNPSK0_AESGCM, int(Channel.ASSIGNMENT), FLAG_BUSY]
    )


@pytest.mark.parametrize(
    ("kw", "failure", "client_text", "server_text"),
    [
        (
            {"version": 3},
            Failure.VERSION_MISMATCH,
            "protocol version mismatch: this node speaks v3, the server v2",
            "protocol version mismatch: peer speaks v3, this node v2",
        ),
        (
            {"suite": 9},
            Failure.SUITE_MISMATCH,
            "frame suite mismatch: this node uses suite 9, the server suite 1",
            "frame suite mismatch: peer uses suite 9, this node suite 1",
        ),
        (
            {"channel": Channel.ASSIGNMENT},
            Failure.CHANNEL_MISMATCH,
            "channel mismatch: this node dialed channel 2, the server serves 1",
            "channel mismatch: peer dialed channel 2, this listener serves 1",
        ),
    ],
)
def test_preamble_mismatches_name_both_sides_values(
    kw: dict, failure: Failure, client_text: str, server_text: str
) -> None:
    c, s = client(**kw), server()
    run(c, s)
    assert failed(s) == (failure, server_text) and failed(c) == (failure, client_text)
    assert s.close_after_send and s.verdict is None
    assert c.channel is kw.get("channel", Channel.TRANSPORT)


def test_a_replayed_message_1_is_refused_without_an_answer() -> None:
    guard = ReplayGuard()
    c = client()
    hello = c.data_to_send()
    first = server(replay=guard)
    first.receive_data(hello)
    assert first.result is not None and first.verdict is Verdict.ACCEPT
    assert not first.close_after_send
    again = server(source="127.0.0.9", replay=guard)
    again.receive_data(hello)
    assert failed(again) == (
        Failure.REPLAYED,
        "handshake message 1 from 127.0.0.9 was already used (claims 127.0.0.2:9000): a replay",
    )
    assert again.data_to_send() == b"" and guard.replays == 1


def test_malformed_input_is_named_precisely() -> None:
    s = server()
    s.receive_data(b"GET")
    assert failed(s) == (Failure.BAD_MAGIC, "bad magic")
    s = server()
    s.receive_data(b"GET / HTTP/1.1")
    assert failed(s) == (Failure.BAD_MAGIC, "bad magic")
    for prefix in (b"ML", preamble(Channel.TRANSPORT)[:5], b""):  # a slow but honest start
        s = server()
        s.receive_data(prefix)
        assert s.error is None and s.bytes_needed == PREAMBLE_LEN - len(prefix)
    s = server()
    s.receive_data(b"MLXD" + preamble(Channel.TRANSPORT)[4:])
    assert failed(s) == (Failure.BAD_MAGIC, "bad magic")
    c = client()
    c.receive_data(b"HTTP/1.1")
    assert failed(c) == (Failure.BAD_MAGIC, "server is not an mlxcel cluster endpoint (bad magic)")
    # The largest message 1 the server waits for, and one byte more.
    s = server()
    s.receive_data(preamble(Channel.TRANSPORT) + LEN.pack(MAX_HANDSHAKE_MESSAGE))
    assert s.error is None and s.bytes_needed == MAX_HANDSHAKE_MESSAGE
    s = server()
    s.receive_data(preamble(Channel.TRANSPORT) + LEN.pack(MAX_HANDSHAKE_MESSAGE + 1))
    assert failed(s) == (
        Failure.MALFORMED,
        f"handshake message of {MAX_HANDSHAKE_MESSAGE + 1} bytes",
    )
    s = server()
    s.receive_data(client().data_to_send() + b"x")
    assert failed(s) == (Failure.MALFORMED, "bytes after the client's handshake message")
    s = server()
    s.receive_data(preamble(Channel.TRANSPORT) + LEN.pack(3) + b"abc")
    assert failed(s) is not None and failed(s)[1].startswith("client handshake message: ")  # type: ignore[index]
    c, s = client(), server()
    s.receive_data(c.data_to_send())
    c.receive_data(s.data_to_send() + b"x")
    assert failed(c) == (Failure.MALFORMED, "bytes after the server's handshake message")
    c = client()
    c.receive_data(preamble(Channel.TRANSPORT) + LEN.pack(3) + b"abc")
    assert failed(c) is not None and failed(c)[1].startswith("server handshake message: ")  # type: ignore[index]
    c, s = client(Identity("evil.example", 9000, "n")), server()
    s.receive_data(c.data_to_send())
    assert failed(s) == (Failure.MALFORMED, "advertised identity is not an IP address")


def test_timeouts_and_closes_are_told_apart() -> None:
    s = server()
    s.on_timer(4.999)
    assert s.error is None
    s.on_timer(5.0)
    assert failed(s) == (Failure.TIMEOUT, "handshake did not finish within its deadline")
    s = server()
    s.connection_lost()
    assert failed(s) == (Failure.PROBE, "peer connected and closed without sending anything")
    s = server()
    s.receive_data(b"M")
    s.connection_lost()
    assert failed(s) == (Failure.CLOSED, "peer closed the connection during the handshake")
    c = client()
    c.receive_data(b"MLX")
    c.connection_lost()
    assert failed(c) == (Failure.CLOSED, "server closed the connection during the handshake")
    c = client()
    c.receive_data(b"")
    c.connection_lost()
    assert failed(c) is not None and failed(c)[0] is Failure.SECRET_MISMATCH  # type: ignore[index]


def test_a_finished_handshake_ignores_later_timers_closes_and_bytes() -> None:
    c, s = client(), server()
    run(c, s)
    assert c.result is not None and s.result is not None
    for side in (c, s):
        side.on_timer(1e9)
        side.connection_lost()
        side.receive_data(b"junk")
        assert side.error is None and side.bytes_needed == 0 and side.next_timer() is None
    assert c.result.peer == Identity("", 0, "coord")
    assert s.peer == s.result.peer == ME and s.verdict is Verdict.ACCEPT
    # A failed one keeps its first error.
    s = server()
    s.receive_data(b"GET")
    s.on_timer(1e9)
    assert failed(s) == (Failure.BAD_MAGIC, "bad magic")


def test_binding_uses_the_source_address_for_an_unspecified_or_scoped_one() -> None:
    c, s = client(Identity("0.0.0.0", 9001, "n")), server(source="::ffff:127.0.0.7")
    run(c, s)
    assert s.peer == Identity("127.0.0.7", 9001, "n")
    c, s = client(Identity("fe80::1", 9002, "v6")), server(source="fe80::1%eth0")
    run(c, s)
    assert s.peer == Identity("fe80::1", 9002, "v6")


# --- the fixed layouts -----------------------------------------------------------------------
def test_the_psk_derivation_is_the_documented_hmac() -> None:
    want = hmac.new(b"mlxcel cluster psk v1", SECRET, hashlib.sha256).digest()
    assert derive_psk(SECRET) == want and len(want) == 32


def test_identity_bytes_and_their_bounds() -> None:
    ident = Identity("127.0.0.2", 9000, "n\u00e9")
    raw = encode_identity(ident)
    assert raw == b"\x09127.0.0.2" + (9000).to_bytes(2, "big") + b"\x03n\xc3\xa9"
    assert decode_identity(raw) == ident
    assert decode_identity(encode_identity(Identity("h" * 255, 65535, "x" * 255))).port == 65535
    assert encode_identity(Identity("h", 0)) == b"\x01h\x00\x00\x00"
    for bad in (
        Identity("h" * 256, 1),
        Identity("h", 1, "x" * 256),
        Identity("h", 65536),
        Identity("h", -1),
    ):
        with pytest.raises(ValueError, match="^identity too long or port out of range$"):
            encode_identity(bad)
    for junk in (raw + b"x", raw[:-1], b"", b"\x05ab"):
        with pytest.raises(HandshakeError, match="^malformed identity payload$"):
            decode_identity(junk)


def test_hello_timestamps_round_trip_and_refuse_what_cannot_be_a_time() -> None:
    ident = Identity("127.0.0.2", 1)
    for wall in (0.0, 1.5, WALL + 0.25, 1.9999999999):
        got, stamp = decode_hello(encode_hello(ident, wall))
        assert got == ident and abs(stamp - wall) < 1e-6
    raw = encode_hello(ident, 2.0)
    assert raw[-12:] == (2).to_bytes(8, "big") + bytes(4)
    with pytest.raises(HandshakeError, match="^message 1 payload has no timestamp$"):
        decode_hello(bytes(11))
    with pytest.raises(HandshakeError, match="^malformed identity payload$"):
        decode_hello(bytes(12))  # a timestamp and no identity
    edge = encode_identity(ident) + (5).to_bytes(8, "big") + (999_999_999).to_bytes(4, "big")
    assert abs(decode_hello(edge)[1] - 5.999999999) < 1e-9
    over = encode_identity(ident) + (5).to_bytes(8, "big") + (1_000_000_000).to_bytes(4, "big")
    with pytest.raises(HandshakeError, match="^message 1 timestamp out of range$"):
        decode_hello(over)


def test_verdict_bytes_and_their_bounds() -> None:
    assert encode_verdict(Verdict.ACCEPT, "coord") == b"\x00\x05coord"
    long = encode_verdict(Verdict.ACCEPT, "x" * 300)
    assert long[1] == 255 and len(long) == 257
    assert decode_verdict(long) == (Verdict.ACCEPT, "x" * 255)
    for junk in (b"", b"\x00", b"\x09\x00", b"\x00\x02a", b"\x00\x01ab", b"\x00\x01\xff"):
        with pytest.raises(HandshakeError, match="^malformed verdict payload$"):
            decode_verdict(junk)


def test_source_keys_drop_the_zone_and_group_ipv6_by_64() -> None:
    assert source_key("fe80::1%eth0") == "fe80::/64"
    assert source_key("2001:db8::1") == source_key("2001:db8::ffff") == "2001:db8::/64"
    assert source_key("127.0.0.2") == "127.0.0.2"


def test_the_replay_guard_forgets_an_entry_exactly_when_it_expires() -> None:
    g = ReplayGuard(max_skew=10.0, hold=5.0)
    assert g.check(b"k" * 32, 100.0, 100.0) is None  # kept until 100 + 10 + 5
    assert g.check(b"k" * 32, 106.0, 114.9) is Failure.REPLAYED
    assert g.check(b"k" * 32, 106.0, 115.0) is None  # expired: only the window judges now
    assert (g.replays, g.stale) == (1, 0)


def test_a_forged_verdict_and_a_malformed_reply_are_named() -> None:
    c0, s0 = client(), server()
    s0.receive_data(c0.data_to_send())
    reply = s0.data_to_send()
    c = client()
    c.receive_data(reply)  # a recorded reply: another handshake's keys
    assert failed(c) == (
        Failure.VERDICT_FORGED,
        "server's handshake verdict does not verify under the cluster secret",
    )
    for side in (client(), server()):
        side.receive_data(preamble(Channel.TRANSPORT) + LEN.pack(3) + b"abc")
        assert failed(side) is not None and failed(side)[0] is Failure.MALFORMED  # type: ignore[index]
    with pytest.raises(HandshakeError, match="message 1 payload has no timestamp") as info:
        decode_hello(bytes(3))
    assert info.value.failure is Failure.MALFORMED
    over = encode_identity(ME) + (5).to_bytes(8, "big") + (10**9).to_bytes(4, "big")
    with pytest.raises(HandshakeError) as info:
        decode_hello(over)
    assert info.value.failure is Failure.MALFORMED


def test_the_server_admits_the_bound_identity_and_answers_with_its_own_settings() -> None:
    seen: list[Identity] = []

    def admit(i: Identity) -> Verdict:
        seen.append(i)
        return Verdict.ACCEPT

    s = ServerHandshake(
        SECRET,
        Channel.ASSIGNMENT,
        "127.0.0.2",
        0.0,
        os.urandom,
        admit,
        wall=WALL,
        replay=ReplayGuard(),
        suite=9,
    )
    c = client(channel=Channel.ASSIGNMENT, suite=9)
    run(c, s)
    assert seen == [ME] and s.channel is Channel.ASSIGNMENT
    assert c.result is not None and c.result.peer == Identity("", 0, "")  # no node id set


def test_one_replay_guard_lets_every_fresh_handshake_through() -> None:
    guard = ReplayGuard()
    for _ in range(3):
        c, s = client(), server(replay=guard)
        run(c, s)
        assert s.result is not None
    assert guard.replays == 0


def test_the_hello_time_is_rounded_to_the_nanosecond() -> None:
    raw = encode_hello(ME, 10.6)
    assert raw[-4:] == (600_000_000).to_bytes(4, "big")
    assert encode_verdict(Verdict.ACCEPT) == b"\x00\x00"

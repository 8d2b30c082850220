"""The sans-I/O handshake, two machines back to back, plus property tests of its parsers."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mlxcel.base.errors import HandshakeError
from mlxcel.wire.handshake import (
    PREAMBLE_LEN,
    Channel,
    ClientHandshake,
    Failure,
    Identity,
    ReplayGuard,
    ServerHandshake,
    Verdict,
    decode_identity,
    decode_verdict,
    encode_identity,
    preamble,
    source_key,
)

SECRET = b"correct horse battery staple 123"


WALL = 1_800_000_000.0  # a fixed wall-clock time for both sides


def pair(
    *,
    client_secret: bytes = SECRET,
    server_secret: bytes = SECRET,
    ident: Identity | None = None,
    source: str = "127.0.0.2",
    verdict: Verdict = Verdict.ACCEPT,
    client_kw: dict | None = None,
    server_kw: dict | None = None,
) -> tuple[ClientHandshake, ServerHandshake]:
    c = ClientHandshake(
        client_secret,
        ident or Identity("127.0.0.2", 9000, "stage-1"),
        Channel.TRANSPORT,
        0.0,
        os.urandom,
        **{"wall": WALL, **(client_kw or {})},
    )
    s = ServerHandshake(
        server_secret,
        Channel.TRANSPORT,
        source,
        0.0,
        os.urandom,
        lambda i: verdict,
        node_id="coord",
        **{"wall": WALL, "replay": ReplayGuard(), **(server_kw or {})},
    )
    return c, s


def exchange(c: ClientHandshake, s: ServerHandshake) -> None:
    s.receive_data(c.data_to_send())
    out = s.data_to_send()
    if out:
        c.receive_data(out)
    if not c.finished:
        c.connection_lost()


def test_success_binds_identity_and_agrees_on_keys() -> None:
    c, s = pair()
    exchange(c, s)
    assert c.result is not None and s.result is not None
    assert s.result.peer == Identity("127.0.0.2", 9000, "stage-1")
    assert c.result.peer.node_id == "coord"
    assert c.result.send_key == s.result.recv_key and c.result.recv_key == s.result.send_key
    assert c.result.send_key != c.result.recv_key
    assert c.result.handshake_hash == s.result.handshake_hash


def test_unspecified_ip_is_replaced_by_the_source() -> None:
    c, s = pair(ident=Identity("0.0.0.0", 9000, "n"), source="127.0.0.7")
    exchange(c, s)
    assert s.result is not None and s.result.peer.host == "127.0.0.7"
    c, s = pair(ident=Identity("::", 9000, "n"), source="::ffff:127.0.0.8")
    exchange(c, s)
    assert s.result is not None and s.result.peer.host == "127.0.0.8"


def test_forward_secrecy_fresh_keys_per_connection() -> None:
    a_c, a_s = pair()
    exchange(a_c, a_s)
    b_c, b_s = pair()
    exchange(b_c, b_s)
    assert a_c.result.send_key != b_c.result.send_key  # type: ignore[union-attr]


def test_wrong_secret_is_diagnosed_on_both_sides() -> None:
    c, s = pair(client_secret=b"another secret of enough length")
    exchange(c, s)
    assert s.error is not None and s.error.failure is Failure.SECRET_MISMATCH
    assert "probable secret mismatch" in str(s.error)
    assert c.error is not None and c.error.failure is Failure.SECRET_MISMATCH
    assert "secret mismatch" in str(c.error)
    assert s.data_to_send() == b""  # nothing is answered to a party without the secret


def test_identity_not_owned_gets_an_authenticated_refusal() -> None:
    c, s = pair(ident=Identity("10.1.2.3", 9000, "n"), source="127.0.0.2")
    exchange(c, s)
    assert s.error is not None and s.error.failure is Failure.IDENTITY_NOT_OWNED
    assert "does not own" in str(s.error)
    assert c.error is not None and c.error.failure is Failure.IDENTITY_NOT_OWNED
    assert "10.1.2.3:9000" in str(c.error)


def test_identity_that_is_not_an_address_is_closed_without_a_verdict() -> None:
    c, s = pair(ident=Identity("evil.example", 9000, "n"))
    s.receive_data(c.data_to_send())
    assert s.error is not None and s.error.failure is Failure.MALFORMED
    assert s.data_to_send() == b""


@pytest.mark.parametrize(
    ("kw", "failure", "client_text", "server_text"),
    [
        (
            {"version": 3},
            Failure.VERSION_MISMATCH,
            "this node speaks v3, the server v2",
            "peer speaks v3, this node v2",
        ),
        (
            {"suite": 9},
            Failure.SUITE_MISMATCH,
            "this node uses suite 9, the server suite 1",
            "peer uses suite 9",
        ),
    ],
)
def test_version_and_suite_mismatch_report_both_sides(
    kw: dict, failure: Failure, client_text: str, server_text: str
) -> None:
    c, s = pair(client_kw=kw)
    exchange(c, s)
    assert s.error is not None and s.error.failure is failure and server_text in str(s.error)
    assert c.error is not None and c.error.failure is failure and client_text in str(c.error)


def test_channel_mismatch() -> None:
    c = ClientHandshake(
        SECRET, Identity("127.0.0.2", 1), Channel.ASSIGNMENT, 0.0, os.urandom, wall=WALL
    )
    s = ServerHandshake(
        SECRET,
        Channel.TRANSPORT,
        "127.0.0.2",
        0.0,
        os.urandom,
        lambda i: Verdict.ACCEPT,
        wall=WALL,
        replay=ReplayGuard(),
    )
    exchange(c, s)
    assert c.error is not None and c.error.failure is Failure.CHANNEL_MISMATCH


def test_at_capacity_is_an_authenticated_retryable_verdict() -> None:
    c, s = pair(verdict=Verdict.AT_CAPACITY)
    exchange(c, s)
    assert (
        c.error is not None and c.error.failure is Failure.AT_CAPACITY and c.error.failure.retryable
    )
    assert "retry later" in str(c.error)
    assert s.error is not None and s.error.failure is Failure.AT_CAPACITY


@pytest.mark.parametrize("verdict", [Verdict.ACCEPT, Verdict.AT_CAPACITY, Verdict.REFUSED_IDENTITY])
def test_every_bit_flip_of_the_verdict_is_detected(verdict: Verdict) -> None:
    c0, s0 = pair(verdict=verdict)
    s0.receive_data(c0.data_to_send())
    reply = s0.data_to_send()
    for bit in range(
        (PREAMBLE_LEN + 2) * 8, len(reply) * 8
    ):  # every bit of msg2 (ephemeral, verdict, tag)
        c, s = pair(verdict=verdict)
        # Replay the same server reply against a fresh client: it must never verify.
        tampered = bytearray(reply)
        tampered[bit // 8] ^= 1 << (bit % 8)
        c.receive_data(bytes(tampered))
        assert c.result is None
        assert c.error is not None and c.error.failure in (
            Failure.VERDICT_FORGED,
            Failure.MALFORMED,
        )


def test_a_recorded_reply_does_not_complete_another_handshake() -> None:
    c0, s0 = pair()
    s0.receive_data(c0.data_to_send())
    reply = s0.data_to_send()
    c1, _ = pair()
    c1.receive_data(reply)
    assert c1.error is not None and c1.error.failure is Failure.VERDICT_FORGED


def test_timeout_and_probe_and_bad_magic() -> None:
    c, s = pair(server_kw={"timeout": 5.0})
    assert s.next_timer() == 5.0
    s.on_timer(4.9)
    assert not s.finished
    s.on_timer(5.0)
    assert s.error is not None and s.error.failure is Failure.TIMEOUT and s.next_timer() is None
    _, s = pair()
    s.connection_lost()
    assert (
        s.error is not None
        and s.error.failure is Failure.PROBE
        and s.error.failure.rate_class == "noise"
    )
    _, s = pair()
    s.receive_data(b"GET / HTTP/1.1\r\n")
    assert s.error is not None and s.error.failure is Failure.BAD_MAGIC


def test_oversize_handshake_message_is_refused() -> None:
    _, s = pair()
    s.receive_data(preamble(Channel.TRANSPORT) + b"\xff\xff")
    assert s.error is not None and s.error.failure is Failure.MALFORMED


def test_trailing_bytes_after_msg1_are_refused() -> None:
    c, s = pair()
    s.receive_data(c.data_to_send() + b"x")
    assert s.error is not None and s.error.failure is Failure.MALFORMED


def test_failure_classes() -> None:
    assert Failure.SECRET_MISMATCH.rate_class == "diagnostic"
    assert Failure.IDENTITY_NOT_OWNED.rate_class == "diagnostic"
    assert Failure.SUITE_MISMATCH.rate_class == "diagnostic"
    assert Failure.AT_CAPACITY.rate_class == "at-capacity"
    assert Failure.TIMEOUT.rate_class == "noise"


def test_source_key_groups_ipv6_by_64() -> None:
    assert source_key("127.0.0.5") == "127.0.0.5"
    assert source_key("2001:db8::1") == source_key("2001:db8::ffff") == "2001:db8::/64"
    assert source_key("2001:db8:0:1::1") != source_key("2001:db8::1")
    assert source_key("::ffff:10.0.0.1") == "10.0.0.1"


@settings(max_examples=300)
@given(st.binary(max_size=200), st.integers(1, 64))
def test_server_survives_arbitrary_bytes(data: bytes, chunk: int) -> None:
    _, s = pair()
    for i in range(0, len(data), chunk):
        s.receive_data(data[i : i + chunk])
    assert s.result is None  # no secret, no success
    assert s.error is None or isinstance(s.error, HandshakeError)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_client_survives_arbitrary_bytes(data: bytes) -> None:
    c, _ = pair()
    c.receive_data(data)
    assert c.result is None
    c.connection_lost()
    assert isinstance(c.error, HandshakeError)


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_identity_and_verdict_parsers(data: bytes) -> None:
    for parse in (decode_identity, decode_verdict):
        try:
            parse(data)
        except HandshakeError as exc:
            assert exc.failure is Failure.MALFORMED


@given(st.ip_addresses(v=4).map(str), st.integers(0, 65535), st.text(max_size=50))
def test_identity_round_trip(host: str, port: int, node: str) -> None:
    ident = Identity(host, port, node)
    if len(node.encode()) <= 255:
        assert decode_identity(encode_identity(ident)) == ident


@given(st.binary(min_size=PREAMBLE_LEN, max_size=PREAMBLE_LEN))
def test_preamble_parser(data: bytes) -> None:
    _, s = pair()
    s.receive_data(data)
    if data == preamble(Channel.TRANSPORT):
        assert not s.finished
    else:
        assert s.error is not None


def test_the_replay_guard_is_bounded_and_forgets_what_left_the_window() -> None:
    """At most ``max_entries`` message 1s are remembered (oldest first out), an expired entry
    is forgotten on the next check, and a duplicate inside the window is a replay."""
    from mlxcel.wire.handshake_fields import Failure

    guard = ReplayGuard(max_skew=10.0, max_entries=4, hold=1.0)
    keys = [bytes([i]) * 32 for i in range(6)]
    for i, k in enumerate(keys):
        assert guard.check(k, 100.0 + i * 0.1, 100.0 + i * 0.1) is None
        assert len(guard.remembered) <= 4
    assert guard.remembered == keys[2:]  # the two oldest made room
    assert guard.check(keys[5], 100.5, 100.6) is Failure.REPLAYED and guard.replays == 1
    assert guard.check(keys[0], 200.0, 100.6) is Failure.CLOCK_SKEW and guard.stale == 1
    assert guard.check(keys[4], 100.4, 100.7) is Failure.REPLAYED and guard.replays == 2
    assert guard.check(keys[1], 300.0, 100.7) is Failure.CLOCK_SKEW and guard.stale == 2
    # Past the window plus the hold, every entry expires: the timestamp check refuses those.
    assert guard.check(bytes(32), 112.0, 112.0) is None and guard.remembered == [bytes(32)]
    # A stamp exactly max_skew away is still inside the window; an entry outlives the window
    # by the hold, so a late replay just inside it is still caught.
    assert guard.check(b"e" * 32, 122.0, 112.0) is None
    assert guard.check(b"e" * 32, 122.0, 131.5) is Failure.REPLAYED

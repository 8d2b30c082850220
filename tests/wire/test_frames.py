"""Frame protection, sans-I/O: tampering, replay, reordering, caps, counters and rekeying."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mlxcel.base.errors import CounterExhausted, FrameAuthFailed, FrameError, FrameTooLarge
from mlxcel.wire.frames import (
    HEADER_LEN,
    KIND_MESSAGE,
    LAST_COUNTER,
    TAG_LEN,
    AeadProtection,
    ChaChaSuite,
    FrameOpener,
    FrameSealer,
    HmacSha256,
    Unprotected,
    parse_header,
)

KEY = bytes(range(32))


def split(frame: bytearray) -> tuple[bytes, bytes]:
    return bytes(frame[:HEADER_LEN]), bytes(frame[HEADER_LEN:])


def test_round_trip_and_layout() -> None:
    s, o = FrameSealer(KEY), FrameOpener(KEY)
    for payload in (b"", b"hello", os.urandom(70000)):
        frame = s.seal(KIND_MESSAGE, payload)
        assert len(frame) == HEADER_LEN + len(payload) + TAG_LEN
        assert frame[0] == KIND_MESSAGE and int.from_bytes(frame[1:5], "big") == len(payload)
        if payload:
            assert payload not in frame  # encrypted
        assert o.open(*split(frame)) == payload
    assert s.counter == o.counter == 3


def test_every_single_bit_flip_closes() -> None:
    frame = FrameSealer(KEY).seal(KIND_MESSAGE, b"activations!")
    for bit in range(len(frame) * 8):
        o = FrameOpener(KEY)
        bad = bytearray(frame)
        bad[bit // 8] ^= 1 << (bit % 8)
        header, body = split(bad)
        with pytest.raises(FrameError):
            o.open(header, body)
        assert o.failed
        with pytest.raises(FrameAuthFailed):  # a failed opener stays failed
            o.open(*split(frame))


def test_replay_reorder_truncation_and_cross_connection() -> None:
    s = FrameSealer(KEY)
    f1, f2 = s.seal(KIND_MESSAGE, b"one"), s.seal(KIND_MESSAGE, b"two")
    o = FrameOpener(KEY)
    assert o.open(*split(f1)) == b"one"
    with pytest.raises(FrameAuthFailed):
        o.open(*split(f1))  # replay
    o = FrameOpener(KEY)
    with pytest.raises(FrameAuthFailed):
        o.open(*split(f2))  # reordered: f2 before f1
    o = FrameOpener(KEY)
    header, body = split(f1)
    with pytest.raises(FrameAuthFailed):
        o.open(header, body[:-1])  # truncated
    other = FrameOpener(bytes(32))  # another connection's key
    with pytest.raises(FrameAuthFailed):
        other.open(*split(f1))


def test_oversize_length_is_refused_from_the_header_alone() -> None:
    header = bytes([KIND_MESSAGE]) + (2**32 - 1).to_bytes(4, "big")
    with pytest.raises(FrameTooLarge, match="cap is 1024"):
        parse_header(header, 1024)
    o = FrameOpener(KEY, max_frame=1024)
    with pytest.raises(FrameTooLarge):
        o.header(header)
    assert o.failed
    assert parse_header(bytes([1, 0, 0, 4, 0]), 1024) == (1, 1024)


def test_counter_never_wraps() -> None:
    s = FrameSealer(KEY)
    s._d.n = LAST_COUNTER - 1
    s.seal(KIND_MESSAGE, b"last usable nonce")
    with pytest.raises(CounterExhausted):
        s.seal(KIND_MESSAGE, b"would reuse")
    o = FrameOpener(KEY)
    o._d.n = LAST_COUNTER
    with pytest.raises(CounterExhausted):
        o.open(bytes([1, 0, 0, 0, 0]), bytes(16))


def test_rekey_by_volume_is_deterministic_on_both_sides() -> None:
    s = FrameSealer(KEY, rekey_bytes=100)
    o = FrameOpener(KEY, rekey_bytes=100)
    stale = FrameOpener(KEY)  # never rekeys: must fail once the sender has
    frames = [s.seal(KIND_MESSAGE, os.urandom(60)) for _ in range(6)]
    assert s.rekeys == 3
    for i, f in enumerate(frames):
        assert len(o.open(*split(f))) == 60
        if i < 2:
            stale.open(*split(f))
    with pytest.raises(FrameAuthFailed):
        stale.open(*split(frames[2]))
    assert o.rekeys == 3
    # The counter keeps running across rekeys (no nonce reuse under any key).
    assert s.counter == o.counter == 6


def test_rekey_by_frame_count() -> None:
    s = FrameSealer(KEY, rekey_frames=2)
    for _ in range(5):
        s.seal(KIND_MESSAGE, b"x")
    assert s.rekeys == 2


@settings(max_examples=300)
@given(st.binary(min_size=5, max_size=5), st.binary(max_size=100))
def test_arbitrary_frames_are_refused_with_a_frame_error(header: bytes, body: bytes) -> None:
    o = FrameOpener(KEY, max_frame=64)
    with pytest.raises(FrameError):
        o.open(header, body)


# --- each refusal names its reason; each bound holds at its edge ------------------------------
def test_each_refusal_names_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="^frame keys are 32 bytes$"):
        FrameSealer(bytes(31))
    f = FrameSealer(KEY).seal(KIND_MESSAGE, b"abc")
    header, body = split(f)
    o = FrameOpener(KEY)
    with pytest.raises(FrameAuthFailed, match="^frame body is 18 bytes, header says 19$"):
        o.open(header, body[:-1])
    with pytest.raises(FrameAuthFailed, match="^connection already failed$"):
        o.open(header, body)
    o = FrameOpener(KEY)
    with pytest.raises(FrameAuthFailed, match="^frame failed authentication$"):
        o.open(header, bytes(len(body)))
    with pytest.raises(FrameAuthFailed, match="^connection already failed$"):
        o.header(header)
    s = FrameSealer(KEY)
    s._d.n = LAST_COUNTER
    with pytest.raises(CounterExhausted, match="^frame counter exhausted; reconnect$"):
        s.seal(KIND_MESSAGE, b"")
    fresh = FrameSealer(KEY).seal(KIND_MESSAGE, b"x")  # a new pair starts on KEY, unfailed
    assert FrameOpener(KEY).open(*split(fresh)) == b"x"


def test_a_frame_of_exactly_max_frame_is_accepted() -> None:
    s, o = FrameSealer(KEY), FrameOpener(KEY, max_frame=64)
    assert o.open(*split(s.seal(KIND_MESSAGE, bytes(64)))) == bytes(64)
    with pytest.raises(FrameTooLarge, match="^frame announces 65 bytes, cap is 64$"):
        o.open(*split(s.seal(KIND_MESSAGE, bytes(65))))


def test_rekeying_happens_exactly_at_the_volume_and_follows_the_noise_rule() -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    s = FrameSealer(KEY, rekey_bytes=100)
    s.seal(KIND_MESSAGE, bytes(60))
    s.seal(KIND_MESSAGE, bytes(39))
    assert s.rekeys == 0  # 99 bytes
    s.seal(KIND_MESSAGE, bytes(1))
    assert s.rekeys == 1  # 100 bytes: the limit itself rekeys
    # REKEY(k) = ENCRYPT(k, 2^64-1, "", 32 zero bytes)[:32] (Noise spec, section 4.2)
    want = AESGCM(KEY).encrypt(b"\x00" * 4 + LAST_COUNTER.to_bytes(8, "big"), bytes(32), b"")
    # The next frame is sealed under that key, at the running counter.
    n = s.counter
    frame = s.seal(KIND_MESSAGE, b"under the new key")
    header, body = split(frame)
    assert body == AESGCM(want[:32]).encrypt(
        b"\x00" * 4 + n.to_bytes(8, "big"), b"under the new key", header
    )
    assert s.rekeys == 1
    s.seal(KIND_MESSAGE, bytes(82))
    assert s.rekeys == 1  # the volume counts again from zero (17 + 82 bytes)
    s.seal(KIND_MESSAGE, bytes(1))
    assert s.rekeys == 2
    a = AeadProtection(KEY, KEY, rekey_bytes=10, max_frame=16)
    b = AeadProtection(KEY, KEY, rekey_bytes=10, max_frame=16)
    for _ in range(3):
        assert b.open(*split(a.seal(KIND_MESSAGE, bytes(10)))) == bytes(10)
    assert a.sealer.rekeys == b.opener.rekeys == 3
    with pytest.raises(FrameTooLarge, match="cap is 16"):
        b.open(*split(a.seal(KIND_MESSAGE, bytes(17))))
    c = AeadProtection(KEY, KEY, rekey_frames=2)
    for _ in range(4):
        assert c.open(*split(c.seal(KIND_MESSAGE, b"x"))) == b"x"
    assert c.sealer.rekeys == c.opener.rekeys == 2


def test_the_benchmark_suites_authenticate_too() -> None:
    """HMAC-only and ChaCha20-Poly1305: what `bench frames` compares AES-GCM with."""
    other = bytes(range(1, 33))
    for suite in (HmacSha256, ChaChaSuite):
        a, b = suite(KEY, other), suite(other, KEY)
        for payload in (b"", b"one", bytes(range(200))):
            frame = a.seal(KIND_MESSAGE, payload)
            assert len(frame) == HEADER_LEN + len(payload) + TAG_LEN
            assert frame[:HEADER_LEN] == bytes([KIND_MESSAGE]) + len(payload).to_bytes(4, "big")
            assert bytes(b.open(*split(frame))) == payload
        frame = a.seal(KIND_MESSAGE, b"four")
        header, body = split(frame)
        with pytest.raises(
            FrameAuthFailed, match="^(HMAC does not verify|frame failed authentication)$"
        ):
            b.open(header, bytes(body[:-1]) + bytes([body[-1] ^ 1]))
        with pytest.raises(FrameAuthFailed):
            suite(other, KEY).open(*split(a.seal(KIND_MESSAGE, b"replayed counter")))
    # The HMAC tag covers the counter, the header and the payload, HMAC-SHA256 truncated.
    import hashlib
    import hmac as hmac_

    h = HmacSha256(KEY, KEY)
    h.seal(KIND_MESSAGE, b"first")
    frame = h.seal(KIND_MESSAGE, b"second")
    tag = hmac_.new(
        KEY, (1).to_bytes(8, "big") + bytes(frame[:HEADER_LEN]) + b"second", hashlib.sha256
    )
    assert bytes(frame[HEADER_LEN:]) == b"second" + tag.digest()[:TAG_LEN]
    u = Unprotected()
    assert u.seal(KIND_MESSAGE, b"plain") == bytes([KIND_MESSAGE, 0, 0, 0, 5]) + b"plain"

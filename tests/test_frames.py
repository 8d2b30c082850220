"""Frame protection, sans-I/O: tampering, replay, reordering, caps, counters and rekeying."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mlxcel.wire.frames import (
    HEADER_LEN,
    KIND_MESSAGE,
    LAST_COUNTER,
    TAG_LEN,
    CounterExhausted,
    FrameAuthFailed,
    FrameError,
    FrameOpener,
    FrameSealer,
    FrameTooLarge,
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
    assert o._d.rekeys == 3 and o._d.key != KEY
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

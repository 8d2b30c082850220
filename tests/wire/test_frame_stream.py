"""The sans-I/O frame stream: bytes in, typed events or one typed FrameError out.

Unit tests of the reassembly rules, then property tests: any input yields events or raises a
FrameError (never another exception, never a leaked budget), and the frames the sender side
makes, split anywhere, parse back to the same messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from mlxcel.base.errors import (
    BudgetExceeded,
    CounterExhausted,
    FrameAuthFailed,
    FrameError,
    FrameTooLarge,
    HandshakeError,
)
from mlxcel.wire.frames import (
    HEADER,
    HEADER_LEN,
    KIND_CONFIRM,
    KIND_END,
    KIND_KEEPALIVE,
    KIND_MESSAGE,
    KIND_PART,
    KIND_PING,
    LAST_COUNTER,
    AeadProtection,
    ChaChaSuite,
    HmacSha256,
    Protection,
    Unprotected,
)
from mlxcel.wire.handshake import ClientHandshake, ServerHandshake
from mlxcel.wire.stream import (
    ConfirmReceived,
    FrameDropped,
    FrameStream,
    KeepaliveReceived,
    MemoryBudget,
    MessageReceived,
    PingReceived,
    StreamEvent,
    message_frames,
)

K1, K2 = bytes(range(32)), bytes(range(32, 64))
MODES: dict[str, Callable[[bytes, bytes], Protection]] = {
    "aes-256-gcm": AeadProtection,
    "chacha20-poly1305": ChaChaSuite,
    "hmac-sha256": HmacSha256,
    "unprotected": Unprotected,
}


def ends(mode: str = "aes-256-gcm") -> tuple[Protection, Protection]:
    """(sender, receiver) protections of one direction."""
    return MODES[mode](K1, K2), MODES[mode](K2, K1)


def drain(stream: FrameStream) -> list[StreamEvent]:
    return list(stream.events())


def payloads(events: list[StreamEvent]) -> list[bytes]:
    return [bytes(e.payload) for e in events if isinstance(e, MessageReceived)]


# --- the reassembly rules ----------------------------------------------------------------------


def test_one_message_one_event_and_the_counters() -> None:
    tx, rx = ends()
    frame = tx.seal(KIND_MESSAGE, b"hello")
    s = FrameStream(rx)
    assert not s.in_frame and s.bytes_needed == HEADER_LEN
    s.receive_data(bytes(frame))
    assert drain(s) == [MessageReceived(bytearray(b"hello"))]
    assert s.frames_in == 1 and s.bytes_in == len(frame) and not s.in_frame


def test_exact_reads_follow_bytes_needed_and_a_message_spans_records() -> None:
    tx, rx = ends()
    budget = MemoryBudget()
    s = FrameStream(rx, budget=budget)
    data = os.urandom(1000)
    wire = b"".join(message_frames(tx, data, record_size=300))
    pos, seen_inside = 0, False
    while pos < len(wire):
        n = s.bytes_needed
        s.receive_data(wire[pos : pos + n])  # what an exact reader does
        pos += n
        seen_inside |= s.in_frame and s.reassembling > 0
        if pos < len(wire):
            assert s.next_event() is None
            assert budget.used == s.reassembling  # every record held is budgeted
    assert seen_inside  # between records the peer owes frame_timeout, not the idle allowance
    assert payloads(drain(s)) == [data]
    assert budget.used == 0 and budget.peak == 1000 and not s.in_frame


def test_a_feed_as_long_as_the_last_body_is_not_taken_for_a_body() -> None:
    """Found by the split property test: the exact-read fast path must know a header is due."""
    tx, rx = ends()
    s = FrameStream(rx)
    k1, k2 = bytes(tx.seal(KIND_KEEPALIVE, b"")), bytes(tx.seal(KIND_KEEPALIVE, b""))
    s.receive_data(k1[:HEADER_LEN])
    s.receive_data(k1[HEADER_LEN:])  # an exact body read of 16 bytes
    s.receive_data(k2[:16])  # 16 bytes again, but they start with a header
    s.receive_data(k2[16:])
    assert drain(s) == [KeepaliveReceived(), KeepaliveReceived()]


def test_keepalive_and_confirm() -> None:
    tx, rx = ends()
    s = FrameStream(rx, confirm_first=True)
    s.receive_data(bytes(tx.seal(KIND_CONFIRM, b"") + tx.seal(KIND_KEEPALIVE, b"")))
    assert drain(s) == [ConfirmReceived(), KeepaliveReceived()]
    s.receive_data(bytes(tx.seal(KIND_CONFIRM, b"")))  # only the first frame may confirm
    assert drain(s) == [FrameDropped(KIND_CONFIRM, 0)]


def test_a_ping_is_an_event_only_when_empty_and_between_messages() -> None:
    tx, rx = ends()
    s = FrameStream(rx, confirm_first=True)
    wire = tx.seal(KIND_CONFIRM, b"") + tx.seal(KIND_PING, b"")
    wire += tx.seal(KIND_PING, b"data")  # a PING with a payload
    wire += tx.seal(KIND_PART, b"ab") + tx.seal(KIND_PING, b"")  # a PING inside a run
    wire += tx.seal(KIND_MESSAGE, b"m")
    s.receive_data(bytes(wire))
    assert drain(s) == [
        ConfirmReceived(),
        PingReceived(),
        FrameDropped(KIND_PING, 0),
        FrameDropped(KIND_PING, 2),
        MessageReceived(b"m"),
    ]


@pytest.mark.parametrize(
    ("kind", "payload"),
    [(KIND_MESSAGE, b"x"), (KIND_KEEPALIVE, b""), (KIND_CONFIRM, b"not empty"), (9, b"")],
)
def test_the_first_frame_must_be_an_empty_confirm(kind: int, payload: bytes) -> None:
    tx, rx = ends()
    s = FrameStream(rx, confirm_first=True)
    s.receive_data(bytes(tx.seal(kind, payload)))
    with pytest.raises(FrameError, match="first frame is not a confirmation"):
        s.next_event()


def test_unknown_kinds_and_interruptions_drop_the_partial_message() -> None:
    tx, rx = ends()
    budget = MemoryBudget()
    s = FrameStream(rx, budget=budget)
    wire = tx.seal(KIND_PART, b"a" * 10) + tx.seal(9, b"?")  # unknown kind mid-message
    wire += tx.seal(KIND_PART, b"b" * 5) + tx.seal(KIND_MESSAGE, b"m")  # MESSAGE inside a run
    wire += tx.seal(KIND_PART, b"c") + tx.seal(KIND_KEEPALIVE, b"")  # KEEPALIVE inside a run
    wire += tx.seal(KIND_KEEPALIVE, b"data")  # a KEEPALIVE with a payload
    wire += tx.seal(KIND_END, b"")  # an END alone is a (empty) message
    s.receive_data(bytes(wire))
    assert drain(s) == [
        FrameDropped(9, 10),
        FrameDropped(KIND_MESSAGE, 5),
        FrameDropped(KIND_KEEPALIVE, 1),
        FrameDropped(KIND_KEEPALIVE, 0),
        MessageReceived(b""),
    ]
    assert budget.used == 0


def test_an_oversize_header_fails_before_its_body() -> None:
    _, rx = ends()
    s = FrameStream(rx, max_frame=1024)
    s.receive_data(HEADER.pack(KIND_MESSAGE, 1025))
    with pytest.raises(FrameTooLarge, match="cap is 1024"):
        s.next_event()


def test_message_cap_and_node_budget() -> None:
    tx, rx = ends()
    s = FrameStream(rx, max_message=100)
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(60)) + tx.seal(KIND_END, bytes(41))))
    with pytest.raises(FrameTooLarge, match="100-byte cap"):
        s.next_event()
    tx, rx = ends()
    budget = MemoryBudget(100)
    budget.take(50)  # another connection's share
    s = FrameStream(rx, budget=budget)
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(40)) + tx.seal(KIND_PART, bytes(20))))
    with pytest.raises(BudgetExceeded):
        s.next_event()
    assert budget.used == 50 and budget.refusals == 1  # this stream's 40 went back


def test_events_before_a_failure_come_first_and_the_stream_stays_failed() -> None:
    tx, rx = ends()
    s = FrameStream(rx)
    good = tx.seal(KIND_MESSAGE, b"one")
    bad = tx.seal(KIND_MESSAGE, b"two")
    bad[-1] ^= 1
    s.receive_data(bytes(good + bad + tx.seal(KIND_MESSAGE, b"three")))
    assert s.next_event() == MessageReceived(bytearray(b"one"))
    for _ in range(2):
        with pytest.raises(FrameAuthFailed):
            s.next_event()
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, b"four")))  # ignored
    with pytest.raises(FrameAuthFailed):
        s.next_event()


def test_an_exhausted_counter_is_a_frame_error() -> None:
    tx, rx = ends()
    assert isinstance(rx, AeadProtection)
    rx.opener._d.n = LAST_COUNTER
    s = FrameStream(rx)
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, b"x")))
    with pytest.raises(CounterExhausted):
        s.next_event()


def test_close_gives_back_the_budget_and_ends_the_stream() -> None:
    tx, rx = ends()
    budget = MemoryBudget()
    s = FrameStream(rx, budget=budget)
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(100))))
    assert s.next_event() is None and budget.used == 100 and s.in_frame
    s.close()
    assert budget.used == 0
    with pytest.raises(FrameError, match="closed"):
        s.next_event()


def test_views_never_alias_a_buffer_the_caller_may_change() -> None:
    """Unprotected and HMAC open to views; a payload must not change when the bytearray it
    was fed from does, nor when the stream compacts its own buffer."""
    for mode in ("unprotected", "hmac-sha256"):
        tx, rx = ends(mode)
        s = FrameStream(rx)
        fed = bytearray(tx.seal(KIND_MESSAGE, b"stable") + tx.seal(KIND_MESSAGE, b"split"))
        s.receive_data(fed[:-3])
        first = s.next_event()
        s.receive_data(fed[-3:])
        fed[:] = bytes(len(fed))
        assert payloads([first, *drain(s)]) == [b"stable", b"split"]  # type: ignore[list-item]


def test_message_frames_checks_the_size_before_sealing_anything() -> None:
    tx, _ = ends()
    with pytest.raises(FrameTooLarge):
        message_frames(tx, bytes(11), max_message=10)
    with pytest.raises(ValueError):
        message_frames(tx, b"x", record_size=0)
    kinds = [f[0] for f in message_frames(tx, bytes(10), record_size=4)]
    assert kinds == [KIND_PART, KIND_PART, KIND_END]
    assert [f[0] for f in message_frames(tx, bytes(4), record_size=4)] == [KIND_MESSAGE]


# --- properties ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from(sorted(MODES)),
    data=st.binary(max_size=600),
    cuts=st.lists(st.integers(0, 600), max_size=8),
    confirm_first=st.booleans(),
)
def test_any_input_yields_events_or_a_frame_error(
    mode: str, data: bytes, cuts: list[int], confirm_first: bool
) -> None:
    _, rx = ends(mode)
    budget = MemoryBudget(300)
    s = FrameStream(rx, max_frame=64, max_message=200, budget=budget, confirm_first=confirm_first)
    failed = False
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        s.receive_data(data[lo:hi])
        try:
            for event in s.events():
                assert isinstance(
                    event, MessageReceived | KeepaliveReceived | ConfirmReceived | FrameDropped
                )
        except FrameError:
            failed = True
            break
        assert budget.used == s.reassembling <= 200
    if failed:
        assert budget.used == 0
    s.close()
    assert budget.used == 0


def _chunks(wire: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    return [wire[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(sorted(MODES)),
    messages=st.lists(st.binary(max_size=700) | st.none(), max_size=6),
    record_size=st.integers(1, 256),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
    as_bytearray=st.booleans(),
)
def test_sent_frames_split_anywhere_parse_back_to_the_messages(
    mode: str,
    messages: list[bytes | None],
    record_size: int,
    cuts: list[int],
    as_bytearray: bool,
) -> None:
    tx, rx = ends(mode)
    budget = MemoryBudget()
    s = FrameStream(rx, budget=budget, confirm_first=True)
    wire = bytearray(tx.seal(KIND_CONFIRM, b""))
    for m in messages:  # None: a KEEPALIVE between messages
        wire += (
            tx.seal(KIND_KEEPALIVE, b"")
            if m is None
            else b"".join(message_frames(tx, m, record_size=record_size))
        )
    events: list[StreamEvent] = []
    for chunk in _chunks(bytes(wire), cuts):
        s.receive_data(bytearray(chunk) if as_bytearray else chunk)
        events += s.events()
    assert events[0] == ConfirmReceived()
    assert [e for e in events[1:] if not isinstance(e, MessageReceived)] == [
        KeepaliveReceived() for m in messages if m is None
    ]
    assert payloads(events) == [m for m in messages if m is not None]
    assert budget.used == 0 and not s.in_frame and s.bytes_in == len(wire)


# --- the handshake hands over at the frame boundary ---------------------------------------


def _exact(hs: ClientHandshake | ServerHandshake, data: bytes) -> bytes:
    """Feed ``data`` as an exact reader would; return what the machine did not ask for."""
    while data and hs.bytes_needed:
        n = hs.bytes_needed
        assert n > 0
        hs.receive_data(data[:n])
        data = data[n:]
    return data


def test_handshake_bytes_needed_stops_at_the_first_frame() -> None:
    from tests.wire.test_handshake import pair

    c, s = pair()
    msg1 = c.data_to_send()
    assert _exact(s, msg1 + b"first frame") == b"first frame"
    assert s.result is not None and s.bytes_needed == 0
    msg2 = s.data_to_send()
    assert _exact(c, msg2 + b"first frame") == b"first frame"
    assert c.result is not None and c.bytes_needed == 0


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_handshake_bytes_needed_is_positive_until_it_finishes(data: bytes) -> None:
    from tests.wire.test_handshake import pair

    _, s = pair()
    rest = _exact(s, data)
    assert s.finished or (not rest and s.bytes_needed > 0)
    assert s.error is None or isinstance(s.error, HandshakeError)


# --- bounds at their edges, and what a failure leaves --------------------------------------------
def test_the_budget_is_a_hard_limit_that_a_request_may_fill_exactly() -> None:
    b = MemoryBudget(100)
    assert (b.used, b.peak, b.refusals) == (0, 0, 0)
    assert b.take(60) and b.take(40) and (b.used, b.peak) == (100, 100)
    assert not b.take(1) and not b.take(1) and b.refusals == 2 and b.used == 100
    b.give(70)
    assert b.take(10) and (b.used, b.peak) == (40, 100)


def test_a_frame_of_max_frame_and_a_message_of_max_message_pass_through_a_stream() -> None:
    tx, rx = ends()
    budget = MemoryBudget(100)
    s = FrameStream(rx, max_frame=64, max_message=100, budget=budget)
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, bytes(64))))
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(60)) + tx.seal(KIND_END, bytes(40))))
    assert payloads(drain(s)) == [bytes(64), bytes(100)]
    assert s.frames_in == 3 and s.bytes_in == 3 * (HEADER_LEN + 16) + 64 + 100
    assert budget.used == 0 and budget.peak == 100
    tx, rx = ends()
    s = FrameStream(rx, budget=MemoryBudget(50))
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(51))))
    with pytest.raises(
        BudgetExceeded,
        match="^reassembling a message would pass this node's 50-byte budget for messages in flight$",
    ):
        s.next_event()
    tx, rx = ends()
    s = FrameStream(rx, max_message=100)
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(60)) + tx.seal(KIND_END, bytes(41))))
    with pytest.raises(FrameTooLarge, match="^message exceeds the 100-byte cap$"):
        s.next_event()


def test_a_failed_stream_keeps_its_first_error_and_holds_nothing() -> None:
    tx, rx = ends()
    budget = MemoryBudget()
    s = FrameStream(rx, max_frame=64, budget=budget)
    s.receive_data(bytes(tx.seal(KIND_PART, bytes(10))))
    s.receive_data(HEADER.pack(KIND_MESSAGE, 65))
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, b"after")))  # ignored: the stream failed
    with pytest.raises(FrameTooLarge, match="^frame announces 65 bytes, cap is 64$"):
        s.next_event()
    assert not s.in_frame and s.bytes_needed == HEADER_LEN and budget.used == 0
    s.close()  # closing a failed stream keeps the first error
    with pytest.raises(FrameTooLarge):
        s.next_event()
    s = FrameStream(rx)
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, b"x"))[:3])
    s.close()
    assert not s.in_frame and s.bytes_needed == HEADER_LEN
    with pytest.raises(FrameError, match="^frame stream closed$"):
        s.next_event()


def test_a_bytearray_fed_and_then_reused_never_changes_a_delivered_payload() -> None:
    """An I/O layer reuses its read buffer: payloads that are views into it must be copied."""
    for mode in ("unprotected", "hmac-sha256"):
        tx, rx = ends(mode)
        s = FrameStream(rx)
        buf = bytearray(tx.seal(KIND_MESSAGE, b"first") + tx.seal(KIND_MESSAGE, b"second"))
        s.receive_data(buf)
        events = drain(s)
        buf[:] = bytes(len(buf))
        assert payloads(events) == [b"first", b"second"]


def test_message_frames_bounds_are_inclusive_and_named() -> None:
    from mlxcel.wire.frames import DEFAULT_MAX_FRAME

    tx, rx = ends()
    assert len(list(message_frames(tx, bytes(10), max_message=10))) == 1
    with pytest.raises(FrameTooLarge, match="^message of 11 bytes exceeds the 10-byte cap$"):
        message_frames(tx, bytes(11), max_message=10)
    assert len(list(message_frames(tx, b"x", record_size=DEFAULT_MAX_FRAME))) == 1
    for bad in (0, DEFAULT_MAX_FRAME + 1):
        with pytest.raises(ValueError, match=f"^record_size must be 1..{DEFAULT_MAX_FRAME}$"):
            message_frames(tx, b"x", record_size=bad)


def test_an_empty_frame_of_the_unprotected_baseline_is_an_empty_message() -> None:
    """``bench frames`` compares the suites with framing alone: there an empty frame has no
    body to wait for, and is opened as soon as its header is in."""
    tx, s = Unprotected(), FrameStream(Unprotected())
    s.receive_data(bytes(tx.seal(KIND_MESSAGE, b"")))
    assert drain(s) == [MessageReceived(b"")]

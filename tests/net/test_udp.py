"""The discovery receiver's bounds, on a real UDP socket on loopback: at most ``maxsize``
datagrams wait, none larger than MAX_DATAGRAM is kept, and every drop is counted."""

from __future__ import annotations

import asyncio

from mlxcel.net.udp import MAX_DATAGRAM, BeaconReceiver, BeaconSender
from tests.conftest import free_udp_port


async def test_the_receiver_keeps_at_most_maxsize_datagrams_and_none_too_large() -> None:
    port = free_udp_port()
    rx = BeaconReceiver("127.0.0.1", port, maxsize=4)
    await rx.start()
    tx = BeaconSender("127.0.0.1", port, "127.0.0.1")
    try:
        tx.send(bytes(MAX_DATAGRAM + 1))  # too large: dropped unread
        tx.send(bytes(MAX_DATAGRAM))  # the largest kept
        for i in range(9):
            tx.send(bytes([i]))
        for _ in range(500):  # loopback delivers them all; wait for the last to be counted
            if rx.queue.qsize() + rx.dropped == 11:
                break
            await asyncio.sleep(0.01)
        assert rx.queue.qsize() == 4 and rx.dropped == 7
        got = [rx.queue.get_nowait() for _ in range(4)]
        assert [len(d) for d, _ in got] == [MAX_DATAGRAM, 1, 1, 1]
        assert {src for _, src in got} == {"127.0.0.1"}
    finally:
        tx.close()
        rx.close()


def test_a_source_budget_throttles_a_flooder_and_leaves_others_their_share() -> None:
    from mlxcel.net.udp import SourceBudget

    b = SourceBudget(rate=10.0, burst=10.0, limit=3, idle=10.0)
    assert all(b.allow("10.0.0.9", 0.0) for _ in range(10))  # a burst of 10 ...
    assert not b.allow("10.0.0.9", 0.0)  # ... then nothing ...
    assert not b.allow("10.0.0.9", 0.09)
    assert b.allow("10.0.0.9", 0.1)  # ... until a token comes back: 10 a second
    assert b.allow("10.0.0.2", 0.1)  # another source is untouched
    assert b.allow("10.0.0.3", 0.1)  # the table is now full (3)
    # Beyond it, while every source was heard within 10 s, newcomers share one bucket ...
    assert all(b.allow(f"10.1.0.{i}", 0.2) for i in range(10))
    assert not b.allow("10.1.0.99", 0.2)
    assert b.sources == ["10.0.0.9", "10.0.0.2", "10.0.0.3"]
    # ... a peer that keeps its once-a-second beacon keeps its bucket through all of it ...
    for t in range(1, 10):
        for ip in ("10.0.0.2", "10.0.0.3"):
            assert b.allow(ip, float(t))
        b.allow("10.1.0.7", t + 0.5)
        assert "10.1.0.7" not in b.sources  # a newcomer still shares while all are in use
    # ... and the one unheard for 10 s gives its bucket to the next newcomer.
    assert b.allow("10.0.0.5", 10.1)
    assert b.sources == ["10.0.0.2", "10.0.0.3", "10.0.0.5"]


async def test_the_receiver_throttles_per_source_tests_the_shape_and_counts_by_source() -> None:
    from mlxcel.net.udp import SourceBudget

    port = free_udp_port()
    rx = BeaconReceiver(
        "127.0.0.1", port, shaped=lambda d: d.startswith(b"B"), budget=SourceBudget(10.0, 3.0)
    )
    await rx.start()
    flood = BeaconSender("127.0.0.1", port, "127.0.0.1")
    peer = BeaconSender("127.0.0.1", port, "127.0.0.2")
    try:
        for _ in range(50):
            flood.send(b"B-flood")
        flood.send(b"junk")
        peer.send(b"junk")  # not shaped like a beacon
        peer.send(b"B-peer")  # its own budget: it gets through the flood
        for _ in range(500):
            if rx.stats.received == 53:
                break
            await asyncio.sleep(0.01)
        got = [rx.queue.get_nowait() for _ in range(rx.queue.qsize())]
        assert (b"B-peer", "127.0.0.2") in got
        assert [d for d, ip in got if ip == "127.0.0.1"] == [b"B-flood"] * 3  # the burst
        st = rx.stats
        assert (st.throttled, st.not_beacon, st.queue_full) == (48, 1, 0)
        assert st.by_source == {"127.0.0.1": 48, "127.0.0.2": 1} and rx.dropped == 49
    finally:
        flood.close()
        peer.close()
        rx.close()
